"""Warm pool against cold creation, for a per-trajectory tool whose creation takes 200 ms.

Run::

    python benchmarks/warm_pool.py            # about 30 s; writes results/warm_pool.json
    python benchmarks/warm_pool.py --quick    # fewer samples, prints only

A ``ResourceTool`` whose resource takes ``--create-ms`` (200) to create (an ``asyncio.sleep``:
simulated provisioning, as a sandbox or browser would take) serves samples that each make one
call through ``CallTools`` on a real ``Pipeline``. Samples arrive at a steady ``--rate`` per
second (each sample's first stage waits for its arrival time), so a pool of ``--pool`` is not
exhausted: it refills faster than samples take from it. Time-to-first-call is the ``call_tools``
stage's duration from its stage record (creation or pool acquisition, the call, the reply's
tokens). Three runs: ``cold`` (``create`` per sample), ``warm`` (a ``WarmPool`` of ``--pool``,
filled before the first arrival), and ``burst`` (the same pool, every sample at once: the
pool is exhausted and the rest create cold). The goal: warm p50 under 10 % of cold while the
pool is not exhausted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from _common import write_result

from pipeline import AgentMessage, Pipeline, ToolCall, ToolFunction, artifacts
from pipeline.stages import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import ResourceTool, WarmPool


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def arriving(interval_s: float) -> Any:
    async def assistant_turn(item: Any, ctx: Any) -> None:
        """Arrive at the row's time, then ask for one call (the model's turn, scripted)."""
        await asyncio.sleep(item.data.extra["index"] * interval_s)
        call = ToolCall(id="c0", function=ToolFunction(name="sandbox", arguments="{}"))
        item.artifacts[artifacts.PROMPT_IDS] = [1, 2, 3]
        item.artifacts[artifacts.MESSAGES] = [
            AgentMessage(role="user", content="run it"),
            AgentMessage(role="assistant", content="", tool_calls=[call], token_ids=[2])]
        item.artifacts[artifacts.RESPONSE_IDS] = [2]
        item.artifacts[artifacts.RESPONSE_MASK] = [1]
        item.artifacts[artifacts.LOGPROBS] = [-0.5]
    return assistant_turn


async def run(tool: ResourceTool, samples: int, interval_s: float) -> dict[str, Any]:
    rollout = Pipeline([arriving(interval_s), CallTools(offload=False)],
                       tokenizer=ByteTokenizer(), tools=[tool], max_concurrency=samples,
                       sample_timeout_s=120)
    rows = [{"prompt": f"s{i}", "extra": {"index": i}} for i in range(samples)]
    result = await rollout.run_batch(rows, n=1)
    assert result.stats.tool_errors == 0, result.stats
    ttfc = [next(r.end - r.start for r in item.records if r.name == "call_tools")
            for item in result.items]
    warm = sum(item.artifacts[artifacts.EXTRA_FIELDS]["tool_resources_warm"]
               for item in result.items)
    return {"samples": samples, "warm_samples": warm,
            "ttfc_p50_ms": round(percentile(ttfc, 0.5) * 1e3, 2),
            "ttfc_p99_ms": round(percentile(ttfc, 0.99) * 1e3, 2),
            "ttfc_mean_ms": round(statistics.mean(ttfc) * 1e3, 2)}


async def main(samples: int, rate: float, pool_size: int, create_ms: float) -> dict[str, Any]:
    create_s = create_ms / 1e3

    async def create(item: Any = None) -> dict[str, int]:
        await asyncio.sleep(create_s)  # simulated provisioning
        return {"calls": 0}

    async def destroy(resource: dict[str, int]) -> None:
        resource.clear()

    async def call(resource: dict[str, int]) -> str:
        resource["calls"] += 1
        return "ok"

    cold_tool = ResourceTool(name="sandbox", create=create, call=call, release=destroy)
    figures: dict[str, Any] = {"create_ms": create_ms, "arrival_rate_per_s": rate,
                               "pool_size": pool_size}
    figures["cold"] = await run(cold_tool, samples, 1 / rate)
    for name, interval in (("warm", 1 / rate), ("burst", 0.0)):
        async with WarmPool(create, size=pool_size, destroy=destroy) as pool:
            await asyncio.sleep(create_s * 2)  # filled before the first arrival
            tool = ResourceTool(name="sandbox", call=call, pool=pool)
            figures[name] = await run(tool, samples, interval)
            figures[name]["pool"] = pool.stats().as_dict()
    figures["warm_p50_over_cold_p50"] = round(
        figures["warm"]["ttfc_p50_ms"] / figures["cold"]["ttfc_p50_ms"], 4)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per second")
    parser.add_argument("--pool", type=int, default=16)
    parser.add_argument("--create-ms", type=float, default=200.0)
    args = parser.parse_args()
    samples = args.samples or (40 if args.quick else 200)
    figures = asyncio.run(main(samples, args.rate, args.pool, args.create_ms))
    print(json.dumps(figures, indent=1))
    if not args.quick:
        print("wrote", write_result("warm_pool", figures))
