"""The fleet limiter on a real local Ray cluster: a LimiterActor and four workers' leased
registries (in this process, each its own worker id), keys spread unevenly over them.

Rate: the exact upper bound (never more than ``capacity + rate * elapsed`` counted from before
the bucket existed) and a loose lower bound; fairness: Jain's index over the keys' grants;
a dead worker's queued leases withdrawn; tokens nobody used handed back.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

ray = pytest.importorskip("ray")

from pipeline.distributed import FleetLimiterRegistry, LimiterActor  # noqa: E402
from pipeline.ratelimit import LimiterClosed  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPREAD = {"w0": ["k0", "k1", "k2", "k3", "k4"], "w1": ["k5"], "w2": ["k6"], "w3": ["k7"]}


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest_asyncio.fixture(loop_scope="module")
async def actor(cluster: None) -> AsyncIterator[Any]:
    handle = ray.remote(LimiterActor).options(num_cpus=0).remote()
    await handle.stats.remote()  # started
    yield handle
    ray.kill(handle)


async def until(condition: Any, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


async def test_fleet_rate_and_fairness_with_keys_spread_unevenly(actor: Any) -> None:
    rate, capacity = 100.0, 5.0
    registries = {w: FleetLimiterRegistry(actor, w) for w in SPREAD}
    grants: list[tuple[float, str]] = []
    stop = asyncio.Event()

    async def caller(worker: str, key: str) -> None:
        bucket = registries[worker].get("api", rate, capacity)
        while not stop.is_set():
            await bucket.acquire(key)
            grants.append((time.monotonic(), key))

    start = time.monotonic()
    tasks = [asyncio.create_task(caller(w, k)) for w, keys in SPREAD.items() for k in keys
             for _ in range(4)]  # 4 callers per key: every key stays backlogged
    await until(lambda: len(grants) >= 400)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for registry in registries.values():
        await registry.aclose()
    times = sorted(t - start for t, _ in grants)
    for n, t in enumerate(times, 1):  # exact: the fleet never gets ahead of one bucket
        assert n <= capacity + rate * t + 1e-6, (n, t)
    assert len(times) >= 0.7 * rate * (times[-1] - times[0])  # loose: a loaded machine is late
    window = [k for t, k in grants if t - start >= times[-1] * 0.25]  # after the burst
    counts = Counter(window)
    assert set(counts) == {k for keys in SPREAD.values() for k in keys}
    assert jain([float(c) for c in counts.values()]) >= 0.9, counts  # w0's five keys too
    leases = sum(r.get("api", rate, capacity).leases for r in registries.values())
    assert leases < len(grants)  # batches, not a round trip per call
    stats = (await actor.stats.remote())["api"]
    assert stats.leaked == 0


async def test_a_dead_workers_queued_leases_are_withdrawn(actor: Any) -> None:
    rate, capacity = 50.0, 1.0
    alive, dead = FleetLimiterRegistry(actor, "alive"), FleetLimiterRegistry(actor, "dead")
    got: Counter[str] = Counter()
    stop = asyncio.Event()

    async def caller(registry: FleetLimiterRegistry, key: str) -> None:
        bucket = registry.get("tool", rate, capacity)
        while not stop.is_set():
            await bucket.acquire(key)
            got[key] += 1

    dead_tasks = [asyncio.create_task(caller(dead, "d")) for _ in range(8)]
    alive_tasks = [asyncio.create_task(caller(alive, "a")) for _ in range(8)]
    await until(lambda: got["d"] >= 10 and got["a"] >= 10)
    withdrawn = await actor.release.remote("dead")
    assert withdrawn >= 1  # its lease requests were queued at the actor
    results = await asyncio.gather(*dead_tasks, return_exceptions=True)
    assert all(isinstance(r, LimiterClosed) for r in results), results
    before = got["a"]
    await until(lambda: got["a"] >= before + 40)  # the live worker goes on alone
    stop.set()
    for task in alive_tasks:
        task.cancel()
    await asyncio.gather(*alive_tasks, return_exceptions=True)
    await alive.aclose()
    stats = (await actor.stats.remote())["tool"]
    assert stats.keys["d"].queue_len == 0 and stats.leaked == 0


async def test_tokens_of_a_lease_nobody_used_are_handed_back(actor: Any) -> None:
    rate, capacity = 0.1, 5.0  # refilling 5 tokens would take 50 s
    first = FleetLimiterRegistry(actor, "first", lease_s=100.0)
    second = FleetLimiterRegistry(actor, "second")
    bucket = first.get("slow", rate, capacity)
    waiters = [asyncio.create_task(bucket.acquire("x")) for _ in range(5)]
    for _ in range(3):
        await asyncio.sleep(0)
    assert bucket.leases >= 1  # requested as the callers queued
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    # The leases land with nobody left to use them: their tokens go back to the actor, so
    # all 5 are there for another worker at once (refilling them would take 50 s).
    await second.get("slow", rate, capacity).acquire("y", cost=5, timeout=20)
    handed_back = first.stats()["slow"].keys["x"].refunded
    stats = (await actor.stats.remote())["slow"]
    assert handed_back >= 1 and stats.refunded == handed_back
    assert stats.keys["y"].tokens == 5 and stats.leaked == 0
    await first.aclose()
    await second.aclose()
