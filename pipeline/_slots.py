"""A FIFO concurrency limit that stays cheap with thousands of waiters."""

from __future__ import annotations

import asyncio
import collections


class FifoSlots:
    """FIFO concurrency slots for one event loop: ``async with slots:`` holds one.

    Used instead of ``asyncio.Semaphore``, whose ``locked()`` on Python 3.11 scans every
    waiter on each acquire, which is quadratic with thousands of queued samples. A waiter
    cancelled after being handed a slot passes it on.
    """

    __slots__ = ("free", "waiters")

    def __init__(self, size: int) -> None:
        self.free = size
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def __aenter__(self) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # the slot was ours already: hand it on
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self._release()

    def _release(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1
