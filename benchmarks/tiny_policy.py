"""How often the shipped tiny policy solves held-out arithmetic problems, per engine.

Runs the real pipeline (``BuildPrompt -> Loop([Generate, CallTools]) -> numeric reward``, the
main job's sampling: temperature 1, 96 tokens a turn, 512 a trajectory) on ``--count``
problems drawn with ``HELDOUT_SEED`` (disjoint from the training stream), one rollout each, on
each engine the factory builds as ``rollout run`` does. Prints and writes the solve rate, the
tool-call rate and the share of first calls whose expression is right, plus the training time
``training.json`` records.

    python benchmarks/tiny_policy.py [--count 256] [--engines transformers,vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import write_result

from pipeline.models import tiny_policy_dir, tiny_policy_info
from scenarios.train_tiny_policy import HELDOUT_SEED, evaluate_dir, training_questions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--engines", default="transformers,vllm")
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
