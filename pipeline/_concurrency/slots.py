"""A FIFO concurrency limit that stays cheap with thousands of waiters."""

from __future__ import annotations

import asyncio
import collections


class FifoSlots:
    """FIFO concurrency slots for one event loop: ``async with slots:`` holds one.

    Used instead of ``asyncio.Semaphore``, whose ``locked()`` on Python 3.11 scans every
    waiter on each acquire, which is quadratic with thousands of queued samples. A waiter
    cancelled after being handed a slot passes it on.

    The size can change while slots are held (:meth:`resize`, adaptive concurrency): a
    shrink below the slots held leaves ``free`` negative, a debt the next releases pay back
    before anyone else is let in.
    """

    __slots__ = ("free", "size", "waiters")

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def in_use(self) -> int:
        """Slots held now."""
        return self.size - self.free

    def resize(self, size: int) -> None:
        """Make the limit ``size`` (>= 1): growing lets waiters in now; shrinking takes
        effect as held slots are given back (none is taken away)."""
        self.free += size - self.size
        self.size = size
        while self.free > 0 and self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.free -= 1
                waiter.set_result(None)

    async def __aenter__(self) -> None:
        if not self.take_now():
            await self.wait()

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def take_now(self) -> bool:
        """Take a free slot without waiting, if one is free and nobody queues for one."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return True
        return False

    async def wait(self) -> None:
        """Queue for a slot (FIFO) and hold it once granted; :meth:`release` gives it back.
        A waiter cancelled after being granted passes the slot on.

        Written out here rather than through a helper that takes the pass-on as a callback:
        each queued sample would hold that helper's frame and a bound method as well, two
        more objects per waiter for the collector to walk."""
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release()
            raise

    def release(self) -> None:
        """Give a held slot back: to the first waiter still waiting, else to the pool (or
        to the debt a shrink left)."""
        if self.free < 0:
            self.free += 1
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.free += 1

