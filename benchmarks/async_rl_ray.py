"""Asynchronous RL through RayRolloutPool: what a pool-wide weight update costs.

    python benchmarks/async_rl_ray.py [--workers 2] [--mb 0 64] [--steps 6]

On a local Ray cluster (``ray.init(num_cpus=2)`` on 127.0.0.1), ``AsyncRollout`` drives a pool
of workers, each running the simulated engine (capacity mode: 32 sequences, 1 ms decode
steps, 64-token replies; simulated, named as such). Each step takes a batch of 8 groups x 4
and pushes a state dict of ``--mb`` MiB (one float32 array: ``ray.put`` once, fetched by every
worker before its pause; the simulated engine does not read it) with ``max_staleness=1``.
Figures per size, written to ``benchmarks/results/async_rl_ray.json``: the trainer's wait per
update (``update_stall_s``: the whole call, the object-store transfer included), each worker's
engine pause (``worker_stall_s``: pause to resume), samples/s, and the report's counts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import numpy as np
import ray
from _common import write_result

from pipeline import AsyncRollout, Pipeline, SamplingParams
from pipeline.distributed import RayRolloutPool
from pipeline.engines import SimulatedEngine
from pipeline.stages import BuildPrompt, Generate
from pipeline.testing import ByteTokenizer

EOS = ByteTokenizer().eos_token_id


def reply(prompt_ids: list[int], rng: Any) -> list[int]:
    return [*([65] * 63), EOS]


def make_pipeline() -> Pipeline:
    engine = SimulatedEngine(max_running=32, token_time_s=0.001, responder=reply,
                             eos_token_id=EOS)
    return Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                    sampling=SamplingParams(max_tokens=128, seed=1))


async def run(pool: RayRolloutPool, mb: int, steps: int) -> dict[str, Any]:
    state = ({"w": np.ones(mb * 2**20 // 4, dtype=np.float32)} if mb else None)
    rows = [{"prompt": f"question {i}"} for i in range(8 * (steps + 4))]
    began = time.monotonic()
    samples = 0
    async with AsyncRollout(pool, rows, n=4, batch_groups=8, max_inflight=16,
                            max_staleness=1) as rollout:
        for _ in range(steps):
            batch = await rollout.next_batch()
            samples += sum(len(g.samples) for g in batch)
            await rollout.update_weights(state_dict=state)
    wall = time.monotonic() - began
    report = rollout.report
    pauses = [s for update in report.worker_stall_s for s in update.values()]
    return {"state_dict_mib": mb, "steps": steps, "samples_delivered": samples,
            "samples_per_s": round(samples / wall, 1),
            "update_wait_s_median": round(statistics.median(report.update_stall_s), 4),
            "update_wait_s_max": round(max(report.update_stall_s), 4),
            "worker_pause_s_median": round(statistics.median(pauses), 4),
            "worker_pause_s_max": round(max(pauses), 4),
            "report": report.as_dict()}


async def main(args: argparse.Namespace) -> None:
    figures: dict[str, Any] = {"workers": args.workers, "runs": []}
    async with RayRolloutPool(args.workers, make_pipeline) as pool:
        for mb in args.mb:
            result = await run(pool, mb, args.steps)
            figures["runs"].append(result)
            print(f"state dict {mb:>4} MiB: update wait median "
                  f"{result['update_wait_s_median']:.3f} s (max {result['update_wait_s_max']:.3f}),"
                  f" worker pause median {result['worker_pause_s_median']:.4f} s, "
                  f"{result['samples_per_s']} samples/s")
    figures["loadavg"] = os.getloadavg()
    print("wrote", write_result("async_rl_ray", figures))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mb", type=int, nargs="+", default=[0, 64])
    parser.add_argument("--steps", type=int, default=6)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    asyncio.run(main(parser.parse_args()))
