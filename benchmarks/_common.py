"""Shared bits of the benchmarks: machine facts and writing results."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
    }


def write_result(name: str, figures: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` with the machine and the command."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "benchmark": name,
        "command": "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "figures": figures,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


class LagProbe:
    """How late a 5 ms sleep wakes up, sampled while it runs (``with LagProbe() as probe:``
    on the running loop; ``probe.figures()`` after)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append((time.perf_counter() - start - 0.005) * 1e3)

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def figures(self) -> dict[str, float]:
        lags = sorted(self.lags) or [0.0]
        return {"ticks": len(self.lags), "p50_ms": round(statistics.median(lags), 2),
                "p99_ms": round(lags[min(len(lags) - 1, int(len(lags) * 0.99))], 2),
                "max_ms": round(lags[-1], 2)}
