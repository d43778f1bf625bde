"""The fleet limiter on a real local Ray cluster: a LimiterActor and four workers' leased
registries (in this process, each its own worker id), keys spread unevenly over them.

Rate: the exact upper bound (never more than ``capacity + rate * elapsed`` counted from before
the bucket existed) and a loose lower bound; fairness: Jain's index over the keys' grants;
a dead worker's queued leases withdrawn; tokens nobody used handed back, and only those
(issue 33, item 8: never a worker's or key's that did not lease them); control calls answer
within a second with 2,000 leases pending.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from _waits import until

ray = pytest.importorskip("ray")

from pipeline.distributed import FleetLimiterRegistry, start_limiter  # noqa: E402
from pipeline.ratelimit import LimiterClosed  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (tests/conftest.py)

SPREAD = {"w0": ["k0", "k1", "k2", "k3", "k4"], "w1": ["k5"], "w2": ["k6"], "w3": ["k7"]}


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> None:
    """The session's Ray cluster (tests/conftest.py)."""


@pytest_asyncio.fixture(loop_scope="module")
async def actor(cluster: None) -> AsyncIterator[Any]:
    handle = start_limiter()
    await handle.stats.remote()  # started
    yield handle
    ray.kill(handle)


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
    await until(lambda: len(grants) >= 400, 60)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for registry in registries.values():
        await registry.aclose()
    times = sorted(t - start for t, _ in grants)
    for n, t in enumerate(times, 1):  # exact: the fleet never gets ahead of one bucket
        assert n <= capacity + rate * t + 1e-6, (n, t)
    # loose: a loaded machine is late (0.67 of the rate seen with the suite's other xdist
    # worker and other work on 2 cores); the exact upper bound above is the limiter's contract
    assert len(times) >= 0.5 * rate * (times[-1] - times[0])
    window = [k for t, k in grants if t - start >= times[-1] * 0.25]  # after the burst
    counts = Counter(window)
    assert set(counts) == {k for keys in SPREAD.values() for k in keys}
    assert jain([float(c) for c in counts.values()]) >= 0.9, counts  # w0's five keys too
    leases = sum(r.get("api", rate, capacity).leases for r in registries.values())
    assert leases < len(grants)  # batches, not a round trip per call
    stats = (await actor.stats.remote())["api"]
    assert stats.leaked == 0


async def test_a_dead_workers_queued_leases_are_withdrawn(actor: Any) -> None:
    # Refilling a token takes 100 s: once the dead worker's lease request is queued at the
    # actor it stays there, so the release finds it however loaded the machine is (with a
    # fast rate the request could be granted, or still on its way, when the release came).
    rate, capacity = 0.01, 1.0
    dead = FleetLimiterRegistry(actor, "dead-frozen")
    bucket = dead.get("frozen", rate, capacity)
    await bucket.acquire("d")  # the one token there is
    waiters = [asyncio.create_task(bucket.acquire("d")) for _ in range(3)]

    async def queued() -> int:
        stats = (await actor.stats.remote()).get("frozen")
        return stats.keys["d"].queue_len if stats and "d" in stats.keys else 0

    deadline = time.monotonic() + 60
    while await queued() < 1:
        assert time.monotonic() < deadline, "the lease request never reached the actor"
        await asyncio.sleep(0.01)
    assert await actor.release.remote("dead-frozen") >= 1
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, LimiterClosed) for r in results), results
    assert await queued() == 0


async def test_a_dead_workers_callers_end_and_the_live_worker_goes_on_alone(actor: Any) -> None:
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
    await until(lambda: got["d"] >= 10 and got["a"] >= 10, 60)
    # Whether a request of it is queued at this moment or still on its way, every caller of
    # the released worker ends with LimiterClosed (a late request is refused on arrival).
    await actor.release.remote("dead")
    results = await asyncio.gather(*dead_tasks, return_exceptions=True)
    assert all(isinstance(r, LimiterClosed) for r in results), results
    before = got["a"]
    await until(lambda: got["a"] >= before + 40, 60)  # the live worker goes on alone
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
    # all 5 are there for another worker at once (refilling them would take 50 s). Waiting
    # for the hand-back first: Ray does not promise to run an async actor's calls in the
    # order they were sent, so the second worker's lease could otherwise come first.
    await until(lambda: first.stats()["slow"].keys["x"].refunded >= 1, 60)
    await second.get("slow", rate, capacity).acquire("y", cost=5, timeout=20)
    handed_back = first.stats()["slow"].keys["x"].refunded
    stats = (await actor.stats.remote())["slow"]
    assert handed_back >= 1 and stats.refunded == handed_back
    assert stats.keys["y"].tokens == 5 and stats.leaked == 0
    await first.aclose()
    await second.aclose()


