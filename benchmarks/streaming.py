"""Streaming vs run_batch, and dynamic sampling's cost, on a heavy-tailed simulated engine.

    python benchmarks/streaming.py [--prompts 64] [--n 8] [--groups 16] [--seed 0]

Figures (written to benchmarks/results/streaming.json):
- time to the first complete group and to ``--groups`` groups, ``stream_groups`` vs
  ``run_batch`` (which hands everything over when the slowest straggler ends);
- samples generated per informative group kept with ``DynamicSampling``, at several rates of
  zero-variance groups (all rewards equal).

The engine is :class:`SimulatedEngine` (simulated, named as such): log-normal latency with a
5% tail of stragglers 40x slower.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_result

from pipeline import (
    BuildPrompt,
    DynamicSampling,
    Generate,
    Pipeline,
    SimulatedEngine,
    artifacts,
)
from pipeline.testing import ByteTokenizer


def build(seed: int, flat_rate: float = 0.0) -> Pipeline:
    rng = random.Random(seed)
    flat_groups: dict[str, bool] = {}

    async def reward(item: Any, ctx: Any) -> None:
        flat = flat_groups.setdefault(item.group_id, rng.random() < flat_rate)
        item.artifacts[artifacts.REWARD] = 1.0 if flat else float(item.sample_index % 2)

    engine = SimulatedEngine(latency_s=0.05, latency_sigma=0.6, tail_prob=0.05,
                             tail_factor=40.0, seed=seed)
    return Pipeline([BuildPrompt(), Generate(), reward], engine=engine,
                    tokenizer=ByteTokenizer(), sampling={"max_tokens": 16},
                    max_concurrency=4096, sample_timeout_s=120)


def rows(count: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"prompt": f"problem {offset + i}"} for i in range(count)]


async def latency(prompts: int, n: int, groups: int, seed: int) -> dict[str, float]:
    pipe = build(seed)
    start = time.perf_counter()
    result = await pipe.run_batch(rows(prompts), n=n)
    batch_all = time.perf_counter() - start
    assert len(result.samples) == prompts * n
    pipe = build(seed)
    start = time.perf_counter()
    seen: list[float] = []
    async with pipe.stream_groups(rows(prompts), n=n) as stream:
        async for _group in stream:
            seen.append(time.perf_counter() - start)
    return {
        "run_batch_all_groups_s": round(batch_all, 3),
        "stream_first_group_s": round(seen[0], 3),
        f"stream_{groups}_groups_s": round(seen[groups - 1], 3),
        "stream_all_groups_s": round(seen[-1], 3),
        "first_group_speedup": round(batch_all / seen[0], 1),
        f"{groups}_groups_speedup": round(batch_all / seen[groups - 1], 1),
    }


async def dynamic_cost(flat_rate: float, target: int, n: int, seed: int) -> dict[str, Any]:
    pipe = build(seed, flat_rate)

    def endless() -> Any:
        i = 0
        while True:
            yield {"prompt": f"problem {i}"}
            i += 1

    stream = pipe.stream_groups(endless(), n=n,
                                dynamic=DynamicSampling(target_groups=target, max_rounds=50))
    start = time.perf_counter()
    async with stream as groups:
        kept = [g async for g in groups]
    report = stream.report
    return {
        "zero_variance_rate": flat_rate,
        "target_groups": target,
        "kept": len(kept),
        "samples": report.samples,
        "samples_per_kept_group": round(report.samples_per_kept_group, 2),
        "ideal_samples_per_kept_group": round(n / (1 - flat_rate), 2),
        "set_aside_groups": len(report.set_aside),
        "aborted_groups": len(report.aborted),
        "rounds": report.rounds,
        "stopped_by": report.stopped_by,
        "wall_s": round(time.perf_counter() - start, 3),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    figures: dict[str, Any] = {"prompts": args.prompts, "n": args.n,
                               "engine": "SimulatedEngine(latency 0.05 s log-normal sigma 0.6, "
                                         "5% stragglers x40)"}
    figures["latency"] = await latency(args.prompts, args.n, args.groups, args.seed)
    print(figures["latency"])
    figures["dynamic_sampling"] = []
    for rate in (0.0, 0.5, 0.75):
        row = await dynamic_cost(rate, 32, args.n, args.seed)
        print(row)
        figures["dynamic_sampling"].append(row)
    print(write_result("streaming", figures))


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main())
