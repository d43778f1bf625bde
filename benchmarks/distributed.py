"""Rollouts on Ray: throughput by worker count, 20,000 samples in flight, the fleet limiter.

    python benchmarks/distributed.py [--samples 8000] [--inflight 20000] [--limiter-s 6]

Figures (written to benchmarks/results/distributed.json), on a local Ray cluster
(``ray.init(num_cpus=2)`` on 127.0.0.1):
- samples/s through one process (no Ray) and through ``RayRolloutPool`` with 1, 2 and 4
  workers (4 oversubscribes this 2-core machine), each sample running the tiny Qwen2
  tokenizer's chat template and tokenization (real CPU work) and a simulated engine call of
  1 s (``SimulatedEngine``, simulated, named as such); what Ray adds per sample is the
  1-worker wall time minus the one-process wall time, per sample;
- 20,000 samples in flight across 2 workers (a 1 s stage each): wall time and the driver's
  peak RSS;
- the fleet limiter: 8 keys spread unevenly over 4 workers' leased registries (5 keys, 1, 1,
  1), all backlogged: rate error over the steady window (goal <= 2%) and Jain's index over
  the keys' grant rates (goal >= 0.98). The four registries live in the driver process (each
  its own worker id); every lease is a real Ray call to the limiter actor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray
from _common import write_result

from pipeline import BuildPrompt, Generate, Pipeline, SimulatedEngine
from pipeline.distributed import FleetLimiterRegistry, LimiterActor, RayRolloutPool


def templated_pipeline(model_dir: str, concurrency: int) -> Pipeline:
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    return Pipeline([BuildPrompt(), Generate()],
                    engine=SimulatedEngine(latency_s=1.0, latency_sigma=0.0, tail_prob=0.0),
                    tokenizer=tokenizer, max_concurrency=concurrency, sample_timeout_s=600,
                    sampling={"max_tokens": 16})


async def one_second(item: Any, ctx: Any) -> None:
    await asyncio.sleep(1.0)


def sleeping_pipeline(concurrency: int) -> Pipeline:
    from pipeline.testing import ByteTokenizer

    return Pipeline([one_second], tokenizer=ByteTokenizer(), max_concurrency=concurrency,
                    sample_timeout_s=600)


def rows(count: int) -> list[dict[str, Any]]:
    return [{"prompt": f"What is {i} plus {i + 1}? Show your work."} for i in range(count // 4)]


def rss_mib(field: str = "VmHWM") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def throughput(samples: int, model_dir: str) -> dict[str, Any]:
    import functools

    out: dict[str, Any] = {}
    local = templated_pipeline(model_dir, samples)
    await local.run_batch(rows(8), n=4)  # warm, as the pools are
    start = time.perf_counter()
    result = await local.run_batch(rows(samples), n=4)
    wall = time.perf_counter() - start
    assert result.stats.by_status == {"completed": samples}
    out["one_process"] = {"wall_s": round(wall, 2), "samples_per_s": round(samples / wall, 1)}
    for workers in (1, 2, 4):
        factory = functools.partial(templated_pipeline, model_dir, samples)
        async with RayRolloutPool(workers, factory) as pool:
            await pool.run_batch(rows(8 * workers), n=4)  # warm: imports, first calls
            start = time.perf_counter()
            result = await pool.run_batch(rows(samples), n=4)
            wall = time.perf_counter() - start
        assert result.stats.by_status == {"completed": samples}, result.stats.by_status
        out[f"ray_{workers}_workers"] = {
            "wall_s": round(wall, 2), "samples_per_s": round(samples / wall, 1),
            "oversubscribed": workers > 2}
        print(f"{workers} worker(s): {samples / wall:.0f} samples/s ({wall:.2f} s)", flush=True)
    one = out["ray_1_workers"]["wall_s"]
    out["ray_added_ms_per_sample"] = round((one - out["one_process"]["wall_s"]) / samples * 1e3,
                                           3)
    return out


async def inflight(samples: int) -> dict[str, Any]:
    import functools

    factory = functools.partial(sleeping_pipeline, samples)
    async with RayRolloutPool(2, factory) as pool:
        before = rss_mib("VmRSS")
        start = time.perf_counter()
        result = await pool.run_batch([{"prompt": f"p{i}"} for i in range(samples)], n=1)
        wall = time.perf_counter() - start
    assert result.stats.by_status == {"completed": samples}
    return {"samples": samples, "workers": 2, "wall_s": round(wall, 2),
            "driver_rss_before_mib": round(before, 1), "driver_peak_rss_mib": round(rss_mib(), 1)}


async def fleet_limiter(seconds: float, rate: float = 200.0, capacity: float = 10.0
                        ) -> dict[str, Any]:
    spread = {"w0": ["k0", "k1", "k2", "k3", "k4"], "w1": ["k5"], "w2": ["k6"], "w3": ["k7"]}
    actor = ray.remote(LimiterActor).options(num_cpus=0).remote()
    await actor.stats.remote()
    registries = {w: FleetLimiterRegistry(actor, w) for w in spread}
    grants: list[tuple[float, str]] = []

    async def caller(worker: str, key: str) -> None:
        bucket = registries[worker].get("api", rate, capacity)
        while True:
            await bucket.acquire(key)
            grants.append((time.monotonic(), key))

    start = time.monotonic()
    tasks = [asyncio.create_task(caller(w, k)) for w, keys in spread.items() for k in keys
             for _ in range(8)]
    await asyncio.sleep(seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    leases = sum(r.get("api", rate, capacity).leases for r in registries.values())
    for registry in registries.values():
        await registry.aclose()
    stats = (await actor.stats.remote())["api"]
    ray.kill(actor)
    first = grants[0][0]
    lo, hi = first + 1.0, grants[-1][0]  # the steady window: after the first second
    window = [k for t, k in grants if lo <= t <= hi]
    achieved = len(window) / (hi - lo)
    counts = Counter(window)
    shares = [counts[k] / (hi - lo) for keys in spread.values() for k in keys]
    jain = sum(shares) ** 2 / (len(shares) * sum(s * s for s in shares))
    worst = max(n - (capacity + rate * (t - start)) for n, (t, _) in enumerate(grants, 1))
    return {"rate": rate, "capacity": capacity, "seconds": seconds, "keys": 8, "workers": 4,
            "spread": {w: len(k) for w, k in spread.items()}, "grants": len(grants),
            "achieved_rate": round(achieved, 2),
            "rate_error": round(abs(achieved - rate) / rate, 4),
            "jain_index": round(jain, 4),
            "per_key_rate": {k: round(counts[k] / (hi - lo), 2) for k in sorted(counts)},
            "grants_per_lease": round(len(grants) / max(1, leases), 2),
            "max_over_bound_tokens": round(worst, 6), "leaked": stats.leaked}


async def main(args: argparse.Namespace) -> None:
    from pipeline import ensure_tiny_model

    model_dir = str(ensure_tiny_model())
    figures: dict[str, Any] = {"load_avg_before": [round(x, 2) for x in os.getloadavg()]}
    figures["fleet_limiter"] = fleet_limiter_result = await fleet_limiter(args.limiter_s)
    print(f"fleet limiter: rate error {fleet_limiter_result['rate_error']:.2%}, "
          f"Jain {fleet_limiter_result['jain_index']:.4f}", flush=True)
    figures["throughput"] = await throughput(args.samples, model_dir)
    figures["inflight"] = result = await inflight(args.inflight)
    print(f"{args.inflight} in flight on 2 workers: {result['wall_s']} s, driver peak RSS "
          f"{result['driver_peak_rss_mib']} MiB", flush=True)
    figures["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(write_result("distributed", figures))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--inflight", type=int, default=20000)
    parser.add_argument("--limiter-s", type=float, default=6.0)
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        asyncio.run(main(args))
    finally:
        ray.shutdown()
