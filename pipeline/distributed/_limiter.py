"""One rate limit for the fleet: a limiter actor leasing token batches to workers.

Without it each worker's :class:`~pipeline.ratelimit.FairAsyncTokenBucket` holds its tool's
``rate`` on its own, so ``N`` workers call a tool ``N`` times too fast. Here the actor holds
the one real bucket per limit (a ``FairAsyncTokenBucket``: exact rate, fair across keys, the
burst bound); workers ask it for **batches** of tokens for the keys their callers queue under,
so a backlog costs one round trip per batch, not one per call:

- a worker's :class:`LeasedBucket` queues callers per key (FIFO) and keeps at most
  ``max_leases`` lease requests per key outstanding, each for the key's unmet demand up to
  ``lease_tokens``; the actor books each request as an ``acquire(key, cost)`` on its bucket,
  so fairness across keys and the rate are the bucket's, fleet-wide;
- tokens of a lease that nobody is left to use (callers cancelled or timed out meanwhile) are
  handed back (``FairAsyncTokenBucket.give_back``): credited as if never granted unless the
  bucket filled up since. The actor keeps its own ledger of grants per worker and key and
  credits at most what that worker leased for that key and has not handed back, at each
  grant's own time: a worker or key that never leased credits nothing (the bucket never grows
  past its rate);
- a dead worker's lease requests still queued at the actor are withdrawn
  (:meth:`LimiterActor.release`, called by the pool when it sees the death): they consumed
  nothing, and the worker's keys stop taking turns. Tokens already delivered to it count as
  spent (they were handed to callers at once): the limit is never exceeded.
- control calls never wait behind leases: leases queue in the buckets, not in Ray's actor
  slots (a large ``max_concurrency``), and ``give_back``/``release``/``stats`` have their own
  concurrency group (:func:`start_limiter` starts the actor with both).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Coroutine, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
import structlog

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

EPS = 1e-9
T = TypeVar("T")


CONTROL = "control"
"""The actor's concurrency group for ``give_back``, ``release`` and ``stats``: they never
wait for a slot behind queued leases."""

LIMITER_OPTIONS: dict[str, Any] = {
    "num_cpus": 0,
    "max_concurrency": 1_000_000,  # leases queue in the buckets (fairly), not in Ray
    "concurrency_groups": {CONTROL: 16},
}
"""Ray actor options :func:`start_limiter` gives a :class:`LimiterActor`."""

MAX_LEDGER_LEASES = 8
"""Grants remembered per worker and key for ``give_back`` (older ones merge, keeping the
oldest grant time, so their tokens are credited only if the bucket never filled since)."""


def start_limiter(**options: Any) -> Any:
    """Start a :class:`LimiterActor` as a Ray actor with its concurrency groups
    (:data:`LIMITER_OPTIONS`; ``options`` are further Ray actor options); returns its handle."""
    actor_class = ray.remote(**LIMITER_OPTIONS)(LimiterActor)
    return actor_class.options(**options).remote() if options else actor_class.remote()


class LimiterActor:
    """The fleet's buckets (run as a Ray actor by :func:`start_limiter`).

    Its state lives on an event loop of its own (a thread): every method hands its work to
    that loop, so Ray may serve them from any thread or concurrency group. A lease waits
    there, queued fairly in its bucket, until its tokens are due; Ray's slots are not what
    queues leases (``max_concurrency`` is large), and the control methods (``give_back``,
    ``release``, ``stats``) have a concurrency group of their own, so they answer at once
    with thousands of leases pending.
    """

    def __init__(self) -> None:
        self._registry = LimiterRegistry()
        self._pending: dict[str, set[asyncio.Task[Any]]] = {}
        self._released: set[str] = set()
        self._ledger: dict[tuple[str, str, Hashable], deque[list[float]]] = {}
        self._buckets: dict[str, FairAsyncTokenBucket] = {}
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.call_soon(started.set)
            self._loop.run_forever()

        threading.Thread(target=serve, name="fleet-limiter", daemon=True).start()
        started.wait()

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def lease(self, worker: str, name: str, rate: float, capacity: float,
                    key: Hashable, cost: float) -> float:
        """Take ``cost`` tokens of limit ``name`` for ``key`` on behalf of ``worker``.

        Returns:
            The bucket's clock when granted.

        Raises:
            LimiterConflict: the limit exists with another rate or capacity.
            LimiterClosed: ``worker`` was released (it died) before or while this waited.
        """
        return await self._on_loop(self._lease(worker, name, rate, capacity, key, cost))

    async def _lease(self, worker: str, name: str, rate: float, capacity: float,
                     key: Hashable, cost: float) -> float:
        if worker in self._released:
            raise LimiterClosed(f"worker {worker} was released from the fleet limiter")
        bucket = self._buckets[name] = self._registry.get(name, rate, capacity)
        task = asyncio.current_task()
        assert task is not None
        pending = self._pending.setdefault(worker, set())
        pending.add(task)
        try:
            await bucket.acquire(key, cost)
        except asyncio.CancelledError:
            if worker in self._released:  # withdrawn: the worker died
                raise LimiterClosed(f"worker {worker} was released while leasing") from None
            raise
        finally:
            pending.discard(task)
        granted_at = time.monotonic()
        grants = self._ledger.setdefault((worker, name, key), deque())
        grants.append([granted_at, float(cost)])
        if len(grants) > MAX_LEDGER_LEASES:  # merge the two oldest: the older time holds
            first = grants.popleft()
            grants[0] = [first[0], first[1] + grants[0][1]]
        return granted_at

    @ray.method(concurrency_group=CONTROL)
    async def give_back(self, worker: str, name: str, key: Hashable, cost: float,
                        granted_at: float | None = None) -> float:
        """Hand back unused tokens of ``worker``'s leases for ``key``.

        Only what this worker leased for this key and has not handed back yet is credited,
        newest grant first (a worker uses its tokens in order, so the unused ones are the
        newest), each part as if never granted unless the bucket filled up since its grant
        (``FairAsyncTokenBucket.give_back``). A worker or key that never leased, a second
        give-back of the same tokens, or a released (dead) worker's tokens credit nothing.

        Args:
            granted_at: the worker's view of the grant time; ignored (the actor's own
                record of each grant decides), kept for callers of the old signature.

        Returns:
            The tokens credited to the bucket.
        """
        return await self._on_loop(self._give_back(worker, name, key, cost))

    async def _give_back(self, worker: str, name: str, key: Hashable, cost: float) -> float:
        grants = self._ledger.get((worker, name, key))
        bucket = self._buckets.get(name)
        if (worker in self._released or bucket is None or not grants
                or not 0 < cost < math.inf):
            _logger.warning("fleet_limiter_give_back_refused", worker=worker, limiter=name,
                            key=repr(key), tokens=cost)
            return 0.0
        credited = 0.0
        while cost > EPS and grants:
            grant = grants[-1]
            part = min(cost, grant[1], bucket.capacity)
            grant[1] -= part
            cost -= part
            if grant[1] <= EPS:
                grants.pop()
            if bucket.give_back(part, granted_at=grant[0], key=key):
                credited += part
        if not grants:
            del self._ledger[(worker, name, key)]
        return credited

    @ray.method(concurrency_group=CONTROL)
    async def release(self, worker: str) -> int:
        """Withdraw a dead worker's queued lease requests (they consumed nothing); the tokens
        it was granted count as spent (no give-back of them is credited).

        Returns:
            How many requests were withdrawn.
        """
        return await self._on_loop(self._release(worker))

    async def _release(self, worker: str) -> int:
        self._released.add(worker)
        for entry in [e for e in self._ledger if e[0] == worker]:
            del self._ledger[entry]
        tasks = list(self._pending.pop(worker, ()))
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        _logger.info("fleet_limiter_released", worker=worker, withdrawn=len(tasks))
        return len(tasks)

    @ray.method(concurrency_group=CONTROL)
    async def stats(self) -> dict[str, BucketStats]:
        """Fleet-wide figures of every limit (the real buckets)."""
        return await self._on_loop(self._stats())

    async def _stats(self) -> dict[str, BucketStats]:
        return self._registry.stats()


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
