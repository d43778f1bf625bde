"""Adaptive concurrency against a sweep of fixed ``max_concurrency`` settings (issue 38), on
the SIMULATED engine's capacity model (no model: a batched decoder with slots and a KV
budget that preempts, :mod:`pipeline.engines._capacity`).

Run::

    python benchmarks/flow_control.py            # three shapes, the sweep and adaptive
    python benchmarks/flow_control.py --quick    # a smoke run, nothing written

Shapes (each sample is an agent of our own: generate, wait on a "tool", generate again):

- ``short``: one turn, prompt 64 tokens, replies of 16-64 tokens (20,000 samples);
- ``multiturn``: four turns with a tool wait of 50-250 ms between them (the sample holds no
  KV while it waits), prompt 128 tokens, replies of 32-96 (2,500 samples);
- ``heavytail``: one turn, prompt 64, replies Pareto-distributed (alpha 1.5, at least 16,
  at most 1024 tokens; 12,000 samples).

The engine: ``max_running`` 256 sequences, a decode step of ``token_time_s`` for all of
them, a KV budget of ``kv_capacity_tokens``, so that running too many samples preempts (vLLM
recompute semantics) and running too few leaves slots idle. Per run: model tokens per
second over the batch's wall time, preemptions, the limit (for adaptive: its time-weighted
mean, min and max over the run's second half, and its highest).

Run sizes: each run lasts about 50 turnovers (a turnover: how long a sample holds its slot)
at the best setting, so that the controller's warm-up (a few turnovers) and the batch's
drain (the last turnover, at any setting) are small shares: a run of a few turnovers (the
short shape's 3,000 samples, about 3 s) cannot show convergence. ``--scale`` multiplies the
sizes.

Adaptive runs with ``AdaptiveConcurrency()``'s defaults and nothing else set (from the
default ``max_concurrency``, 256) and two batches on one pipeline (the limit carries over between
batches, as between a trainer's steps): the first is reported as ``cold_tokens_per_s``; the
second is the one compared. The figures are noisy on a loaded machine: the load average is
recorded beside each shape, and a shape's sweep and adaptive runs are compared within one
run of this script.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import time
from typing import Any

from _common import write_result

from pipeline import (
    AdaptiveConcurrency,
    Pipeline,
    PipelineConfig,
    SamplingParams,
    SimulatedEngine,
    artifacts,
)
from pipeline.testing import ByteTokenizer

EOS = 2
SHAPES: dict[str, dict[str, Any]] = {
    "short": {"prompt": 64, "turns": 1, "reply": (16, 64), "tool_s": (0.0, 0.0),
              "samples": 20000},
    "multiturn": {"prompt": 128, "turns": 4, "reply": (32, 96), "tool_s": (0.05, 0.25),
                  "samples": 2500},
    "heavytail": {"prompt": 64, "turns": 1, "reply": "pareto", "tool_s": (0.0, 0.0),
                  "samples": 12000},
}
ENGINE = {"max_running": 256, "token_time_s": 0.004, "kv_capacity_tokens": 16384}


def reply_length(shape: dict[str, Any], rng: random.Random) -> int:
    if shape["reply"] == "pareto":
        return min(1024, int(16 * rng.paretovariate(1.5)))
    low, high = shape["reply"]
    return rng.randint(low, high)


def make_engine(shape: dict[str, Any], seed: int, **engine: Any) -> SimulatedEngine:
    def responder(prompt_ids: list[int], rng: random.Random) -> list[int]:
        return [7] * (reply_length(shape, rng) - 1) + [EOS]

    return SimulatedEngine(responder=responder, eos_token_id=EOS, seed=seed,
                           **{**ENGINE, **engine})


def agent(shape: dict[str, Any]) -> Any:
    """A simulated agent: ``turns`` generations with a tool wait between them."""

    async def run(item: Any, ctx: Any) -> None:
        rng = random.Random(item.uid)
        prompt = [5] * shape["prompt"]
        sampled = 0
        for turn in range(shape["turns"]):
            if turn:
                await asyncio.sleep(rng.uniform(*shape["tool_s"]))
                prompt = [*prompt, *[6] * 16]  # the tool's answer, as template tokens
            gen = await ctx.engine.generate(prompt, item.sampling, f"{item.uid}-{turn}")
            prompt = [*prompt, *gen.token_ids]
            sampled += len(gen.token_ids)
        item.artifacts[artifacts.PROMPT_IDS] = [5] * shape["prompt"]
        item.artifacts[artifacts.RESPONSE_IDS] = [7] * sampled
        item.artifacts[artifacts.RESPONSE_MASK] = [1] * sampled
        item.artifacts[artifacts.LOGPROBS] = [0.0] * sampled

    return run


async def run_once(shape_name: str, samples: int, concurrency: int | None,
                   seed: int = 0, **engine: Any) -> dict[str, Any]:
    """One batch: fixed ``concurrency``, or adaptive (the defaults) when None."""
    shape = SHAPES[shape_name]
    eng = make_engine(shape, seed, **engine)
    mode: dict[str, Any] = ({"adaptive_concurrency": AdaptiveConcurrency()} if concurrency is None
                            else {"max_concurrency": concurrency, "adaptive_concurrency": False})
    config = PipelineConfig(sample_timeout_s=None, progress_log_s=None,
                            sampling=SamplingParams(max_tokens=1024), **mode)
    pipe = Pipeline([agent(shape)], engine=eng, tokenizer=ByteTokenizer(), config=config)
    rows = [{"prompt": f"q{i}"} for i in range(samples)]
    cold = None
    if concurrency is None:
        # The limit carries over between batches of one pipeline, as between a trainer's
        # steps: the first batch (from the default 256) is reported as cold, the second is
        # compared.
        started = time.monotonic()
        first = await pipe.run_batch(rows)
        cold = round(first.stats.model_tokens / (time.monotonic() - started), 1)
        del first  # the first batch's samples would otherwise weigh on the second's GC
    # Every timed batch starts from a collected heap: the runs are CPU-bound on a loaded
    # machine, and a full collection of one run's leftovers would land on the next.
    gc.collect()
    before = eng.load().preemptions or 0
    started = time.monotonic()
    result = await pipe.run_batch(rows)
    wall = time.monotonic() - started
    load = eng.load()
    await eng.aclose()
    out: dict[str, Any] = {
        "shape": shape_name, "mode": "adaptive" if concurrency is None else "fixed",
        "max_concurrency": concurrency, "samples": samples, "wall_s": round(wall, 3),
        "tokens_per_s": round(result.stats.model_tokens / wall, 1),
        "preemptions": (load.preemptions or 0) - before, "by_status": result.stats.by_status,
    }
    if cold is not None:
        out["cold_tokens_per_s"] = cold
    controller = pipe._loop_state().flow.controller
    if concurrency is None and controller is not None:  # the second batch's second half
        half = controller.summary(started + wall / 2)
        out["limit_second_half"] = {k: round(v, 1) for k, v in half.items()}
        out["limit_swing_frac"] = round(
            (half["limit_max"] - half["limit_min"]) / half["limit_mean"], 3)
        out["limit_highest"] = max(n for _, n in controller.history)
        out["limit_changes"] = len(controller.history)
        out["turnover_s"] = controller.state()["turnover_s"]
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"engine": ENGINE, "shapes": SHAPES, "runs": [],
                               "loadavg_before": os.getloadavg()}
    for shape in args.shapes:
        rows: list[dict[str, Any]] = []
        samples = max(1, int(SHAPES[shape]["samples"] * args.scale))
        load_before = os.getloadavg()
        for concurrency in [*args.sweep, None]:
            row = await run_once(shape, samples, concurrency)
            rows.append(row)
            print(row, flush=True)
        fixed = [r for r in rows if r["mode"] == "fixed"]
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        worst = min(fixed, key=lambda r: r["tokens_per_s"])
        adaptive = rows[-1]
        summary = {"shape": shape, "samples": samples,
                   "best_fixed": best["max_concurrency"],
                   "best_tokens_per_s": best["tokens_per_s"],
                   "worst_fixed": worst["max_concurrency"],
                   "worst_tokens_per_s": worst["tokens_per_s"],
                   "adaptive_tokens_per_s": adaptive["tokens_per_s"],
                   "adaptive_cold_tokens_per_s": adaptive["cold_tokens_per_s"],
                   "adaptive_vs_best": round(adaptive["tokens_per_s"] / best["tokens_per_s"], 3),
                   "adaptive_cold_vs_best": round(
                       adaptive["cold_tokens_per_s"] / best["tokens_per_s"], 3),
                   "adaptive_limit": adaptive.get("limit_second_half"),
                   "adaptive_swing_frac": adaptive.get("limit_swing_frac"),
                   "adaptive_limit_highest": adaptive.get("limit_highest"),
                   "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
        print("summary", summary, flush=True)
        figures["runs"].extend(rows)
        figures.setdefault("summary", []).append(summary)
    figures["loadavg_after"] = os.getloadavg()
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small runs, nothing written")
    parser.add_argument("--scale", type=float, default=None,
                        help="multiplies each shape's number of samples")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--sweep", nargs="+", type=int, default=None)
    parser.add_argument("--out", default="flow_control",
                        help="results file name (benchmarks/results/<out>.json)")
    args = parser.parse_args()
    if args.scale is None:
        args.scale = 0.05 if args.quick else 1.0
    if args.sweep is None:
        args.sweep = [32, 128] if args.quick else [64, 128, 256, 512, 1024]
    figures = asyncio.run(main(args))
    figures["parameters"] = {"scale": args.scale, "sweep": args.sweep}
    if not args.quick:
        print("wrote", write_result(args.out, figures))
