"""How long CPython's cyclic garbage collector has held the interpreter, for the watchdog.

A full pass over a heap of millions of tracked objects (a batch of 100,000 samples) holds the
GIL for up to a second. No other thread runs meanwhile, so a watchdog can only notice the
blocked loop once the pass is over, and the loop thread's stack it reads then shows whatever
line the loop had reached, not the collector. :data:`COLLECTOR` adds up the time of every
pass through ``gc.callbacks`` (an observer: the collector's settings are left alone), and the
watchdog reports, with each block, how much of it the collector took.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any


class CollectorTime:
    """The collector's passes, timed from ``gc.callbacks`` while anyone is attached."""

    __slots__ = ("_lock", "_started", "_users", "total_s")

    def __init__(self) -> None:
        self.total_s = 0.0
        """Seconds of collector passes while attached (read it before and after a span)."""
        self._started: float | None = None
        self._users = 0
        self._lock = threading.Lock()

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        # Called for every pass of every generation: kept to a clock read and an add.
        if phase == "start":
            self._started = time.monotonic()
        elif self._started is not None:
            self.total_s += time.monotonic() - self._started
            self._started = None

    def attach(self) -> None:
        """Start timing (counted: the observer stays until every user detached)."""
        with self._lock:
            self._users += 1
            if self._users == 1:
                gc.callbacks.append(self)

    def detach(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self in gc.callbacks:
                gc.callbacks.remove(self)


COLLECTOR = CollectorTime()
