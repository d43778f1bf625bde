"""The tiny GRPO loop (``scenarios/grpo_tiny.py``), synchronous vs asynchronous, same seeds.

Each run is the scenario in its own process with the same time budget (engine start and both
held-out evaluations included): the synchronous loop, then ``--async --max-staleness ETA``.
Printed and written to ``benchmarks/results/async_rl_grpo.json``: per run the iterations
done, iterations per training minute, held-out reward before and after (256 problems x 2
samples, 95% interval), the gain, and for the asynchronous runs the groups delivered and set
aside by version lag, and the finish reasons of the samples the trainer was handed.

    python benchmarks/async_rl_grpo.py --seeds 1 2 --minutes 10
    python benchmarks/async_rl_grpo.py --quick          # one seed, 4 minutes a run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from _common import write_result

ROOT = Path(__file__).resolve().parent.parent


def run(seed: int, minutes: float, engine: str, eta: int | None, out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "scenarios.grpo_tiny", "--engine", engine, "--seed",
               str(seed), "--minutes", str(minutes), "--out", str(out)]
    if eta is not None:
        command += ["--async", "--max-staleness", str(eta)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    history = summary["history"]
    train_s = summary["train_end_s"] - summary["engine_start_s"]
    return {
        "mode": "sync" if eta is None else f"async eta={eta}", "seed": seed,
        "engine": summary["engine"], "iterations": summary["iterations"],
        "iterations_per_min": round(60 * summary["iterations"] / max(train_s, 1e-9), 2),
        "heldout_before": summary["heldout_before"], "heldout_after": summary["heldout_after"],
        "gain": summary["gain"], "wall_s": summary["wall_s"],
        "train_reward_last5": round(sum(h["reward"] for h in history[-5:])
                                    / max(1, len(history[-5:])), 3),
        "finish_reasons_trained": dict(sum((Counter(h["finish_reasons"]) for h in history),
                                           Counter())),
        "async": summary.get("async"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--minutes", type=float, default=10.0, help="budget of each run")
    parser.add_argument("--engine", default="auto", choices=("auto", "vllm", "transformers"))
    parser.add_argument("--eta", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="seed 1 only, 4 minutes a run")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.minutes = [1], 4.0
    figures: dict[str, Any] = {"parameters": vars(args), "loadavg_before": os.getloadavg(),
                               "runs": []}
    with tempfile.TemporaryDirectory(prefix="async-rl-grpo-") as scratch:
        for seed in args.seeds:
            for eta in (None, args.eta):
                row = run(seed, args.minutes, args.engine, eta,
                          Path(scratch) / f"{seed}-{eta}")
                print(row, flush=True)
                figures["runs"].append(row)
    figures["loadavg_after"] = os.getloadavg()
    print(write_result("async_rl_grpo", figures))


if __name__ == "__main__":
    main()
