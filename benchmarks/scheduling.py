"""A big batch on a fast engine under a tight per-sample deadline: does a sample's own
latency stay its own, or does it grow with the batch?

Run::

    python benchmarks/scheduling.py                       # 5k / 20k / 50k samples, 1 s deadline
    python benchmarks/scheduling.py --sizes 20000 --quick # print only

The workload is ``flat_cost.py``'s ``single`` (``BuildPrompt`` + ``Generate`` + a judge
function on the simulated engine with a 50 ms latency, every sample allowed in flight at
once) with ``sample_timeout_s`` = 1 s. Each sample needs about 0.1 ms of CPU and 50 ms of
engine time, so none should time out however big the batch; the batch itself takes seconds.
Per size: the statuses, the wall time, when the first sample finished, the samples' latency
(stages begun to ended; median, 99th percentile) and the most samples in flight at once.
Before issue 43's seventh round the loop slice let parked samples go in the order they
parked, so a batch's new samples queued ahead of those whose engine call had returned.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from _common import write_result
from flat_cost import Timeline, library_commit, single_pipeline, single_rows

DEADLINE_S = 1.0


async def one_batch(size: int) -> dict[str, Any]:
    pipe, rows = single_pipeline(size, timeout_s=DEADLINE_S), single_rows(size)
    timeline = Timeline()
    began, wall0 = time.monotonic(), time.perf_counter()
    result = await pipe.run_batch(rows)
    wall = time.perf_counter() - wall0
    for item in result.items:
        timeline.add(item)
    return {"samples": size, "by_status": result.stats.by_status, "wall_s": round(wall, 2),
            **timeline.figures(began)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[5000, 20_000, 50_000])
    parser.add_argument("--quick", action="store_true", help="print only, write nothing")
    parser.add_argument("--name", default="scheduling", help="results file name")
    args = parser.parse_args()
    runs = []
    for size in args.sizes:
        runs.append(asyncio.run(one_batch(size)))
        print(runs[-1], flush=True)
    if not args.quick:
        figures = {"engine": "simulated (no model)", "latency_s": 0.05,
                   "sample_timeout_s": DEADLINE_S, "library_commit": library_commit(),
                   "runs": runs}
        print(f"written to {write_result(args.name, figures)}")


if __name__ == "__main__":
    main()
