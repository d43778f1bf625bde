"""Bounded waits of the async tests: one poll loop for every module that waits on a condition
(an engine's queue, a server's health, a Ray worker's replacement)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable


async def until(condition: Callable[[], object], limit_s: float = 30.0, *,
                what: str = "condition", every_s: float = 0.01) -> float:
    """Poll ``condition`` every ``every_s`` seconds until it is true or ``limit_s`` seconds
    (wall clock: a test may bound how soon something happens) have passed; the seconds it
    took.

    Raises:
        AssertionError: naming ``what`` when the condition was not true in time.
    """
    start = time.monotonic()
    for _ in range(math.ceil(limit_s / every_s) + 1):
        if condition():
            return time.monotonic() - start
        if time.monotonic() - start >= limit_s:
            break
        await asyncio.sleep(every_s)
    raise AssertionError(f"{what} not reached in {limit_s:g} s")
