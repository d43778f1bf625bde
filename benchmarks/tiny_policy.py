"""How often the shipped tiny policy solves held-out arithmetic problems, per engine.

Runs the real pipeline (``BuildPrompt -> Loop([Generate, CallTools]) -> numeric reward``, the
main job's sampling: temperature 1, 96 tokens a turn, 512 a trajectory) on ``--count``
problems drawn with ``HELDOUT_SEED`` (disjoint from the training stream), one rollout each, on
each engine the factory builds as ``rollout run`` does. Prints and writes the solve rate, the
tool-call rate and the share of first calls whose expression is right, the training time
``training.json`` records, and seconds per training step measured here.

    python benchmarks/tiny_policy.py [--count 256] [--engines transformers,vllm] [--train-steps 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import write_result

from pipeline.models import tiny_policy_dir, tiny_policy_info
from scenarios.train_tiny_policy import (
    HELDOUT_SEED,
    Recipe,
    evaluate_dir,
    train,
    training_questions,
)


def time_training(steps: int) -> dict[str, object]:
    """Seconds per training step of the real recipe on this machine (2 threads)."""
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        info = train(Path(scratch) / "policy", Recipe(steps=steps), threads=2, log_every=10**9)
    per_step = (info["train_s"] - info["data_s"]) / steps
    return {"steps": steps, "threads": 2, "data_s": info["data_s"],
            "s_per_step": round(per_step, 3),
            "projected_full_run_s": round(per_step * Recipe().steps, 1),
            "load_average_before": load, "load_average_after": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--engines", default="transformers,vllm")
    parser.add_argument("--train-steps", type=int, default=50,
                        help="also time this many CPU training steps here (0: skip)")
    args = parser.parse_args()
    from scenarios import arith_tools

    info = tiny_policy_info()
    recipe = info["recipe"]
    seen = training_questions(recipe["steps"] * recipe["batch_size"], recipe["seed"])
    heldout = [r["messages"][1]["content"] for r in arith_tools.rows(args.count, HELDOUT_SEED)]
    figures: dict[str, object] = {
        "heldout_seed": HELDOUT_SEED, "problems": args.count,
        "heldout_also_in_training": sum(q in seen for q in heldout),
        "training": {k: info.get(k) for k in ("device", "threads", "trained_on", "train_s",
                                              "data_s", "parameters")},
        "load_average_before": os.getloadavg(),
    }
    if args.train_steps:
        figures["cpu_training_here"] = time_training(args.train_steps)
        print(json.dumps(figures["cpu_training_here"]))
    for name in args.engines.split(","):
        result = asyncio.run(evaluate_dir(tiny_policy_dir(), name, count=args.count))
        solved = result.pop("solved")
        unseen = [ok for ok, q in zip(solved, heldout, strict=True) if q not in seen]
        result["solve_rate_on_problems_not_in_training"] = sum(unseen) / len(unseen)
        print(json.dumps(result))
        figures[name] = result
    figures["load_average_after"] = os.getloadavg()
    print(write_result("tiny_policy", figures))


if __name__ == "__main__":
    main()
