"""How long a newcomer waits for a refusal, and for a second set-up run.

Usage: ``python benchmarks/newcomer.py [--repeats 5]``

- ``rollout run arith --timeout -1`` (and a few other wrong options) in a fresh process: the
  wall time to the one-line refusal (exit 2), import of the package included; the goal is
  under a second, with no engine started.
- ``scripts/setup.sh`` run again on a set-up ``.venv``: the goal is seconds, not a minute
  (skipped with ``--no-setup``; it runs the real script on this checkout's ``.venv``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result

ROOT = Path(__file__).resolve().parent.parent
WRONG = {
    "timeout": ["run", "arith", "--timeout", "-1"],
    "n": ["run", "arith", "--n", "0"],
    "engine": ["run", "arith", "--engine", "sglang"],
    "base_url": ["run", "arith", "--engine", "openai"],
}


def timed(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Wall seconds, CPU seconds (user + system of the child) and the finished process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-setup", action="store_true")
    args = parser.parse_args()
    figures: dict[str, object] = {"load_avg_before": os.getloadavg()}
    for name, argv in WRONG.items():
        walls, cpus = [], []
        for _ in range(args.repeats):
            wall, cpu, proc = timed([sys.executable, "-m", "pipeline.cli", *argv])
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
            walls.append(wall)
            cpus.append(cpu)
        figures[f"refusal_{name}"] = {"wall_median_s": round(statistics.median(walls), 3),
                                      "wall_max_s": round(max(walls), 3),
                                      "cpu_median_s": round(statistics.median(cpus), 3)}
        print(f"rollout {' '.join(argv)}: wall median {statistics.median(walls):.3f}s "
              f"(max {max(walls):.3f}s), CPU median {statistics.median(cpus):.3f}s "
              f"-> {proc.stderr.strip()}")
    wall, cpu, _ = timed([sys.executable, "-c", "import pipeline.cli"])
    figures["import_pipeline_cli"] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
    print(f"import pipeline.cli alone: wall {wall:.3f}s, CPU {cpu:.3f}s")
    if not args.no_setup:
        wall, cpu, proc = timed(["bash", "scripts/setup.sh"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        figures["setup_second_run"] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
        print(f"scripts/setup.sh again: wall {wall:.2f}s, CPU {cpu:.2f}s "
              f"({proc.stdout.count('up to date')} steps up to date)")
    figures["load_avg_after"] = os.getloadavg()
    print(f"wrote {write_result('newcomer', figures)}")


if __name__ == "__main__":
    main()
