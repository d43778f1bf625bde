"""One rate limit for the fleet: the limiter actor that holds the real buckets.

Without it each worker's :class:`~pipeline.ratelimit.FairAsyncTokenBucket` holds its tool's
``rate`` on its own, so ``N`` workers call a tool ``N`` times too fast. Here the actor holds
the one real bucket per limit (a ``FairAsyncTokenBucket``: exact rate, fair across keys, the
burst bound); workers ask it for **batches** of tokens for the keys their callers queue under
(their side is ``_leases.py``), so a backlog costs one round trip per batch, not one per call:

- the actor books each lease request as an ``acquire(key, cost)`` on its bucket, so fairness
  across keys and the rate are the bucket's, fleet-wide;
- tokens of a lease that nobody is left to use are handed back
  (``FairAsyncTokenBucket.give_back``): credited as if never granted unless the bucket filled
  up since. The actor keeps its own ledger of grants per worker and key and credits at most
  what that worker leased for that key and has not handed back, at each grant's own time: a
  worker or key that never leased credits nothing (the bucket never grows past its rate);
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
import math
import threading
import time
from collections import deque
from collections.abc import Coroutine, Hashable
from typing import Any, TypeVar

import ray
import structlog

from pipeline.ratelimit import BucketStats, FairAsyncTokenBucket, LimiterClosed, LimiterRegistry

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

    @ray.method(concurrency_group=CONTROL)  # type: ignore[untyped-decorator]
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

    @ray.method(concurrency_group=CONTROL)  # type: ignore[untyped-decorator]
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

    @ray.method(concurrency_group=CONTROL)  # type: ignore[untyped-decorator]
    async def stats(self) -> dict[str, BucketStats]:
        """Fleet-wide figures of every limit (the real buckets)."""
        return await self._on_loop(self._stats())

    async def _stats(self) -> dict[str, BucketStats]:
        return self._registry.stats()
