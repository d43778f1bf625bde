"""FairAsyncTokenBucket: a token bucket whose waiters are served fairly across keys.

Tokens refill continuously at ``rate`` per second up to ``capacity``. A caller that finds
tokens and nobody queued takes them at once: a lock, a clock read and some arithmetic, no
future and no task. Otherwise it queues under its key; queued callers are served in deficit
round-robin order across keys (see ``_drr.py``) and FIFO within a key.

Ideal times (GCRA-style): while callers are queued, each grant is booked at its *ideal time*,
the moment its tokens were due (``rate`` per second after the previous grant), not at the
moment a possibly late timer got to run. Lateness therefore never costs tokens: the long-run
rate is exact however late the loop wakes up. The bucket is clipped at ``capacity`` only while
nobody is queued. The guarantee, precisely:

* Counted from any moment the bucket was full, the tokens granted by time ``t`` never exceed
  ``capacity + rate * (t - that moment)``: the bucket is never more than ``capacity`` tokens
  ahead of the ideal schedule (a bucket that starts full and refills at ``rate``).
* No grant comes before its ideal time. A loop that runs late by ``L`` seconds delivers the
  grants that fell due meanwhile together when it runs: one burst of up to
  ``capacity + rate * L`` tokens, after which the schedule goes on as if punctual. On a
  punctual loop ``L = 0``: no window of length ``T`` gets more than ``capacity + rate * T``,
  plus the tokens of grants refunded meanwhile.

Threads and loops: all state sits behind one ``threading.Lock`` and every queued caller
carries its own event loop (``_waiter.py``); a grant resolves the caller's future on that
loop. While the next caller must wait for tokens a timer is armed on every loop with callers
queued (``_wakeups.py``); the bucket starts no task, and once the queue is empty nothing of it
is scheduled anywhere.

Cancellation: the lock-protected waiter state, not the future, decides who owns tokens. A
caller cancelled or timed out while queued leaves the queue and has consumed nothing; a
caller cancelled after its grant but before it resumed gives its tokens back (a refund) as if
the grant had never happened: they are credited in full, refill that accrued meanwhile
included, unless the bucket filled up since the grant (then, as with any refill of a full
bucket, they are counted as ``discarded``). The next caller is served from them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Hashable, Mapping

import structlog

from pipeline.ratelimit._checks import positive
from pipeline.ratelimit._drr import EPS, DeficitRoundRobin
from pipeline.ratelimit._errors import LimiterClosed
from pipeline.ratelimit._stats import MAX_KEYS, BucketStats, Tally
from pipeline.ratelimit._waiter import State, Waiter, notify, settle
from pipeline.ratelimit._wakeups import Wakeups

_logger = structlog.get_logger("pipeline.ratelimit")


class FairAsyncTokenBucket:
    """An async token bucket, fair across keys, usable from several event loops and threads.

    Grants while callers are queued are booked at their ideal times, so a late loop delays
    grants but never loses rate; see the module docstring for the exact burst guarantee.

    Args:
        rate: tokens added per second.
        capacity: most tokens the bucket holds (the burst); defaults to ``max(1, rate)``.
        weights: initial per-key weights; a key's share of a contended bucket is
            proportional to its weight (default 1).
        quantum: tokens credited per round-robin turn to a key of weight 1.
        clock: monotonic seconds; inject a virtual clock in tests. Timers run on the event
            loop's clock, so the two must advance together.
        name: used in errors, logs and stats.
        max_keys: keys whose statistics are kept separately; beyond it the least recently
            active idle keys are folded into one aggregate (``BucketStats.folded``).

    Raises:
        ValueError: ``rate``, ``capacity``, ``quantum`` or a weight is not a finite number > 0,
            or ``max_keys`` < 1.
    """

    def __init__(
        self,
        rate: float,
        capacity: float | None = None,
        *,
        weights: Mapping[Hashable, float] | None = None,
        quantum: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        name: str = "ratelimit",
        max_keys: int = MAX_KEYS,
    ) -> None:
        self._rate = positive("rate", rate)
        self._capacity = positive("capacity", max(1.0, rate) if capacity is None else capacity)
        self._clock = clock
        self.name = name
        self._lock = threading.Lock()
        # The level at time t >= _stamp is _tokens + rate * (t - _stamp); clipped at capacity
        # only while nobody is queued (_advance), so queued grants keep their ideal times.
        self._tokens = self._capacity
        self._stamp = self._created = self._full_at = clock()
        self._discarded = 0.0
        self._queue: DeficitRoundRobin[Waiter] = DeficitRoundRobin(positive("quantum", quantum))
        self._granted: set[Waiter] = set()
        self._wakeups = Wakeups(self._lock, clock, EPS / self._rate)
        self._tally = Tally(max_keys, busy=self._queue)
        self._closed = False
        for key, weight in (weights or {}).items():
            self.set_weight(key, weight)

    def __repr__(self) -> str:
        return (f"FairAsyncTokenBucket(name={self.name!r}, rate={self._rate},"
                f" capacity={self._capacity})")

    @property
    def rate(self) -> float:
        """Tokens added per second."""
        return self._rate

    @property
    def capacity(self) -> float:
        """Most tokens the bucket holds."""
        return self._capacity

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def set_weight(self, key: Hashable, weight: float) -> None:
        """Set the fair-share weight of ``key``; it applies from the key's next turn.

        Args:
            key: the key as passed to :meth:`acquire`.
            weight: relative share when the bucket is contended.

        Raises:
            ValueError: ``weight`` is not a finite number > 0.
        """
        weight = positive("weight", weight)
        with self._lock:
            self._queue.set_weight(key, weight)

    async def acquire(
        self, key: Hashable = None, cost: float = 1.0, timeout: float | None = None  # noqa: ASYNC109
    ) -> None:
        """Take ``cost`` tokens for ``key``, waiting for them (fairly) if needed.

        Args:
            key: who is asking (a tenant, a task family, a prompt group); fairness is across
                keys. Any number of keys is fine: statistics are kept for the most recently
                active ``max_keys`` and the rest are folded into one aggregate.
            cost: tokens to take.
            timeout: seconds to wait at most; None waits forever, 0 only takes free tokens.
                It is a timer on the caller's loop that settles the wait; it never cancels
                the calling task, and a grant that comes first wins.

        Raises:
            TimeoutError: the tokens did not come within ``timeout``; nothing was consumed.
            LimiterClosed: the bucket is closed, or was closed while waiting.
            ValueError: ``cost`` is not > 0, exceeds the capacity, or ``timeout`` is < 0.
        """
        cost = self._check_cost(cost)
        if timeout is not None:
            if not timeout >= 0:
                raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
            if math.isinf(timeout):
                timeout = None
        with self._lock:
            if self._closed:
                raise LimiterClosed(
                    f"rate limiter {self.name!r} is closed; acquire(key={key!r}) refused")
            now = self._clock()
            if self._queue.waiting:
                self._dispatch(now)  # serve those ahead first
            if not self._queue.waiting:  # _advance(now), inlined: this is every acquire
                tokens = self._tokens + (now - self._stamp) * self._rate
                self._stamp = now
                if tokens >= self._capacity - EPS:
                    if tokens > self._capacity:
                        self._discarded += tokens - self._capacity
                        tokens = self._capacity
                    self._full_at = now
                self._tokens = tokens
                if tokens >= cost - EPS:
                    self._tokens = tokens - cost
                    self._tally.record_grant(key, cost, 0.0)
                    return
            if timeout == 0:
                self._tally.record_timeout(key)
                raise TimeoutError(self._timeout_message(key, cost, timeout))
            loop = asyncio.get_running_loop()
            waiter = Waiter(key, cost, loop, loop.create_future(), now)
            self._queue.push(waiter)
            self._wakeups.add(loop)
            self._dispatch(now)
        await self._wait(waiter, timeout)

    @contextlib.asynccontextmanager
    async def limit(
        self, key: Hashable = None, cost: float = 1.0, timeout: float | None = None  # noqa: ASYNC109
    ) -> AsyncIterator[None]:
        """``async with bucket.limit(key, cost):`` runs the body once the tokens are taken.

        Tokens are spent, not lent: leaving the block gives nothing back. Arguments and
        errors are those of :meth:`acquire`.
        """
        await self.acquire(key, cost, timeout)
        yield

    def give_back(self, cost: float, *, granted_at: float, key: Hashable = None) -> bool:
        """Hand back ``cost`` tokens of a grant that returned at ``granted_at`` but went unused.

        For callers that take tokens ahead of use (a fleet limiter leasing a batch to a
        worker): the tokens are credited as if never granted, unless the bucket was seen full
        since ``granted_at`` (they would have overflowed; counted as ``discarded``), so the
        burst guarantee holds. Queued callers are served from them at once.

        Args:
            cost: tokens to hand back (at most what the grant took).
            granted_at: this bucket's clock when ``acquire`` returned.
            key: the grant's key (for the per-key statistics).

        Returns:
            Whether the tokens were credited (False: the bucket had filled up since).

        Raises:
            ValueError: ``cost`` is not a finite number > 0 or exceeds the capacity.
        """
        cost = self._check_cost(cost)
        with self._lock:
            now = self._clock()
            self._dispatch(now)
            idle = not self._queue.waiting
            if idle:
                self._advance(now)
            credited = granted_at >= self._full_at
            if credited:
                self._tokens += cost
                if idle:
                    self._clip(now)
            else:
                self._discarded += cost
            self._tally.record_give_back(key, cost)
            self._dispatch(now)
        return credited

    def stats(self) -> BucketStats:
        """A snapshot of totals, per-key figures and the accounting ledger.

        Only the raw counters are copied under the bucket's lock (about a millisecond at
        ``max_keys`` keys); percentiles and the snapshot are computed after releasing it,
        so acquirers on other threads are not held up.

        Returns:
            The bucket's :class:`BucketStats`.
        """
        with self._lock:
            now = self._clock()
            if self._queue.waiting:
                self._dispatch(now)
            if not self._queue.waiting:
                self._advance(now)
            available = self._tokens + (now - self._stamp) * self._rate
            capture = self._tally.capture(self._queue.queue_lens(), self._queue.weight)
            in_flight = self._in_flight()
            accrued = self._capacity + (now - self._created) * self._rate
            discarded, closed = self._discarded, self._closed
        return capture.snapshot(
            name=self.name, rate=self._rate, capacity=self._capacity, available=available,
            closed=closed, in_flight=in_flight, accrued=accrued, discarded=discarded)

    @property
    def leaked_tokens(self) -> float:
        """Tokens issued but neither returned, refunded nor still in flight; always 0."""
        with self._lock:
            return self._tally.leaked(self._in_flight())

    async def aclose(self) -> None:
        """Refuse new acquires and wake every queued caller with :class:`LimiterClosed`.

        Callers already granted keep their tokens. Closing twice is a no-op.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiters = self._queue.drain()
            self._wakeups.clear()
            for waiter in waiters:
                waiter.state = State.DROPPED
                notify(waiter, LimiterClosed(
                    f"rate limiter {self.name!r} was closed while acquire(key={waiter.key!r},"
                    f" cost={waiter.cost}) waited"))
            self._wakeups.disarm()
        if waiters:
            _logger.info("ratelimit.closed", limiter=self.name, woken=len(waiters))

    # -- waiting ---------------------------------------------------------------------------

    async def _wait(self, waiter: Waiter, limit_s: float | None) -> None:
        expiry = None
        if limit_s is not None:
            expiry = waiter.loop.call_later(limit_s, self._expire, waiter, limit_s)
        try:
            await waiter.future
        except BaseException:
            with self._lock:
                self._abandon(waiter)
            raise
        finally:
            if expiry is not None:
                expiry.cancel()
        with self._lock:
            assert waiter.state is State.GRANTED, waiter.state
            waiter.state = State.RETURNED
            self._granted.discard(waiter)
            self._tally.record_return(waiter.key, waiter.cost, waiter.granted_at - waiter.queued_at)

    def _abandon(self, waiter: Waiter) -> None:
        # The caller is leaving with an exception (cancelled, most likely). Under the lock.
        if waiter.state is State.QUEUED:
            self._unqueue(waiter)
            waiter.state = State.DROPPED
            self._tally.record_cancel(waiter.key)
            self._dispatch(self._clock())  # the head may have changed
        elif waiter.state is State.GRANTED:
            now = self._clock()
            self._dispatch(now)  # what fell due meanwhile keeps its ideal time
            idle = not self._queue.waiting
            if idle:
                self._advance(now)  # did the bucket fill up since the grant?
            if waiter.ideal >= self._full_at:
                self._tokens += waiter.cost  # as if the grant had never happened
                if idle:
                    self._clip(now)
            else:  # the bucket was full after the grant: these tokens would have overflowed
                self._discarded += waiter.cost
            waiter.state = State.REFUNDED
            self._granted.discard(waiter)
            self._tally.record_refund(waiter.key, waiter.cost)
            self._dispatch(now)

    def _expire(self, waiter: Waiter, timeout: float) -> None:
        # Timer on the caller's own loop: a grant that won the race under the lock stands.
        with self._lock:
            if waiter.state is not State.QUEUED:
                return
            self._unqueue(waiter)
            waiter.state = State.DROPPED
            self._tally.record_timeout(waiter.key)
            self._dispatch(self._clock())
        message = self._timeout_message(waiter.key, waiter.cost, timeout)
        settle(waiter.future, TimeoutError(message))

    # -- granting (all under the lock) -----------------------------------------------------

    def _advance(self, now: float) -> None:
        # Refill up to now and clip at capacity. Only while nobody is queued: a full bucket
        # with nobody to serve is the one place tokens are lost, and they are counted.
        elapsed = now - self._stamp
        if elapsed > 0:
            self._tokens += elapsed * self._rate
            self._stamp = now
        self._clip(self._stamp)

    def _clip(self, now: float) -> None:
        # _full_at: the latest moment the bucket was seen full; a refund of a grant made
        # before it is worth nothing (the tokens would have overflowed).
        if self._tokens >= self._capacity - EPS:
            if self._tokens > self._capacity:
                self._discarded += self._tokens - self._capacity
                self._tokens = self._capacity
            self._full_at = max(self._full_at, now)

    def _dispatch(self, now: float) -> None:
        rate = self._rate
        while (waiter := self._queue.head()) is not None:
            if waiter.loop.is_closed():  # its caller can never resume
                self._unqueue(waiter)
                waiter.state = State.DROPPED
                continue
            due = self._stamp + (waiter.cost - self._tokens) / rate  # its tokens are there
            if due > now + EPS / rate:
                self._wakeups.arm(due, self._dispatch)
                return
            self._queue.pop()
            self._wakeups.remove(waiter.loop)
            # Book the grant at its ideal time, however late this code runs: lateness is
            # not lost at the capacity cap, so the rate holds under a late loop.
            ideal = min(now, max(waiter.queued_at, self._stamp, due))
            self._tokens += (ideal - self._stamp) * rate - waiter.cost
            self._stamp = ideal
            waiter.state = State.GRANTED
            waiter.granted_at, waiter.ideal = now, ideal
            self._granted.add(waiter)
            self._tally.record_issue(waiter.cost)
            notify(waiter, None)
        self._wakeups.disarm()

    def _unqueue(self, waiter: Waiter) -> None:
        if self._queue.remove(waiter):
            self._wakeups.remove(waiter.loop)

    # -- helpers ---------------------------------------------------------------------------

    def _in_flight(self) -> float:
        return math.fsum(w.cost for w in self._granted)

    def _check_cost(self, cost: float) -> float:
        if type(cost) is not float:
            cost = positive("cost", cost)
        elif not 0 < cost < math.inf:
            raise ValueError(f"cost must be a finite number > 0, got {cost!r}")
        if cost > self._capacity:
            raise ValueError(
                f"cost={cost} exceeds capacity={self._capacity} of rate limiter {self.name!r};"
                " it could never be granted")
        return cost

    def _timeout_message(self, key: Hashable, cost: float, timeout: float | None) -> str:
        return (f"acquire(key={key!r}, cost={cost}) on rate limiter {self.name!r}"
                f" timed out after {timeout}s")
