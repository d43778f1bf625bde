"""FifoTokenBucket: the single-queue baseline that hand-rolled limiters use today.

One ``asyncio.Lock`` (FIFO) for everybody; the caller holding it sleeps until its tokens have
refilled, takes them and lets the next one in. It limits the rate correctly and consumes
nothing when cancelled, but it is unfair: a key that queues 1,000 callers is served 1,000
times before a key that queues one. It exists as the comparison point for the benchmark
(``benchmarks/ratelimit.py``); use :class:`FairAsyncTokenBucket` in pipelines.

Unlike the fair bucket it is bound to one event loop, and ``aclose()`` does not interrupt a
sleeping caller: queued callers get :class:`LimiterClosed` when their turn comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable

from pipeline.ratelimit._checks import positive
from pipeline.ratelimit._drr import EPS
from pipeline.ratelimit._errors import LimiterClosed
from pipeline.ratelimit._stats import BucketStats, Tally


class FifoTokenBucket:
    """A token bucket with one FIFO queue; same interface as :class:`FairAsyncTokenBucket`.

    Args:
        rate: tokens added per second.
        capacity: burst size; defaults to ``max(1, rate)``.
        clock: monotonic seconds, advancing with the event loop's clock.
        name: used in errors and stats.

    Raises:
        ValueError: ``rate`` or ``capacity`` is not a finite number > 0.
    """

    def __init__(self, rate: float, capacity: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic, name: str = "ratelimit-fifo"):
        self._rate = positive("rate", rate)
        self._capacity = positive("capacity", max(1.0, rate) if capacity is None else capacity)
        self._clock = clock
        self.name = name
        self._tokens = self._capacity
        self._stamp = self._created = clock()
        self._discarded = 0.0
        self._lock = asyncio.Lock()
        self._queued: Counter[Hashable] = Counter()
        self._tally = Tally(busy=self._queued)
        self._closed = False

    @property
    def rate(self) -> float:
        """Tokens added per second."""
        return self._rate

    @property
    def capacity(self) -> float:
        """Most tokens the bucket holds."""
        return self._capacity

    async def acquire(
        self, key: Hashable = None, cost: float = 1.0, timeout: float | None = None  # noqa: ASYNC109
    ) -> None:
        """Take ``cost`` tokens, after every caller that came earlier, whatever its key.

        Args:
            key: only used for statistics.
            cost: tokens to take.
            timeout: seconds to wait at most; None waits forever.

        Raises:
            TimeoutError: the tokens did not come within ``timeout``; nothing was consumed.
            LimiterClosed: the bucket is closed.
            ValueError: ``cost`` is not > 0 or exceeds the capacity.
        """
        cost = positive("cost", cost)
        if cost > self._capacity:
            raise ValueError(f"cost={cost} exceeds capacity={self._capacity} of rate limiter"
                             f" {self.name!r}; it could never be granted")
        self._check_open(key)
        if not self._queued and self._take(cost):
            self._tally.record_grant(key, cost, 0.0)
            return
        queued_at = self._clock()
        self._queued[key] += 1
        try:
            async with asyncio.timeout(timeout), self._lock:
                while True:
                    self._check_open(key)
                    if self._take(cost):
                        break
                    await asyncio.sleep((cost - self._tokens) / self._rate)
        except TimeoutError:
            self._tally.record_timeout(key)
            raise
        except asyncio.CancelledError:
            self._tally.record_cancel(key)
            raise
        finally:
            self._queued[key] -= 1
            if not self._queued[key]:
                del self._queued[key]
        self._tally.record_grant(key, cost, self._clock() - queued_at)

    @contextlib.asynccontextmanager
    async def limit(
        self, key: Hashable = None, cost: float = 1.0, timeout: float | None = None  # noqa: ASYNC109
    ) -> AsyncIterator[None]:
        """``async with bucket.limit(key, cost):``; see :meth:`acquire`."""
        await self.acquire(key, cost, timeout)
        yield

    def stats(self) -> BucketStats:
        """A snapshot of totals, per-key figures and the accounting ledger.

        Returns:
            The bucket's :class:`BucketStats`.
        """
        self._refill()
        capture = self._tally.capture(self._queued, lambda key: 1.0)
        return capture.snapshot(
            name=self.name, rate=self._rate, capacity=self._capacity, available=self._tokens,
            closed=self._closed,
            in_flight=0.0,  # tokens are taken by the caller's own coroutine: no hand-off
            accrued=self._capacity + (self._stamp - self._created) * self._rate,
            discarded=self._discarded,
        )

    @property
    def leaked_tokens(self) -> float:
        """Tokens issued but neither returned nor refunded; always 0."""
        return self._tally.leaked(0.0)

    async def aclose(self) -> None:
        """Refuse new acquires; queued callers get :class:`LimiterClosed` on their turn."""
        self._closed = True

    def _check_open(self, key: Hashable) -> None:
        if self._closed:
            raise LimiterClosed(f"rate limiter {self.name!r} is closed; acquire(key={key!r})"
                                " refused")

    def _refill(self) -> None:
        now = self._clock()
        if now > self._stamp:
            self._tokens += (now - self._stamp) * self._rate
            self._stamp = now
            if self._tokens > self._capacity:
                self._discarded += self._tokens - self._capacity
                self._tokens = self._capacity

    def _take(self, cost: float) -> bool:
        self._refill()
        if self._tokens < cost - EPS:
            return False
        self._tokens -= cost
        return True

