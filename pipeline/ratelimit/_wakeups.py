"""The timers of a bucket shared by several event loops: one on every loop with callers queued.

When the next queued caller must wait for tokens, one timer (``call_later``) is set on *every*
loop that has callers queued, so a loop that is busy or gone cannot hold up the others;
whichever fires first dispatches for all. Nothing here starts a task, and once the queue is
empty no timer is left anywhere.

All methods run under the bucket's lock; the timer callbacks take the lock themselves.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.ratelimit._waiter import running_loop


@dataclass(eq=False, slots=True)
class _Wakeup:
    loop: asyncio.AbstractEventLoop
    at: float  # bucket clock
    on_due: Callable[[float], None]  # the bucket's dispatch, called under its lock
    handle: asyncio.TimerHandle | None = None


class Wakeups:
    """Which loops have callers queued, and the one timer armed on each.

    Args:
        lock: the bucket's lock.
        clock: the bucket's clock (monotonic seconds).
        tolerance: a timer due at most this much later than asked is early enough.
    """

    def __init__(self, lock: threading.Lock, clock: Callable[[], float],
                 tolerance: float) -> None:
        self._lock = lock
        self._clock = clock
        self._tolerance = tolerance
        self._loops: dict[asyncio.AbstractEventLoop, int] = {}  # callers queued per loop
        self._armed: dict[asyncio.AbstractEventLoop, _Wakeup] = {}

    def add(self, loop: asyncio.AbstractEventLoop) -> None:
        """A caller queued on ``loop``."""
        self._loops[loop] = self._loops.get(loop, 0) + 1

    def remove(self, loop: asyncio.AbstractEventLoop) -> None:
        """A caller of ``loop`` left the queue; the loop's timer goes with its last one."""
        left = self._loops.get(loop, 0) - 1
        if left > 0:
            self._loops[loop] = left
            return
        self._loops.pop(loop, None)
        wakeup = self._armed.pop(loop, None)
        if wakeup is not None:
            _cancel(wakeup)

    def clear(self) -> None:
        """Forget every queued caller (the bucket closed); :meth:`disarm` stops the timers."""
        self._loops.clear()

    def arm(self, at: float, on_due: Callable[[float], None]) -> None:
        """A timer at ``at`` on every loop with callers queued, calling ``on_due(now)``."""
        running = running_loop()
        for loop in list(self._loops):
            wakeup = self._armed.get(loop)
            if wakeup is not None:
                if wakeup.at <= at + self._tolerance:
                    continue  # early enough; if early, it dispatches nothing and re-arms
                _cancel(wakeup)
            wakeup = self._armed[loop] = _Wakeup(loop, at, on_due)
            if running is loop:
                self._schedule(wakeup)
                continue
            try:
                loop.call_soon_threadsafe(self._schedule_locked, wakeup)
            except RuntimeError:  # loop closed; the next dispatch drops its waiters
                del self._armed[loop]

    def disarm(self) -> None:
        """Stop every timer."""
        wakeups = list(self._armed.values())
        self._armed.clear()
        for wakeup in wakeups:
            _cancel(wakeup)

    def _schedule(self, wakeup: _Wakeup) -> None:
        delay = max(0.0, wakeup.at - self._clock())
        wakeup.handle = wakeup.loop.call_later(delay, self._on_wakeup, wakeup)

    def _schedule_locked(self, wakeup: _Wakeup) -> None:
        with self._lock:
            if self._armed.get(wakeup.loop) is wakeup and wakeup.handle is None:
                self._schedule(wakeup)

    def _on_wakeup(self, wakeup: _Wakeup) -> None:
        with self._lock:
            if self._armed.get(wakeup.loop) is not wakeup:
                return
            del self._armed[wakeup.loop]
            wakeup.on_due(self._clock())


def _cancel(wakeup: _Wakeup) -> None:
    # TimerHandle.cancel is not thread-safe: a timer on another thread's loop is left to
    # fire once and find itself superseded.
    if wakeup.handle is not None and running_loop() is wakeup.loop:
        wakeup.handle.cancel()
