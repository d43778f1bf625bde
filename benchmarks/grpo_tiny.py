"""The closed GRPO loop (``scenarios/grpo_tiny.py``): held-out gain per training seed, wall
time, and the engine-vs-trainer logprob gap per engine.

1. ``--seeds``: one full run of the scenario per seed, each in its own process (wall time
   measured around the process: imports, engine start, both held-out evaluations, shutdown),
   on ``--engine``; its summary gives the held-out mean reward before and after (256
   problems, ``HELDOUT_SEED``, disjoint from the training seeds) with 95% intervals
   (``results/grpo_tiny.json``; the first seed's plot is ``grpo_tiny_reward_curve.png``).
2. ``--gap-engines``: for each engine, rollouts of the tiny policy under several sampling
   settings, rescored by a forward pass of the same weights under the trainer's processing
   (logits / temperature, no top-k/top-p); max and mean absolute logprob difference over the
   model tokens. Settings with top-k/top-p are reported apart: there the engine reports the
   renormalised truncated distribution, which the trainer's processing does not reproduce
   (``results/grpo_tiny_logprob_gap.json``).

    python benchmarks/grpo_tiny.py [--seeds 1,2] [--engine vllm]
        [--gap-engines transformers,vllm,vllm-bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import RESULTS, write_result  # noqa: E402

GAP_SETTINGS = {
    "t1.0": {"temperature": 1.0},
    "t0.7": {"temperature": 0.7},
    "t1.0_topk20": {"temperature": 1.0, "top_k": 20},
    "t1.0_topp0.9": {"temperature": 1.0, "top_p": 0.9},
}


def run_seed(seed: int, engine: str, out: Path, minutes: float) -> dict[str, Any]:
    """One scenario run in a fresh process; its summary plus the process wall time."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "scenarios.grpo_tiny", "--engine", engine,
               "--seed", str(seed), "--minutes", str(minutes), "--out", str(out)]
    load = os.getloadavg()
    started = time.perf_counter()
    with open(out / "run.log", "w") as log:
        subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    process_s = time.perf_counter() - started
    summary = json.loads((out / "summary.json").read_text())
    history = summary.pop("history")
    return {**summary, "process_wall_s": round(process_s, 1), "load_average_before": load,
            "load_average_after": os.getloadavg(),
            "reward_per_iteration": [round(h["reward"], 4) for h in history],
            "gap_max_per_iteration": [h["gap_max"] for h in history],
            "gap_mean_per_iteration": [h["gap_mean"] for h in history]}


async def measure_gap(engine_name: str, count: int = 64, n: int = 2) -> dict[str, Any]:
    """Rollouts under each of ``GAP_SETTINGS`` rescored by the trainer's forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline import Pipeline, collate
    from pipeline.engines import make_engine
    from pipeline.models import tiny_policy_dir
    from scenarios import arith_tools, grpo_tiny

    torch.set_num_threads(2)
    kind, _, dtype = engine_name.partition("-")  # "vllm-bfloat16": vLLM in bfloat16
    options = ({"dtype": dtype or "float32", "enforce_eager": True, "max_model_len": 2048}
               if kind == "vllm" else {"max_batch_size": 256, "max_model_len": 2048})
    engine, tokenizer = await make_engine(kind, model_dir=tiny_policy_dir(),
                                          options=options, notify=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir()),
                                                 dtype=torch.float32).eval()
    out: dict[str, Any] = {"engine": type(getattr(engine, "engine", engine)).__name__,
                           "engine_dtype": dtype or "float32", "trainer_dtype": "float32",
                           "samples": count * n}
    try:
        for name, sampling in GAP_SETTINGS.items():
            pipeline = Pipeline(arith_tools.stages(), engine=engine, tokenizer=tokenizer,
                                tools=arith_tools.tools(), progress_log_s=None,
                                config={"seed": 0, "sampling": {
                                    "max_tokens": 96, "max_response_tokens": 512, **sampling}})
            samples = (await pipeline.run_batch(arith_tools.rows(count, 99), n=n)).samples
            batch = collate(samples, pad_token_id=tokenizer.pad_token_id, max_prompt_len=1024,
                            max_response_len=512, pad_to="longest")
            trainer = grpo_tiny.token_logprobs(model, batch, sampling["temperature"])
            gap = grpo_tiny.logprob_gap(batch["rollout_log_probs"], trainer,
                                        batch["response_mask"])
            filtered = "top_k" in sampling or "top_p" in sampling
            out.setdefault("with_top_k_top_p" if filtered else "plain", {})[name] = {
                "sampling": sampling, **gap}
            print(engine_name, name, json.dumps(gap), flush=True)
    finally:
        await engine.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="1,2", help="training seeds ('' skips the runs)")
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--gap-engines", default="transformers,vllm,vllm-bfloat16",
                        help="engines whose logprob gap to measure ('' skips it)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "grpo_tiny_bench",
                        help="run folder, relative to the repository root")
    args = parser.parse_args()
    os.chdir(ROOT)  # run folders are recorded relative to the repository, never a machine path
    gaps = {name: asyncio.run(measure_gap(name))
            for name in filter(None, args.gap_engines.split(","))}
    if gaps:
        print(write_result("grpo_tiny_logprob_gap", {"trainer_processing": (
            "log_softmax(logits / temperature), no top-k/top-p, float32"), "engines": gaps}))
    seeds = [int(s) for s in filter(None, args.seeds.split(","))]
    runs: dict[str, Any] = {}
    for seed in seeds:
        run = run_seed(seed, args.engine, args.out / f"seed{seed}", args.minutes)
        runs[f"seed{seed}"] = run
        if seed == seeds[0]:  # docs/guides/rl-loop.md shows the first seed's curve
            shutil.copy(args.out / f"seed{seed}" / "reward_curve.png",
                        RESULTS / "grpo_tiny_reward_curve.png")
        print(f"seed {seed}: held-out {run['heldout_before']['mean']:.3f} -> "
              f"{run['heldout_after']['mean']:.3f}, gain {run['gain']['mean']:+.3f} "
              f"[{run['gain']['low']:+.3f}, {run['gain']['high']:+.3f}] in "
              f"{run['process_wall_s']:.0f}s ({run['iterations']} iterations)", flush=True)
    if runs:
        gains = [r["gain"]["mean"] for r in runs.values()]
        print(write_result("grpo_tiny", {
            "engine": args.engine, "minutes_budget": args.minutes, "cpu_threads": 2,
            "gain_mean_over_seeds": sum(gains) / len(gains),
            "goal_met": all(r["gain"]["mean"] >= 0.15 and r["process_wall_s"] <= 600
                            for r in runs.values()),
            "runs": runs}))


if __name__ == "__main__":
    main()
