"""The limiter under a late or stalled loop: refunds, ideal-time accounting, wake-ups.

Most tests run on the virtual-time loop of ``test_ratelimit``, which can also wake up late
from every wait (``late=``) and be stalled on purpose (``loop.stall``): that is how a loaded
machine looks to the bucket, made exact and repeatable.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ratelimit import VirtualTimeLoop, assert_balanced, drain, settle, virtual_time

from pipeline.ratelimit import FairAsyncTokenBucket, FifoTokenBucket


def assert_flow(bucket: FairAsyncTokenBucket | FifoTokenBucket) -> None:
    """Every token the bucket made was spent, is still there, or was discarded when full."""
    s = bucket.stats()
    assert s.accrued == pytest.approx(s.issued - s.refunded + s.available + s.discarded,
                                      rel=1e-9, abs=1e-6)


def run_on(loop: VirtualTimeLoop, main: Callable[[], asyncio.Future[None] | object]) -> None:
    try:
        loop.run_until_complete(main())  # type: ignore[arg-type]
    finally:
        loop.close()


# -- item 2: a refund after a stall is credited in full ---------------------------------------


@virtual_time
async def test_refund_after_a_stall_keeps_the_refill_that_accrued(loop: VirtualTimeLoop) -> None:
    bucket = FairAsyncTokenBucket(rate=1, capacity=1, clock=loop.clock)
    drain(bucket)
    start = loop.time()
    done: dict[str, float] = {}

    async def one(tag: str) -> None:
        await bucket.acquire("k")
        done[tag] = loop.time() - start

    tasks = {tag: asyncio.create_task(one(tag)) for tag in "ABCDEFGH"}
    await settle()
    loop.stall(1.0)
    assert bucket.stats().in_flight == 1  # "A" is granted (stats dispatches) ...
    loop.stall(5.0)  # ... and the loop stays busy 5 s more before "A" can resume
    tasks["A"].cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    # B..F fell due at 2..6 and come at 6 (the stall's end); A's refunded token is credited
    # as if A had never been served, so G comes at 6 too; H at its ideal time, 7.
    assert done == pytest.approx({**dict.fromkeys("BCDEFG", 6.0), "H": 7.0})
    stats = bucket.stats()
    assert (stats.refunded, stats.keys["k"].refunded, stats.discarded) == (1, 1, 0)
    assert_balanced(bucket)
    assert_flow(bucket)


@virtual_time
async def test_refund_is_discarded_once_the_bucket_filled_up(loop: VirtualTimeLoop) -> None:
    bucket = FairAsyncTokenBucket(rate=1, capacity=1, clock=loop.clock)
    drain(bucket)
    waiter = asyncio.create_task(bucket.acquire("a"))
    await settle()
    loop.stall(1.0)
    bucket.stats()  # grants "a" (in flight)
    loop.stall(3.0)  # nobody else queued: the bucket refills to full during the stall
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    stats = bucket.stats()
    # The bucket would have been full anyway: of 3 s of refill it holds 1 token, and the
    # refund cannot be held either.
    assert stats.available == 1
    assert stats.discarded == pytest.approx(2 + 1)
    assert_balanced(bucket)
    assert_flow(bucket)


# -- item 3: ideal times, late wake-ups, the burst guarantee ----------------------------------


def achieved(kind: type[FairAsyncTokenBucket | FifoTokenBucket], rate: float, capacity: float,
             late_s: float, seconds: float = 40.0) -> tuple[float, list[float]]:
    """Grants per second after the initial burst, 60 looping callers, wake-ups late by
    U(0, late_s); and the grant times."""
    rng = random.Random(5)
    loop = VirtualTimeLoop(late=lambda: rng.uniform(0, late_s))
    times: list[float] = []

    async def main() -> None:
        bucket = kind(rate, capacity, clock=loop.clock)
        start = loop.time()

        async def worker(i: int) -> None:
            while loop.time() - start < seconds:
                await bucket.acquire(f"k{i % 6}")
                times.append(loop.time() - start)

        await asyncio.gather(*(worker(i) for i in range(60)))
        assert_balanced(bucket)
        assert_flow(bucket)

    run_on(loop, main)
    within = [t for t in times if t <= seconds]
    return (len(within) - capacity) / seconds, sorted(times)


@pytest.mark.parametrize("capacity", [1.0, 2.0, 200.0])
def test_rate_is_exact_under_late_wakeups(capacity: float) -> None:
    rate = 200.0
    got, times = achieved(FairAsyncTokenBucket, rate, capacity, late_s=2e-3)
    assert abs(got - rate) / rate <= 0.01
    for n, t in enumerate(times, 1):  # never more than capacity ahead of the ideal schedule
        assert n <= capacity + rate * t + 1e-6


def test_the_late_harness_does_cost_a_plain_bucket_rate() -> None:
    # The FIFO baseline clips at capacity on every late wake-up: the same harness measures
    # it well short of the rate, so the exactness above is not the harness being punctual.
    got, _ = achieved(FifoTokenBucket, 200.0, 1.0, late_s=2e-3, seconds=10.0)
    assert got < 0.95 * 200.0


@virtual_time
async def test_grants_that_fell_due_during_a_stall_come_together_then_the_rate_resumes(
    loop: VirtualTimeLoop,
) -> None:
    rate, capacity = 10.0, 2.0
    bucket = FairAsyncTokenBucket(rate, capacity, clock=loop.clock)
    start = loop.time()
    times: list[float] = []

    async def one() -> None:
        await bucket.acquire("k")
        times.append(loop.time() - start)

    tasks = [asyncio.create_task(one()) for _ in range(40)]
    await settle()
    loop.stall(1.0)
    await asyncio.gather(*tasks)
    assert times[:2] == [0.0, 0.0]  # the burst
    assert times[2:12] == pytest.approx([1.0] * 10)  # due at 0.1 .. 1.0: capacity + rate * L
    assert times[12:] == pytest.approx([1.0 + 0.1 * i for i in range(1, 29)])
    for n, t in enumerate(times, 1):
        assert n <= capacity + rate * t + 1e-9
    assert bucket.stats().discarded == 0
    assert_balanced(bucket)
    assert_flow(bucket)


@virtual_time
async def test_idle_refill_beyond_capacity_is_counted_as_discarded(loop: VirtualTimeLoop) -> None:
    bucket = FairAsyncTokenBucket(rate=10, capacity=5, clock=loop.clock)
    await bucket.acquire("k", cost=5)
    await asyncio.sleep(2.0)  # 20 tokens of refill, the bucket holds 5
    stats = bucket.stats()
    assert (stats.available, stats.accrued) == (5, pytest.approx(25))
    assert stats.discarded == pytest.approx(15)
    assert_flow(bucket)


async def test_a_blocked_head_loop_does_not_hold_up_waiters_on_another_loop() -> None:
    bucket = FairAsyncTokenBucket(rate=10, capacity=1)
    drain(bucket)
    queued, release = threading.Event(), threading.Event()
    start = time.monotonic()

    def thread_main() -> None:
        async def main() -> None:
            task = asyncio.create_task(bucket.acquire("a"))  # the head of the queue
            await asyncio.sleep(0.01)
            queued.set()
            release.wait(5.0)  # this loop is blocked; its timer cannot fire
            await task

        asyncio.run(main())

    thread = threading.Thread(target=thread_main)
    thread.start()
    try:
        assert await asyncio.to_thread(queued.wait, 5.0)
        await bucket.acquire("b")  # this loop's own timer serves "a" at 0.1 and "b" at 0.2
        waited = time.monotonic() - start
    finally:
        release.set()
        await asyncio.to_thread(thread.join, 5.0)
    assert 0.2 - 1e-3 <= waited < 0.6
    assert_balanced(bucket)


# -- item 2 as a property: random arrivals, cancellations, timeouts and stalls ----------------

KEYS = st.sampled_from(["a", "b", "c"])
COSTS = st.sampled_from([0.5, 1.0, 2.0])
QUARTERS = st.integers(0, 16).map(lambda n: n / 4)
ACTIONS = st.one_of(st.none(), st.tuples(st.sampled_from(["cancel", "timeout"]), QUARTERS))
STALLS = st.lists(st.tuples(QUARTERS, st.integers(1, 6).map(lambda n: n / 4)), max_size=4)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rate=st.sampled_from([1.0, 2.0, 4.0]),
    capacity=st.sampled_from([2.0, 3.0]),
    schedule=st.lists(st.tuples(KEYS, COSTS, QUARTERS, ACTIONS), min_size=1, max_size=25),
    stalls=STALLS,
)
@virtual_time
async def test_random_schedules_with_stalls_lose_no_token_and_no_time(
    loop: VirtualTimeLoop,
    rate: float,
    capacity: float,
    schedule: list[tuple[str, float, float, tuple[str, float] | None]],
    stalls: list[tuple[float, float]],
) -> None:
    bucket = FairAsyncTokenBucket(rate, capacity, clock=loop.clock)
    start = loop.time()
    returned: list[tuple[str, float, float, float]] = []  # key, cost, queued, granted
    busy: list[tuple[float, float]] = []  # stalls as they really happened

    def stall(seconds: float) -> None:
        busy.append((loop.time(), loop.time() + seconds))
        loop.stall(seconds)

    for at, seconds in stalls:
        loop.call_later(at, stall, seconds)

    async def client(key: str, cost: float, arrive: float,
                     action: tuple[str, float] | None) -> None:
        await asyncio.sleep(arrive)
        queued = loop.time()
        if action is not None and action[0] == "cancel":
            loop.call_later(action[1], asyncio.current_task().cancel)  # type: ignore[union-attr]
        timeout = action[1] if action is not None and action[0] == "timeout" else None
        try:
            await bucket.acquire(key, cost, timeout=timeout)
        except TimeoutError:
            return
        returned.append((key, cost, queued, loop.time()))

    tasks = [asyncio.create_task(client(*entry)) for entry in schedule]
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        assert task.cancelled() or task.exception() is None

    # The ledger balances, and every token made is spent, there, or discarded when full.
    assert_balanced(bucket)
    assert_flow(bucket)
    assert bucket.stats().returned == pytest.approx(sum(r[1] for r in returned))

    def stalled(a: float, b: float) -> float:
        return sum(max(0.0, min(b, e) - max(a, s)) for s, e in busy)

    grants = sorted((r[3], r[1]) for r in returned)
    spent = 0.0
    for t, cost in grants:  # never more than capacity ahead of the ideal schedule
        spent += cost
        assert spent <= capacity + rate * (t - start) + 1e-9
    # Stalls that follow each other block the loop as one: the longest *contiguous* one bounds
    # how much fell due at once (two 1 s stalls back to back release 2 s of grants together).
    merged: list[list[float]] = []
    for s, e in sorted(busy):
        if merged and s <= merged[-1][1] + 1e-9:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    longest = max((e - s for s, e in merged), default=0.0)
    for i, (a, _) in enumerate(grants):  # a window gets at most what fell due in it
        for b, _ in grants[i:]:
            got = sum(cost for t, cost in grants if a <= t <= b)
            assert got <= 2 * capacity + rate * (b - a + longest) + 1e-9
    for _, _, queued, granted in returned:  # no grant later than its ideal time + the stall
        got = sum(cost for t, cost in grants if queued <= t <= granted)
        assert got >= rate * (granted - queued - stalled(queued, granted)) - capacity - 1e-9
    for key in "abc":  # FIFO within a key: who queued first is not served later ...
        served = [granted for _, granted in sorted((r[2], r[3]) for r in returned if r[0] == key)]
        for i, first in enumerate(served):
            for then in served[i + 1:]:
                # ... except when a stall kept it from resuming while a later caller took
                # tokens on its own fast path (both were granted in order)
                assert first <= then + stalled(then, first) + 1e-9
