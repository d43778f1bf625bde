"""What the sandbox's mount namespace and its cleanup cost.

Run:  python benchmarks/sandbox_isolation.py           (about a minute on 2 cores, as root)
      python benchmarks/sandbox_isolation.py --quick   (smaller counts, for a smoke run)

Writes benchmarks/results/sandbox_isolation.json. Sections:

- mounts: median latency of one passing ``code`` judge run with private /tmp, /var/tmp,
  /dev/shm, /run (a mount namespace and five tmpfs mounts per run) and without, the two
  interleaved run by run so machine load hits both alike.
- cleanup: time to remove what a hostile program leaves (a directory tree deeper than
  Python's recursion limit, many small files, unreadable directories) with the sandbox's
  ``remove_tree``; ``shutil.rmtree`` as the baseline where it manages at all (it raises
  RecursionError on the deep tree).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import write_result

from pipeline import AgentMessage, AgentRolloutItem, artifacts, parse_row
from pipeline.judgers import CodeJudger, Sandbox, SandboxLimits
from pipeline.judgers._sandbox import remove_tree

GOOD = "```python\ndef add(a, b):\n    return a + b\n```"


def item() -> AgentRolloutItem:
    row = parse_row({"prompt": "q", "ground_truth": ["assert add(1, 2) == 3"]})
    return AgentRolloutItem(uid="u-0", group_id="u", data=row, artifacts={
        artifacts.MESSAGES: [AgentMessage(role="assistant", content=GOOD)]})


async def bench_mounts(runs: int) -> dict[str, Any]:
    with_ns = Sandbox(SandboxLimits(wall_s=5.0), concurrency=1)
    without = Sandbox(SandboxLimits(wall_s=5.0), concurrency=1, private_mounts=False)
    judges = {"private_mounts": CodeJudger(timeout_s=5.0, sandbox=with_ns),
              "host_mounts": CodeJudger(timeout_s=5.0, sandbox=without)}
    times: dict[str, list[float]] = {name: [] for name in judges}
    try:
        facts = await with_ns.facts()
        for name, judge in judges.items():  # warm both (probe, page cache)
            assert (await judge.judge(item())).score == 1.0, name
        for _ in range(runs):
            for name, judge in judges.items():
                started = time.perf_counter()
                assert (await judge.judge(item())).score == 1.0
                times[name].append(time.perf_counter() - started)
    finally:
        await with_ns.aclose()
        await without.aclose()
    medians = {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}
    return {"runs_each": runs, "mounts_isolated": facts.mounts_isolated,
            "network_isolated": facts.network_isolated,
            "median_run_ms": medians,
            "mount_namespace_cost_ms": round(medians["private_mounts"]
                                             - medians["host_mounts"], 2)}


def deep_tree(root: Path, depth: int) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d" * 100, dir_fd=fd)
        child = os.open("d" * 100, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = child
    os.close(fd)


def many_files(root: Path, count: int) -> None:
    for i in range(count):
        (root / f"f{i}").touch()
    for i in range(count // 100):
        locked = root / f"locked{i}"
        (locked / "inner").mkdir(parents=True)
        os.chmod(locked, 0)


def time_removal(build: Callable[[Path], None], remove: Callable[[Path], Any]) -> Any:
    root = Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    build(root)
    started = time.perf_counter()
    try:
        remove(root)
    except RecursionError:
        remove_tree(root)  # clean up what it could not
        return "RecursionError"
    elapsed = time.perf_counter() - started
    assert not root.exists()
    return round(elapsed, 3)


def bench_cleanup(depth: int, files: int, repeats: int) -> dict[str, Any]:
    """Min and median of ``repeats`` removals each (the disk is shared: the min is the cost,
    the median shows the noise)."""
    def rmtree(root: Path) -> None:
        shutil.rmtree(root)

    def summary(build: Callable[[Path], None], remove: Callable[[Path], Any]) -> Any:
        results = [time_removal(build, remove) for _ in range(repeats)]
        if any(isinstance(r, str) for r in results):
            return sorted({r for r in results if isinstance(r, str)})
        return {"min_s": min(results), "median_s": round(statistics.median(results), 3)}

    return {
        "deep_tree_depth": depth, "files": files, "repeats": repeats,
        "remove_tree_deep": summary(lambda r: deep_tree(r, depth), remove_tree),
        "rmtree_deep": summary(lambda r: deep_tree(r, depth), rmtree),
        "remove_tree_files": summary(lambda r: many_files(r, files), remove_tree),
        "rmtree_files": summary(lambda r: many_files(r, files), rmtree),
    }


async def main(quick: bool) -> None:
    load_before = os.getloadavg()
    figures: dict[str, Any] = {"mounts": await bench_mounts(5 if quick else 30),
                               "cleanup": bench_cleanup(1100, 2000 if quick else 10000,
                                                        2 if quick else 5)}
    figures["load_average"] = {"before": load_before, "after": os.getloadavg()}
    path = write_result("sandbox_isolation", figures)
    for section, values in figures.items():
        print(section, values)
    print(f"written to {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    asyncio.run(main(parser.parse_args().quick))
