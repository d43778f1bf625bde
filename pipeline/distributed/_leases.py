"""The worker side of the fleet limiter: callers queue here, tokens come in leases.

A worker's :class:`FleetLimiterRegistry` (installed by the pool as ``resources.limiters``)
gives a :class:`LeasedBucket` per limit, a drop-in ``FairAsyncTokenBucket`` whose tokens are
leased from the :class:`~pipeline.distributed.LimiterActor` (``_limiter.py``):

- callers queue per key (FIFO), and at most ``max_leases`` lease requests per key are
  outstanding, each for the key's unmet demand up to ``lease_tokens``;
- tokens of a lease that nobody is left to use (callers cancelled or timed out meanwhile) are
  handed back to the actor, which credits them if its ledger allows;
- a lease the actor refuses, or an actor that is gone, fails the key's queued callers with a
  :class:`~pipeline.ratelimit.RateLimitError` (the actor's own error when it raised one).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import structlog

from pipeline.distributed._limiter import EPS
from pipeline.ratelimit import (
    BucketStats,
    FairAsyncTokenBucket,
    KeyStats,
    LimiterClosed,
    LimiterConflict,
    LimiterRegistry,
    RateLimitError,
)

_logger = structlog.get_logger("pipeline.distributed")


@dataclass(eq=False, slots=True)
class _Wait:
    cost: float
    future: asyncio.Future[None]
    served: bool = False
    dropped: bool = False  # left the queue in _serve: its caller was cancelled meanwhile


@dataclass(slots=True)
class _Key:
    waiters: deque[_Wait] = field(default_factory=deque)
    queued: float = 0.0  # cost of the waiters
    pool: float = 0.0  # leased tokens not handed to a caller yet
    pool_since: float = math.inf  # grant time of the oldest lease in the pool
    requested: float = 0.0  # tokens of lease requests outstanding
    leases: int = 0
    grants: int = 0
    tokens: float = 0.0
    handed_back: float = 0.0
    timeouts: int = 0
    cancelled: int = 0


class LeasedBucket(FairAsyncTokenBucket):
    """A worker's view of a fleet-wide limit: callers queue here, tokens come in leases.

    A drop-in ``FairAsyncTokenBucket`` for the stages (``acquire``/``limit``, same errors),
    used from the worker's one event loop. ``stats()`` is this worker's share; the fleet's
    figures are ``await pool.limiter_stats()``.
    """

    def __init__(self, actor: Any, worker: str, name: str, rate: float, capacity: float, *,
                 lease_tokens: float, max_leases: int = 2) -> None:
        super().__init__(rate, capacity, name=name)
        self._actor = actor
        self._worker = worker
        self._lease_tokens = max(1.0, min(lease_tokens, self.capacity))
        self._max_leases = max_leases
        self._keys: dict[Hashable, _Key] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._is_closed = False
        self.leases = 0
        """Lease requests sent to the actor (figures: calls served per round trip)."""

    @property
    def closed(self) -> bool:
        return self._is_closed

    async def acquire(self, key: Hashable = None, cost: float = 1.0,
                      timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Take ``cost`` tokens for ``key`` from the fleet's limit; see the base class."""
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 < cost < math.inf:
            raise ValueError(f"cost must be a finite number > 0, got {cost!r}")
        if cost > self.capacity:
            raise ValueError(f"cost={cost} exceeds capacity={self.capacity} of rate limiter "
                             f"{self.name!r}; it could never be granted")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        if self._is_closed:
            raise LimiterClosed(f"rate limiter {self.name!r} is closed; acquire(key={key!r}) "
                                "refused")
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _Key()
        if not state.waiters and state.pool >= cost - EPS:  # leftover of an earlier lease
            state.pool -= cost
            state.grants += 1
            state.tokens += cost
            return
        wait = _Wait(float(cost), asyncio.get_running_loop().create_future())
        state.waiters.append(wait)
        state.queued += wait.cost
        self._pump(key, state)
        try:
            async with asyncio.timeout(timeout):
                await wait.future
        except BaseException as exc:
            if wait.served:  # granted, but the caller leaves: the tokens stay for others
                state.pool += wait.cost
                state.grants -= 1
                state.tokens -= wait.cost
            elif not wait.dropped:
                state.waiters.remove(wait)
                state.queued -= wait.cost
            if isinstance(exc, TimeoutError):
                state.timeouts += 1
                raise TimeoutError(f"acquire(key={key!r}, cost={cost}) on fleet rate limiter "
                                   f"{self.name!r} timed out after {timeout}s") from None
            state.cancelled += 1
            self._serve(key, state)
            raise

    def _pump(self, key: Hashable, state: _Key) -> None:
        """Ask for the key's unmet demand, in batches, up to ``max_leases`` at once."""
        while state.leases < self._max_leases:
            need = state.queued - state.pool - state.requested
            if need <= EPS:
                return
            head = state.waiters[0].cost if state.waiters else 1.0
            cost = min(max(need, head), max(self._lease_tokens, head))
            state.leases += 1
            state.requested += cost
            self.leases += 1
            task = asyncio.get_running_loop().create_task(self._lease(key, state, cost),
                                                          name=f"lease:{self.name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _lease(self, key: Hashable, state: _Key, cost: float) -> None:
        try:
            granted_at: float = await self._actor.lease.remote(
                self._worker, self.name, self.rate, self.capacity, key, cost)
        except asyncio.CancelledError:
            state.leases -= 1
            state.requested -= cost
            raise
        except Exception as exc:  # the actor refused or is gone: the callers must know
            state.leases -= 1
            state.requested -= cost
            error = _as_limiter_error(exc, self.name)
            while state.waiters:
                wait = state.waiters.popleft()
                state.queued -= wait.cost
                wait.dropped = True
                if not wait.future.done():
                    wait.future.set_exception(error)
            return
        state.leases -= 1
        state.requested -= cost
        state.pool += cost
        state.pool_since = min(state.pool_since, granted_at)
        self._serve(key, state)
        self._pump(key, state)

    def _serve(self, key: Hashable, state: _Key) -> None:
        """Hand pooled tokens to queued callers, FIFO; hand back what nobody waits for."""
        while state.waiters and state.pool >= state.waiters[0].cost - EPS:
            wait = state.waiters.popleft()
            state.queued -= wait.cost
            if wait.future.done():  # cancelled at this instant: its tokens stay pooled
                wait.dropped = True
                continue
            state.pool -= wait.cost
            wait.served = True
            state.grants += 1
            state.tokens += wait.cost
            wait.future.set_result(None)
        if not state.waiters and state.leases == 0 and state.pool > EPS:
            self._hand_back(key, state)

    def _hand_back(self, key: Hashable, state: _Key) -> None:
        amount, since = state.pool, state.pool_since
        state.pool, state.pool_since = 0.0, math.inf
        state.handed_back += amount
        task = asyncio.get_running_loop().create_task(
            self._give_back(key, amount, since), name=f"give_back:{self.name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _give_back(self, key: Hashable, amount: float, since: float) -> None:
        try:
            await self._actor.give_back.remote(self._worker, self.name, key, amount, since)
        except Exception as exc:  # the tokens are lost to the fleet, never over-issued
            _logger.warning("fleet_limiter_give_back_failed", limiter=self.name,
                            tokens=amount, error=f"{type(exc).__name__}: {exc}")

    def stats(self) -> BucketStats:
        """This worker's figures (grants to its callers, leases, tokens handed back)."""
        keys = {k: KeyStats(key=k, weight=1.0, grants=s.grants, tokens=s.tokens,
                            wait_p50_s=None, wait_p99_s=None, queue_len=len(s.waiters),
                            timeouts=s.timeouts, cancelled=s.cancelled, refunded=s.handed_back)
                for k, s in self._keys.items()}
        tokens = math.fsum(s.tokens for s in self._keys.values())
        back = math.fsum(s.handed_back for s in self._keys.values())
        pooled = math.fsum(s.pool for s in self._keys.values())
        return BucketStats(
            name=self.name, rate=self.rate, capacity=self.capacity, available=pooled,
            closed=self._is_closed, grants=sum(s.grants for s in self._keys.values()),
            tokens=tokens, wait_p50_s=None, wait_p99_s=None,
            queue_len=sum(len(s.waiters) for s in self._keys.values()),
            timeouts=sum(s.timeouts for s in self._keys.values()),
            cancelled=sum(s.cancelled for s in self._keys.values()),
            issued=tokens + back + pooled, returned=tokens, refunded=back, in_flight=pooled,
            leaked=0.0, keys=keys)

    async def aclose(self) -> None:
        """Refuse new acquires, wake queued callers with :class:`LimiterClosed`, stop leasing."""
        if self._is_closed:
            return
        self._is_closed = True
        for key, state in self._keys.items():
            while state.waiters:
                wait = state.waiters.popleft()
                if not wait.future.done():
                    wait.future.set_exception(LimiterClosed(
                        f"rate limiter {self.name!r} was closed while acquire(key={key!r}) "
                        "waited"))
        tasks = [t for t in self._tasks if t.get_name().startswith("lease:")]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)


class FleetLimiterRegistry(LimiterRegistry):
    """A worker's limiter registry whose buckets are leased from the fleet's limiter actor.

    Installed by the pool on every worker's pipeline (``resources.limiters``), so
    ``CallTools`` and custom stages that call ``ctx.resources.limiters.get(...)`` share one
    rate per name across the fleet without a change.

    Args:
        actor: the :class:`LimiterActor` handle.
        worker: this worker's id.
        lease_s: a lease asks for at most ``rate * lease_s`` tokens (at least 1).
    """

    def __init__(self, actor: Any, worker: str, *, lease_s: float = 0.05) -> None:
        super().__init__()
        self._actor = actor
        self._worker = worker
        self._lease_s = lease_s
        self._leased: dict[str, LeasedBucket] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._leased

    def __len__(self) -> int:
        return len(self._leased)

    def get(self, name: str, rate: float, capacity: float | None = None) -> FairAsyncTokenBucket:
        """The fleet-wide limit ``name``; arguments and errors as ``LimiterRegistry.get``
        (a conflict with another worker's parameters is raised by the first acquire)."""
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
            raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
        cap = float(max(1.0, rate) if capacity is None else capacity)
        if not 0 < cap < math.inf:
            raise ValueError(f"capacity must be a finite number > 0, got {capacity!r}")
        bucket = self._leased.get(name)
        if bucket is None:
            bucket = self._leased[name] = LeasedBucket(
                self._actor, self._worker, name, float(rate), cap,
                lease_tokens=float(rate) * self._lease_s)
        elif (bucket.rate, bucket.capacity) != (rate, cap):
            raise LimiterConflict(
                f"rate limiter {name!r} already exists with rate={bucket.rate},"
                f" capacity={bucket.capacity}; requested rate={rate}, capacity={cap}")
        return bucket

    def stats(self) -> dict[str, BucketStats]:
        return {name: bucket.stats() for name, bucket in list(self._leased.items())}

    async def aclose(self) -> None:
        for bucket in list(self._leased.values()):
            await bucket.aclose()


def _as_limiter_error(exc: Exception, name: str) -> RateLimitError:
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError keeps the original
    if isinstance(cause, RateLimitError):
        return cause
    if isinstance(exc, RateLimitError):
        return exc
    error = RateLimitError(f"fleet rate limiter {name!r} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error
