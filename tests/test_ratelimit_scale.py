"""The limiter with very many keys: bounded tallies, exact totals, stats off the lock."""

from __future__ import annotations

import asyncio
import threading
import tracemalloc

import pytest
from test_ratelimit import assert_balanced

import pipeline.ratelimit._stats as stats_module
from pipeline.ratelimit import FairAsyncTokenBucket, FifoTokenBucket
from pipeline.ratelimit._stats import FOLDED, KEY_WAIT_SAMPLES


def take(bucket: FairAsyncTokenBucket, key: object, cost: float = 1.0) -> None:
    """One uncontended acquire, run to completion without a loop (the fast path)."""
    coro = bucket.acquire(key, cost)
    with pytest.raises(StopIteration):
        coro.send(None)


def test_idle_keys_are_folded_and_totals_stay_exact() -> None:
    bucket = FairAsyncTokenBucket(rate=1e9, capacity=1e9, max_keys=100)
    for i in range(1000):
        take(bucket, f"group-{i}")
    for _ in range(5):
        take(bucket, "group-999", cost=2)
    stats = bucket.stats()
    assert len(stats.keys) <= 100
    assert stats.folded is not None and stats.folded.key is FOLDED
    assert stats.folded_keys == 1000 - len(stats.keys)
    assert stats.folded.grants + sum(k.grants for k in stats.keys.values()) == 1005
    assert stats.grants == 1005 and stats.tokens == 1010
    assert stats.keys["group-999"].grants == 6  # the most recent keys keep their own figures
    assert "group-0" not in stats.keys
    assert stats.folded.wait_p50_s == 0.0
    assert_balanced(bucket)


async def test_a_key_with_callers_queued_is_never_folded() -> None:
    bucket = FairAsyncTokenBucket(rate=1, capacity=1, max_keys=8)
    take(bucket, "queued")  # the least recently active key, with one caller waiting now
    waiter = asyncio.create_task(bucket.acquire("queued"))
    await asyncio.sleep(0)
    for i in range(100):  # new keys force folds
        bucket._tally.record_grant(f"k{i}", 0.0, 0.0)
    stats = bucket.stats()
    assert stats.folded_keys >= 90
    assert stats.keys["queued"].queue_len == 1 and stats.keys["queued"].grants == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


def test_many_keys_keep_the_tallies_flat() -> None:
    # CallTools' default key is the group id: one key per prompt over a whole run.
    bucket = FairAsyncTokenBucket(rate=1e12, capacity=1e12)
    for i in range(5_000):  # warm-up: the tally reaches its steady size
        take(bucket, ("warm", i))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(50_000):
            take(bucket, i)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 500_000  # flat: 50,000 more keys cost (nearly) nothing
    stats = bucket.stats()
    assert stats.grants == 55_000 and len(stats.keys) <= 1024
    assert_balanced(bucket)


def test_per_key_wait_samples_are_bounded() -> None:
    bucket = FairAsyncTokenBucket(rate=1e9, capacity=1e9)
    for _ in range(10 * KEY_WAIT_SAMPLES):
        take(bucket, "k")
    assert len(bucket._tally._keys["k"].waits) < 2 * KEY_WAIT_SAMPLES
    assert bucket.stats().keys["k"].grants == 10 * KEY_WAIT_SAMPLES


def test_percentiles_match_numpy() -> None:
    bucket = FairAsyncTokenBucket(rate=1e9, capacity=1e9)
    for key, waits in (("a", [0.0, 1.0, 3.0]), ("b", [5.0]), ("c", [2.0, 0.5, 9.0, 4.0])):
        for wait in waits:
            bucket._tally.record_grant(key, 1.0, wait)
    stats = bucket.stats()
    assert (stats.keys["a"].wait_p50_s, stats.keys["a"].wait_p99_s) == (1.0, pytest.approx(2.96))
    assert (stats.keys["b"].wait_p50_s, stats.keys["b"].wait_p99_s) == (5.0, 5.0)
    assert stats.keys["c"].wait_p50_s == pytest.approx(3.0)
    assert stats.keys["c"].wait_p99_s == pytest.approx(8.85)


def test_stats_are_computed_without_holding_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = FairAsyncTokenBucket(rate=1e9, capacity=1e9)
    for i in range(2000):
        take(bucket, i)
    served: list[bool] = []
    percentiles = stats_module._row_percentiles

    def while_computing(samples: list) -> tuple:  # type: ignore[type-arg]
        # Another thread acquires while the snapshot is being computed: it must not block.
        other = threading.Thread(target=lambda: served.append(
            asyncio.run(bucket.acquire("other")) is None))
        other.start()
        other.join(10.0)
        return percentiles(samples)

    monkeypatch.setattr(stats_module, "_row_percentiles", while_computing)
    stats = bucket.stats()
    assert served == [True, True]  # per-key and bucket-wide percentiles, both off the lock
    assert stats.grants == 2000  # a snapshot of the moment it was taken
    assert bucket.stats().grants == 2002


async def test_fifo_baseline_folds_keys_too() -> None:
    bucket = FifoTokenBucket(rate=1e9, capacity=1e9)
    for i in range(3000):
        await bucket.acquire(i)
    stats = bucket.stats()
    assert len(stats.keys) <= 1024 and stats.grants == 3000
    assert_balanced(bucket)
