"""Fair token bucket against the FIFO baseline: rate, fairness, accounting, cost.

Run::

    python benchmarks/ratelimit.py           # about 3 min; writes benchmarks/results/ratelimit.json
    python benchmarks/ratelimit.py --quick   # shorter runs, prints only

Each figure is measured for ``FairAsyncTokenBucket`` and ``FifoTokenBucket`` (one queue behind
an ``asyncio.Lock``, sleeping until the head's tokens are there: what hand-rolled limiters do
today), one after the other on the real clock with the default asyncio loop.

1. Rate: rate=200/s, capacity=200, 1,000 tasks that acquire in a loop (10 keys) for 10 s
   from the first grant. Achieved rate = (grants in the window - the 200-token burst) / 10 s.
2. Fairness: 100 keys with open-loop periodic demand from 2/s to 200/s (geometric, 100x),
   bucket rate=1,000/s, capacity=50; a key keeps at most 200 requests waiting (a bounded
   client queue drops the rest). Each key's grants in [2 s, 8 s] are divided by its max-min
   fair share of the rate (water-filling on the demands), and Jain's index is taken over
   those ratios. Also: when every key has had its first grant, and the longest wait of a
   key's first request.
3. Accounting: 3,000 requests over 2 s on 20 keys into rate=1,000/s, capacity=20, 30% of them
   set to be cancelled at a random moment in their first second (those already served by then
   are not cancelled). Afterwards issued must equal
   returned + refunded, with nothing leaked or in flight, and no window may have received
   more than capacity + rate * length.
4. Uncontended cost: ``await bucket.acquire("k")`` on a bucket that always has tokens; CPU
   time per call, best of 7 runs, next to an ``await`` of an empty coroutine for scale.
5. Rate at small bursts, quiet and loaded: rate=200/s, capacity 1, 2 and 200, 200 tasks that
   acquire in a loop (10 keys) for 8 s from the first grant, as in 1. "Loaded" runs one
   CPU-burning subprocess per core beside it, so timers fire late.
6. Many keys: 10^4, 10^5 and 10^6 distinct keys (one acquire each, as ``CallTools``' default
   group-id key gives over a run); the tallies' memory (deep size of their containers),
   ``stats()`` time (median of 5) and the part of it spent holding the bucket's lock.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
from _common import write_result

from pipeline.ratelimit import FairAsyncTokenBucket, FifoTokenBucket, LimiterClosed

Bucket = FairAsyncTokenBucket | FifoTokenBucket
KINDS: dict[str, type[Bucket]] = {"fair": FairAsyncTokenBucket, "fifo": FifoTokenBucket}


async def rate_accuracy(kind: type[Bucket], seconds: float, capacity: float = 200.0,
                        waiters: int = 1000) -> dict[str, Any]:
    rate = 200.0
    bucket = kind(rate, capacity)
    start = 0.0
    granted = 0
    closer: list[asyncio.Task[None]] = []

    async def close_at_deadline() -> None:
        await asyncio.sleep(seconds - (time.monotonic() - start))
        await bucket.aclose()

    async def waiter(i: int) -> None:
        nonlocal granted, start
        while True:
            try:
                await bucket.acquire(f"k{i % 10}")
            except LimiterClosed:
                return
            now = time.monotonic()
            if not closer:  # the window opens at the first grant, with the bucket full
                start = now
                closer.append(asyncio.create_task(close_at_deadline()))
            if now - start <= seconds:
                granted += 1

    await asyncio.gather(*(waiter(i) for i in range(waiters)))
    await closer[0]
    achieved = (granted - capacity) / seconds
    stats = bucket.stats()
    return {
        "rate": rate, "capacity": capacity, "waiters": waiters, "seconds": seconds,
        "grants": granted, "achieved_rate": round(achieved, 2),
        "error_pct": round(100 * (achieved - rate) / rate, 3),
        "wait_p50_s": _round(stats.wait_p50_s), "wait_p99_s": _round(stats.wait_p99_s),
    }


def max_min_shares(demand: np.ndarray, rate: float) -> np.ndarray:
    """Water-filling: every key gets min(demand, level), the level set to use the whole rate."""
    low, high = 0.0, float(demand.max())
    for _ in range(100):
        level = (low + high) / 2
        low, high = (level, high) if np.minimum(demand, level).sum() < rate else (low, level)
    shares: np.ndarray = np.minimum(demand, (low + high) / 2)
    return shares


async def fairness(kind: type[Bucket], duration: float, warmup: float) -> dict[str, Any]:
    rate, capacity, n_keys, max_waiting = 1000.0, 50.0, 100, 200
    demand = 2.0 * 100.0 ** (np.arange(n_keys) / (n_keys - 1))
    shares = max_min_shares(demand, rate)
    bucket = kind(rate, capacity)
    rng = random.Random(7)
    next_arrival = [rng.uniform(0, 1 / d) for d in demand]
    waiting = [0] * n_keys
    in_window = [0] * n_keys
    first_request: list[float | None] = [None] * n_keys
    first_wait: list[float | None] = [None] * n_keys
    first_grant: list[float | None] = [None] * n_keys
    tasks: set[asyncio.Task[None]] = set()
    start = time.monotonic()

    async def request(key: int, asked: float) -> None:
        try:
            await bucket.acquire(key)
        except LimiterClosed:
            return
        finally:
            waiting[key] -= 1
        now = time.monotonic() - start
        if first_grant[key] is None:
            first_grant[key], first_wait[key] = now, now - asked
        if warmup <= now <= duration:
            in_window[key] += 1

    while (now := time.monotonic() - start) < duration:
        for key in range(n_keys):
            while next_arrival[key] <= now:
                next_arrival[key] += 1 / demand[key]
                if waiting[key] < max_waiting:
                    waiting[key] += 1
                    if first_request[key] is None:
                        first_request[key] = now
                    task = asyncio.create_task(request(key, now))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        await asyncio.sleep(0.005)
    await bucket.aclose()
    await asyncio.gather(*tasks)

    ratios = np.array(in_window) / (shares * (duration - warmup))
    jain = float(ratios.sum() ** 2 / (n_keys * (ratios**2).sum()))
    never = sum(g is None for g in first_grant)
    return {
        "rate": rate, "capacity": capacity, "keys": n_keys, "max_waiting_per_key": max_waiting,
        "demand_per_s": [round(float(demand.min()), 2), round(float(demand.max()), 2)],
        "offered_per_s": round(float(demand.sum()), 1), "fair_level_per_s": round(float(
            shares.max()), 2), "window_s": [warmup, duration],
        "jain_index": round(jain, 4),
        "share_ratio_min": round(float(ratios.min()), 3),
        "share_ratio_max": round(float(ratios.max()), 3),
        "keys_never_granted": never,
        "all_keys_first_granted_s": None if never else _round(max(
            g for g in first_grant if g is not None)),
        "first_grant_wait_max_s": _round(max(w for w in first_wait if w is not None)),
    }


async def accounting(kind: type[Bucket]) -> dict[str, Any]:
    rate, capacity, n_requests, n_keys, spread_s = 1000.0, 20.0, 3000, 20, 2.0
    bucket = kind(rate, capacity)
    rng = random.Random(11)
    loop = asyncio.get_running_loop()
    start = time.monotonic()
    grants: list[tuple[float, float]] = []

    async def request(key: int, arrive: float, cost: float) -> None:
        await asyncio.sleep(arrive)
        await bucket.acquire(key, cost)
        grants.append((time.monotonic() - start, cost))

    tasks = []
    scheduled = 0
    for i in range(n_requests):
        arrive = rng.uniform(0, spread_s)
        task = asyncio.create_task(request(i % n_keys, arrive, rng.choice([1.0, 1.0, 2.0])))
        if rng.random() < 0.3:
            scheduled += 1
            loop.call_later(arrive + rng.uniform(0, 1.0), task.cancel)
        tasks.append(task)
    await asyncio.gather(*tasks, return_exceptions=True)
    stats = bucket.stats()
    cancelled = sum(task.cancelled() for task in tasks)
    grants.sort()
    spent, worst = 0.0, -float("inf")
    for t, cost in grants:  # tokens received by t against what the bucket could give by t
        spent += cost
        worst = max(worst, spent - (capacity + rate * t))
    return {
        "requests": n_requests, "cancel_scheduled": scheduled, "cancelled": cancelled,
        "cancelled_pct": round(100 * cancelled / n_requests, 1),
        "issued": stats.issued, "returned": stats.returned, "refunded": stats.refunded,
        "in_flight": stats.in_flight, "leaked": stats.leaked,
        "balanced": stats.issued == stats.returned + stats.refunded and stats.leaked == 0,
        "never_over_rate": worst <= 1e-6,
    }


async def uncontended(kind: type[Bucket], calls: int) -> dict[str, Any]:
    bucket = kind(1e12, 1e12)

    async def noop() -> None:
        return None

    async def per_call(step: Callable[[], Any]) -> float:
        runs = []
        for _ in range(7):  # CPU time and the best run: the machine may be shared
            t0 = time.process_time()
            for _ in range(calls):
                await step()
            runs.append((time.process_time() - t0) / calls * 1e6)
        return round(min(runs), 3)

    return {
        "calls": calls,
        "acquire_us": await per_call(lambda: bucket.acquire("k")),
        "empty_coroutine_us": await per_call(noop),
    }


@contextlib.contextmanager
def cpu_burners(n: int) -> Any:
    """``n`` subprocesses spinning on a core each, stopped on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