async def test_item8_give_back_credits_only_what_was_leased(actor: Any) -> None:
    rate, capacity = 0.01, 4.0  # refilling one token takes 100 s: what is there was credited

    async def available() -> float:
        return float((await actor.stats.remote())["cap"].available)

    await actor.lease.remote("a", "cap", rate, capacity, "k", 4.0)  # drained
    now = time.monotonic()
    assert await available() < 0.1
    bogus = [("stranger", "cap", "k", 4.0),  # a worker that never leased
             ("a", "cap", "other", 4.0),  # a key this worker never leased
             ("a", "nowhere", "k", 4.0)]  # a limit that does not exist
    for worker, name, key, cost in bogus:
        assert await actor.give_back.remote(worker, name, key, cost, now) == 0
        assert await available() < 0.1, (worker, name, key)
    assert await actor.give_back.remote("a", "cap", "k", 3.0, now) == pytest.approx(3.0)
    assert await available() == pytest.approx(3.0, abs=0.1)
    # Only one token of the lease is left unreturned: a second claim of 3 credits 1.
    assert await actor.give_back.remote("a", "cap", "k", 3.0, now) == pytest.approx(1.0)
    assert await actor.give_back.remote("a", "cap", "k", 1.0, now) == 0
    # A released (dead) worker's tokens count as spent: nothing comes back from it.
    await actor.lease.remote("b", "cap", rate, capacity, "k", 2.0)
    left = await available()
    assert await actor.release.remote("b") == 0
    assert await actor.give_back.remote("b", "cap", "k", 2.0, now) == 0
    assert await available() == pytest.approx(left, abs=0.1)
    stats = (await actor.stats.remote())["cap"]
    assert stats.leaked == 0 and stats.available <= capacity + 1e-6


async def test_item8_control_calls_answer_within_1s_with_2000_leases_pending(actor: Any) -> None:
    rate, capacity, count = 0.001, 1.0, 2000
    await actor.lease.remote("first", "busy", rate, capacity, "k-first", 1.0)  # drained
    refs = [actor.lease.remote("crowd", "busy", rate, capacity, f"k{i}", 1.0)
            for i in range(count)]

    async def timed(ref: Any) -> tuple[float, Any]:
        start = time.monotonic()
        value = await asyncio.wait_for(ref, 30)
        return time.monotonic() - start, value

    deadline = time.monotonic() + 60
    while True:  # every lease queued at the actor's bucket (not in Ray's queue)
        _, stats = await timed(actor.stats.remote())
        if stats["busy"].queue_len == count:
            break
        assert time.monotonic() < deadline, stats["busy"].queue_len
        await asyncio.sleep(0.1)
    latencies = [(await timed(actor.stats.remote()))[0] for _ in range(5)]
    took_give_back, credited = await timed(
        actor.give_back.remote("first", "busy", "k-first", 1.0, time.monotonic()))
    took_release, withdrawn = await timed(actor.release.remote("crowd"))
    print(f"with {count} leases pending: stats {max(latencies) * 1000:.1f} ms (max of 5), "
          f"give_back {took_give_back * 1000:.1f} ms, release {took_release * 1000:.1f} ms")
    assert max(latencies) < 1.0, latencies
    assert took_give_back < 1.0 and took_release < 1.0
    assert withdrawn == count - int(credited)  # the credited token served one of them
    results = await asyncio.gather(*refs, return_exceptions=True)
    closed = [r for r in results if isinstance(r, Exception)]
    assert len(closed) == withdrawn
    assert all(isinstance(getattr(r, "cause", r), LimiterClosed) for r in closed), closed[:1]
    assert (await actor.stats.remote())["busy"].queue_len == 0
