"""Bounded waits of the async tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(condition: Callable[[], bool], limit_s: float = 20.0) -> None:
    """Poll ``condition`` every 10 ms, for at most ``limit_s`` seconds."""
    for _ in range(int(limit_s * 100)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")