async def rate_vs_capacity(seconds: float, burners: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for load, n in (("quiet", 0), ("loaded", burners)):
        with cpu_burners(n):
            out[load] = {"cpu_burners": n, "loadavg": [round(x, 2) for x in os.getloadavg()]}
            for name, kind in KINDS.items():
                out[load][name] = {
                    str(int(capacity)): await rate_accuracy(kind, seconds, capacity, waiters=200)
                    for capacity in (1.0, 2.0, 200.0)}
            out[load]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def tally_bytes(bucket: FairAsyncTokenBucket) -> int:
    """Deep size of the bucket's per-key statistics: dict, entries, wait-sample arrays."""
    tally = bucket._tally
    keys = tally._keys
    size = sys.getsizeof(keys)
    for key, entry in keys.items():
        size += sys.getsizeof(key) + sys.getsizeof(entry) + sys.getsizeof(entry.waits)
    folded = tally._folded
    return size + sys.getsizeof(folded) + sys.getsizeof(folded.waits) + sys.getsizeof(
        tally._waits)


def many_keys(n: int) -> dict[str, Any]:
    bucket = FairAsyncTokenBucket(rate=1e12, capacity=1e12)
    started = time.perf_counter()
    for i in range(n):  # each acquire completes on its first step: no loop needed
        coro = bucket.acquire(("group", i))
        with contextlib.suppress(StopIteration):
            coro.send(None)
    fill_s = time.perf_counter() - started
    runs, locked = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        stats = bucket.stats()
        runs.append(time.perf_counter() - t0)
        with bucket._lock:
            t0 = time.perf_counter()
            bucket._tally.capture(bucket._queue.queue_lens(), bucket._queue.weight)
            locked.append(time.perf_counter() - t0)
    assert stats.grants == n and stats.leaked == 0
    return {
        "keys": n, "keys_kept": len(stats.keys), "keys_folded": stats.folded_keys,
        "tally_bytes": tally_bytes(bucket),
        "stats_ms": round(1e3 * float(np.median(runs)), 2),
        "stats_lock_held_ms": round(1e3 * float(np.median(locked)), 3),
        "acquire_us_while_filling": round(1e6 * fill_s / n, 3),
    }


async def run(quick: bool, burners: int) -> dict[str, Any]:
    figures: dict[str, Any] = {"loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
                               "loop": "asyncio (default)"}
    for name, kind in KINDS.items():
        figures.setdefault("rate", {})[name] = await rate_accuracy(kind, 2.0 if quick else 10.0)
        figures.setdefault("fairness", {})[name] = await fairness(
            kind, duration=4.0 if quick else 8.0, warmup=1.0 if quick else 2.0)
        figures.setdefault("accounting", {})[name] = await accounting(kind)
        figures.setdefault("uncontended", {})[name] = await uncontended(
            kind, 5_000 if quick else 20_000)
    figures["rate_vs_capacity"] = await rate_vs_capacity(3.0 if quick else 8.0, burners)
    figures["many_keys"] = [many_keys(n) for n in (10**4, 10**5, 10**6)]
    return figures


def print_table(figures: dict[str, Any]) -> None:
    rows = [
        ("achieved rate, 1000 waiters (/s)", "rate", "achieved_rate", "200 +- 1%"),
        ("rate error (%)", "rate", "error_pct", "|x| <= 1"),
        ("Jain index on grants / fair share", "fairness", "jain_index", ">= 0.99"),
        ("min / fair share", "fairness", "share_ratio_min", ""),
        ("max / fair share", "fairness", "share_ratio_max", ""),
        ("all 100 keys first granted (s)", "fairness", "all_keys_first_granted_s", ""),
        ("longest wait for a first grant (s)", "fairness", "first_grant_wait_max_s", ""),
        ("cancels scheduled (30%)", "accounting", "cancel_scheduled", ""),
        ("  of which hit a waiting caller", "accounting", "cancelled", ""),
        ("tokens issued", "accounting", "issued", ""),
        ("tokens granted and returned", "accounting", "returned", ""),
        ("tokens refunded", "accounting", "refunded", ""),
        ("leaked", "accounting", "leaked", "0"),
        ("never over capacity + rate*t", "accounting", "never_over_rate", "True"),
        ("uncontended acquire (us)", "uncontended", "acquire_us", ""),
        ("  empty coroutine, reference (us)", "uncontended", "empty_coroutine_us", ""),
    ]
    print(f"{'figure':<38}{'fair':>12}{'fifo':>12}  goal")
    for label, section, field, goal in rows:
        fair, fifo = (figures[section][kind][field] for kind in KINDS)
        print(f"{label:<38}{fair!s:>12}{fifo!s:>12}  {goal}")
    print("\nrate error (%) at 200/s, 200 waiters       fair      fifo   goal |x| <= 1")
    for load in ("quiet", "loaded"):
        section = figures["rate_vs_capacity"][load]
        for capacity in ("1", "2", "200"):
            fair, fifo = (section[kind][capacity]["error_pct"] for kind in KINDS)
            print(f"  {load:<7} capacity {capacity:<4} (loadavg {section['loadavg'][0]:>5})"
                  f"{fair:>10}{fifo:>10}")
    print("\n     keys    kept  folded   tally MB  stats() ms  lock held ms"
          "   goal: < 10 MB, < 100 ms")
    for row in figures["many_keys"]:
        print(f"{row['keys']:>9}{row['keys_kept']:>8}{row['keys_folded']:>8}"
              f"{row['tally_bytes'] / 1e6:>11.2f}{row['stats_ms']:>12}"
              f"{row['stats_lock_held_ms']:>14}")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs; prints only")
    parser.add_argument("--burners", type=int, default=os.cpu_count() or 2,
                        help="CPU-burning subprocesses for the loaded runs (default: one a core)")
    args = parser.parse_args()
    started = time.monotonic()
    figures = asyncio.run(run(args.quick, args.burners))
    figures["wall_s"] = round(time.monotonic() - started, 1)
    print_table(figures)
    print(f"wall time {figures['wall_s']} s")
    if not args.quick:
        print("wrote", write_result("ratelimit", figures))


if __name__ == "__main__":
    main()
