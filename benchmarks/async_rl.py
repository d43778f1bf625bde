"""Asynchronous RL on a simulated engine: samples/s and engine idle, synchronous vs AsyncRollout.

Everything here is simulated and named so: a ``SimulatedEngine`` in capacity mode (at most
``--capacity`` sequences decode at once, one token each per ``--token-ms``) replies with
long-tailed lengths (log-normal around ``--median-tokens``, 5% stragglers 10-40x longer), and a
simulated trainer step lasts as long as the engine needs for one batch's tokens at full
capacity (so overlapping alone gives at most 2x; the rest comes from not waiting for
stragglers). Each mode trains ``--steps`` batches of ``--groups`` groups of ``--n`` samples:

- ``sync``: ``run_batch`` of one batch, then the trainer step, then the weight update;
- ``async eta=k``: :class:`pipeline.AsyncRollout` with ``max_staleness=k``: the trainer takes
  a batch, trains (the engine keeps generating), and pushes weights (pause keep / resume).

Engine idle is the fraction of wall time no sequence was decoding (``engine.load().busy_s``);
utilisation is the fraction of decode slots used (``slot_s / (capacity * wall)``).

    python benchmarks/async_rl.py            # the full run
    python benchmarks/async_rl.py --quick    # fewer steps
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import time
from typing import Any

from _common import write_result

from pipeline import AsyncRollout, Pipeline, SamplingParams, artifacts
from pipeline.engines import SimulatedEngine
from pipeline.stages import BuildPrompt, Generate
from pipeline.testing import ByteTokenizer

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_token_id


def reply_length(rng: random.Random, median: int, cap: int) -> int:
    """Log-normal (sigma 0.5) around ``median``; 5% stragglers 10-40x longer; capped."""
    length = median * math.exp(rng.gauss(0.0, 0.5))
    if rng.random() < 0.05:
        length *= rng.uniform(10.0, 40.0)
    return max(2, min(cap, int(length)))


def responder(median: int, cap: int):
    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        return [*([65] * (reply_length(rng, median, cap) - 1)), EOS]
    return respond


async def reward(item: Any, ctx: Any) -> None:
    item.artifacts[artifacts.REWARD] = 1.0


def build(args: argparse.Namespace) -> Pipeline:
    engine = SimulatedEngine(max_running=args.capacity, token_time_s=args.token_ms / 1000,
                             responder=responder(args.median_tokens, args.max_tokens),
                             eos_token_id=EOS, seed=args.seed)
    return Pipeline([BuildPrompt(), Generate(), reward], engine=engine, tokenizer=TOKENIZER,
                    sampling=SamplingParams(max_tokens=args.max_tokens),
                    max_concurrency=args.groups * args.n * 8)


def rows(count: int, offset: int = 0) -> list[dict[str, Any]]:
    return [{"prompt": f"question {offset + i}"} for i in range(count)]


def train_step_s(args: argparse.Namespace) -> float:
    """The engine's time for one batch's tokens at full capacity (mean length, measured)."""
    rng = random.Random(12345)
    mean = sum(reply_length(rng, args.median_tokens, args.max_tokens)
               for _ in range(20000)) / 20000
    return args.groups * args.n * mean / args.capacity * args.token_ms / 1000


def figures_of(engine: SimulatedEngine, wall: float, samples: int, args: argparse.Namespace,
               before: Any) -> dict[str, Any]:
    load = engine.load()
    busy = (load.busy_s or 0.0) - (before.busy_s or 0.0)
    slots = (load.slot_s or 0.0) - (before.slot_s or 0.0)
    return {"wall_s": round(wall, 3), "samples_trained": samples,
            "samples_per_s": round(samples / wall, 2),
            "engine_idle_fraction": round(1 - busy / wall, 4),
            "engine_utilisation": round(slots / (args.capacity * wall), 4),
            "sampled_tokens": (load.sampled_tokens or 0) - (before.sampled_tokens or 0)}


async def run_sync(args: argparse.Namespace, train_s: float) -> dict[str, Any]:
    pipeline = build(args)
    engine = pipeline.resources.engine
    before = engine.load()
    start = time.perf_counter()
    samples = 0
    for step in range(args.steps):
        result = await pipeline.run_batch(rows(args.groups, step * args.groups), n=args.n)
        samples += len(result.samples)
        await asyncio.sleep(train_s)  # the simulated trainer step
        await engine.pause("wait")
        await engine.update_weights()
        await engine.resume()
    out = figures_of(engine, time.perf_counter() - start, samples, args, before)
    await engine.aclose()
    return {"mode": "sync", **out}


async def run_async(args: argparse.Namespace, train_s: float, eta: int) -> dict[str, Any]:
    pipeline = build(args)
    engine = pipeline.resources.engine
    before = engine.load()
    start = time.perf_counter()
    samples = 0
    lags: dict[int, int] = {}
    rollout = AsyncRollout(pipeline, rows(args.groups * args.steps * 4), n=args.n,
                           batch_groups=args.groups, max_inflight=args.groups * args.inflight,
                           max_staleness=eta)
    async with rollout:
        for _ in range(args.steps):
            batch = await rollout.next_batch()
            samples += sum(len(g.samples) for g in batch)
            await asyncio.sleep(train_s)  # the simulated trainer step; the engine goes on
            await rollout.update_weights()
        wall = time.perf_counter() - start
        out = figures_of(engine, wall, samples, args, before)
        lags = dict(rollout.report.delivered)
    await engine.aclose()
    report = rollout.report.as_dict()
    return {"mode": f"async eta={eta}", **out, "delivered_by_lag": {str(k): v for k, v in
                                                                     sorted(lags.items())},
            "set_aside_by_lag": report["set_aside"], "interrupted_by_lag": report["interrupted"],
            "update_stall_s_max": max(report["update_stall_s"], default=0.0)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 steps instead of --steps")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--groups", type=int, default=16, help="groups per trainer batch")
    parser.add_argument("--n", type=int, default=4, help="samples per group")
    parser.add_argument("--capacity", type=int, default=32, help="sequences decoding at once")
    parser.add_argument("--token-ms", type=float, default=1.0, help="one decode step")
    parser.add_argument("--median-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--inflight", type=int, default=3,
                        help="max_inflight, in batches of groups")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.steps = 4
    train_s = train_step_s(args)
    figures: dict[str, Any] = {
        "engine": "SimulatedEngine (capacity mode; simulated, no model)",
        "parameters": {**{k: v for k, v in vars(args).items()},
                       "length_model": "log-normal sigma 0.5 around median; 5% x U(10, 40)",
                       "train_step_s": round(train_s, 4)},
        "loadavg_before": os.getloadavg(),
        "runs": [],
    }
    print(f"simulated trainer step: {train_s:.3f} s")
    runs = [("sync", None), ("async", 0), ("async", 1), ("async", 2)]
    for mode, eta in runs:
        row = await (run_sync(args, train_s) if mode == "sync"
                     else run_async(args, train_s, eta or 0))
        print(row)
        figures["runs"].append(row)
    sync = figures["runs"][0]["samples_per_s"]
    figures["speedup_vs_sync"] = {r["mode"]: round(r["samples_per_s"] / sync, 2)
                                  for r in figures["runs"]}
    figures["loadavg_after"] = os.getloadavg()
    print(figures["speedup_vs_sync"])
    print(write_result("async_rl", figures))


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main())
