"""Overhead per tool call: MCP over stdio against an in-process tool, and our MCP wrapper
against the bare ``mcp`` client call.

Run::

    python benchmarks/mcp_overhead.py            # about 1 min; writes results/mcp_overhead.json
    python benchmarks/mcp_overhead.py --quick    # fewer rounds, prints only

One MCP server (``scenarios/order_server.py``, the official SDK's server) over stdio; its
``order_status`` tool does a dict lookup, so the figures are the transport and the wrappers.
At 256 concurrent callers, each making ``--calls`` calls one after another:

1. ``bare``: ``ClientSession.call_tool`` of the ``mcp`` SDK, on the same session and server
   process the wrapper uses (so the two differ by the wrapper alone).
2. ``wrapper``: ``MCPTool.__call__`` (``MCPServer.call``: the connection's liveness check, the
   SDK call, reading the result into text), on the server's own session.
3. Through the pipeline: a batch of 256 samples, each one assistant turn with one tool call
   run by ``CallTools`` (limiter keys, timeout, template tokens of the reply), once with the MCP
   tool and once with an in-process ``FunctionTool`` doing the same lookup.

Rounds of (1) and (2) alternate so machine load hits both alike; the medians over rounds are
reported: µs per call (wall time / calls, all callers concurrent) and calls/s. On a shared,
loaded machine the round-to-round spread of (1) alone is larger than 5 %, so the wrapper's own
cost is also timed apart (``wrapper_only``): ``MCPTool.__call__`` with the SDK session
replaced by one that returns a real, canned ``CallToolResult`` at once (simulated: no
transport), minus that canned call, best of 5 x 50,000 calls. The goal: the wrapper adds less
than 5 % to the bare call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from _common import write_result

from pipeline import AgentMessage, Pipeline, ToolCall, ToolFunction, artifacts
from pipeline.stages import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import FunctionTool, MCPServer
from scenarios.order_server import ORDERS

CONCURRENCY = 256
ARGS = {"order_id": "A-101"}


async def timed(callers: int, calls: int, call: Any) -> float:
    """Seconds for ``callers`` concurrent tasks each awaiting ``call()`` ``calls`` times."""
    async def one() -> None:
        for _ in range(calls):
            await call()

    started = time.perf_counter()
    tasks = [asyncio.create_task(one()) for _ in range(callers)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return time.perf_counter() - started


async def assistant_turn(item: Any, ctx: Any) -> None:
    """The model's turn, scripted: one call of ``order_status``."""
    call = ToolCall(id="c0", function=ToolFunction(name="order_status",
                                                   arguments=json.dumps(ARGS)))
    item.artifacts[artifacts.PROMPT_IDS] = [1, 2, 3]
    item.artifacts[artifacts.MESSAGES] = [
        AgentMessage(role="user", content="status?"),
        AgentMessage(role="assistant", content="", tool_calls=[call], token_ids=[2])]
    item.artifacts[artifacts.RESPONSE_IDS] = [2]
    item.artifacts[artifacts.RESPONSE_MASK] = [1]
    item.artifacts[artifacts.LOGPROBS] = [-0.5]


class _Answered:
    """The SDK session with its call replaced by a canned real result (simulated: no
    transport), so only our wrapper's own work is left to time."""

    def __init__(self, result: Any) -> None:
        self.result = result

    async def call_tool(self, name: str, arguments: Any, read_timeout_seconds: Any = None) -> Any:
        return self.result


async def wrapper_cost(server: MCPServer, session: Any, calls: int = 50_000) -> float:
    """Seconds per call our wrapper adds: ``MCPTool.__call__`` on a canned session, minus
    the canned session's own call, best of 5."""
    result = await session.call_tool("order_status", ARGS)
    canned = _Answered(result)
    connection = server._connection
    assert connection is not None
    real, connection.session = connection.session, canned
    (tool,) = server.tools
    try:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(calls):
                await tool(ARGS)
            wrapped = time.perf_counter() - started
            started = time.perf_counter()
            for _ in range(calls):
                await canned.call_tool("order_status", ARGS)
            best = min(best, (wrapped - (time.perf_counter() - started)) / calls)
        return best
    finally:
        connection.session = real


async def pipeline_seconds(tool: Any) -> float:
    rollout = Pipeline([assistant_turn, CallTools(offload=False)], tokenizer=ByteTokenizer(),
                       tools=[tool], max_concurrency=CONCURRENCY)
    rows = [{"prompt": f"q{i}"} for i in range(CONCURRENCY)]
    started = time.perf_counter()
    result = await rollout.run_batch(rows, n=1)
    elapsed = time.perf_counter() - started
    assert result.stats.tool_errors == 0, result.stats
    return elapsed


async def main(rounds: int, calls: int) -> dict[str, Any]:
    async with MCPServer("orders", command=sys.executable,
                         args=["-m", "scenarios.order_server"], call_timeout_s=60) as server:
        (tool,) = server.tools
        connection = server._connection
        assert connection is not None
        session = connection.session  # the SDK's ClientSession our wrapper calls through

        async def bare() -> None:
            await session.call_tool("order_status", ARGS, read_timeout_seconds=61)

        async def wrapped() -> None:
            await tool(ARGS)

        async def lookup(order_id: str) -> str:
            return ORDERS[order_id]

        local = FunctionTool(name="order_status", fn=lookup, parameters=tool.parameters)
        await timed(CONCURRENCY, 2, bare)  # warm both paths up
        await timed(CONCURRENCY, 2, wrapped)
        seconds: dict[str, list[float]] = {"bare": [], "wrapper": [], "pipeline_mcp": [],
                                           "pipeline_in_process": []}
        for i in range(rounds):
            order = [("bare", bare), ("wrapper", wrapped)]
            for name, call in order if i % 2 == 0 else reversed(order):
                seconds[name].append(await timed(CONCURRENCY, calls, call))
            seconds["pipeline_mcp"].append(await pipeline_seconds(tool))
            seconds["pipeline_in_process"].append(await pipeline_seconds(local))
        wrapper_only = await wrapper_cost(server, session)
    figures: dict[str, Any] = {"concurrency": CONCURRENCY, "calls_per_caller": calls,
                               "rounds": rounds}
    for name, values in seconds.items():
        total = CONCURRENCY * (calls if not name.startswith("pipeline") else 1)
        median = statistics.median(values)
        figures[name] = {"us_per_call": round(median / total * 1e6, 1),
                         "calls_per_s": round(total / median, 1),
                         "rounds_s": [round(v, 4) for v in values]}
    figures["wrapper_only_us_per_call"] = round(wrapper_only * 1e6, 2)
    bare_us, wrapper_us = figures["bare"]["us_per_call"], figures["wrapper"]["us_per_call"]
    figures["wrapper_only_pct_of_bare"] = round(wrapper_only * 1e6 / bare_us * 100, 3)
    figures["wrapper_overhead_pct"] = round((wrapper_us / bare_us - 1) * 100, 2)
    # paired per round (same load): wrapper / bare - 1
    figures["wrapper_overhead_pct_paired_median"] = round(statistics.median(
        w / b - 1 for w, b in zip(seconds["wrapper"], seconds["bare"], strict=True)) * 100, 2)
    figures["pipeline_mcp_minus_in_process_us"] = round(
        figures["pipeline_mcp"]["us_per_call"] - figures["pipeline_in_process"]["us_per_call"], 1)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    figures = asyncio.run(main(rounds, args.calls))
    print(json.dumps(figures, indent=1))
    if not args.quick:
        print("wrote", write_result("mcp_overhead", figures))
