"""``FairAsyncTokenBucket.give_back``: tokens taken ahead of use (a fleet limiter's lease)
and handed back unused, on the virtual-time loop of ``test_ratelimit``."""

from __future__ import annotations

import asyncio

import pytest
from test_ratelimit import VirtualTimeLoop, assert_balanced, drain, settle, virtual_time
from test_ratelimit_exact import assert_flow

from pipeline.ratelimit import FairAsyncTokenBucket


@virtual_time
async def test_handed_back_tokens_serve_a_queued_caller_at_once(loop: VirtualTimeLoop) -> None:
    bucket = FairAsyncTokenBucket(rate=1, capacity=4, clock=loop.clock)
    start = loop.time()
    await bucket.acquire("lease", 4)  # a lease of the whole burst
    granted_at = loop.clock()
    waiter = asyncio.create_task(bucket.acquire("other", 3))
    await settle()
    assert not waiter.done()  # empty bucket: 3 tokens would take 3 s
    assert bucket.give_back(3, granted_at=granted_at, key="lease") is True
    await settle()
    assert waiter.done() and loop.time() == start  # served from the handed-back tokens
    stats = bucket.stats()
    assert stats.refunded == 3 and stats.keys["lease"].tokens == 1
    assert_balanced(bucket)
    assert_flow(bucket)


@virtual_time
async def test_tokens_handed_back_after_the_bucket_filled_are_discarded(
        loop: VirtualTimeLoop) -> None:
    bucket = FairAsyncTokenBucket(rate=1, capacity=2, clock=loop.clock)
    await bucket.acquire("lease", 2)
    granted_at = loop.clock()
    await asyncio.sleep(5)  # refilled to capacity meanwhile: the lease's tokens would overflow
    assert bucket.give_back(2, granted_at=granted_at, key="lease") is False
    stats = bucket.stats()
    assert stats.available == pytest.approx(2)  # never above capacity: the burst holds
    assert stats.discarded >= 2
    assert_balanced(bucket)
    assert_flow(bucket)


@virtual_time
async def test_give_back_refuses_a_bad_cost(loop: VirtualTimeLoop) -> None:
    bucket = FairAsyncTokenBucket(rate=1, capacity=2, clock=loop.clock)
    drain(bucket)
    for bad in (0, -1, 3, float("nan")):
        with pytest.raises(ValueError):
            bucket.give_back(bad, granted_at=loop.clock())
