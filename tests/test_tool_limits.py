"""Rate-limited and concurrency-limited tool calls inside CallTools (real limiter, real time)."""

from __future__ import annotations

import asyncio
import json
import time

from pipeline import AgentMessage, Pipeline, ToolCall, ToolFunction, artifacts
from pipeline.stages._tools import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import FunctionTool, make_registry

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


def ask_tools(calls_per_sample: int):
    """A stand-in for the model's turn: an assistant message that calls ``search``."""

    async def assistant_turn(item, ctx):
        calls = [ToolCall(id=f"c{i}", function=ToolFunction(name="search",
                                                            arguments=json.dumps({"q": str(i)})))
                 for i in range(calls_per_sample)]
        item.artifacts[artifacts.PROMPT_IDS] = [1, 2, 3]
        item.artifacts[artifacts.MESSAGES] = [
            AgentMessage(role="user", content="find things"),
            AgentMessage(role="assistant", content="", tool_calls=calls, token_ids=[2]),
        ]
        item.artifacts[artifacts.RESPONSE_IDS] = [2]
        item.artifacts[artifacts.RESPONSE_MASK] = [1]
        item.artifacts[artifacts.LOGPROBS] = [-0.5]

    return assistant_turn


def pipeline_with(tool: FunctionTool, calls_per_sample: int) -> Pipeline:
    return Pipeline([ask_tools(calls_per_sample), CallTools(offload=False)],
                    tokenizer=ByteTokenizer(), tools=make_registry([tool]))


async def test_tool_rate_is_respected_and_wait_is_recorded():
    stamps: list[float] = []

    async def search(q: str) -> str:
        stamps.append(time.monotonic())
        return f"hits for {q}"

    tool = FunctionTool(name="search", fn=search, parameters=SCHEMA, rate=20.0, burst=1)
    pipe = pipeline_with(tool, calls_per_sample=2)
    result = await pipe.run_batch([{"prompt": "a"}, {"prompt": "b"}], n=5)
    assert result.stats.by_status == {"completed": 10} and len(stamps) == 20
    # 20 calls through a 1-token burst at 20/s: the last call starts >= 19/20 s after the first.
    assert stamps[-1] - stamps[0] >= 0.9
    waits = [it.artifacts[artifacts.LIMITER_WAIT_S] for it in result.items]
    assert sum(w > 0.1 for w in waits) >= 8
    assert result.stats.limiter_wait_s >= sum(waits) - 1e-9 > 0
    bucket = pipe.resources.limiters.get("tool:search", 20.0, 1)
    stats = bucket.stats()
    assert stats.grants == 20 and stats.leaked == 0
    assert len(stats.keys) == 2  # fair across the two prompts' groups


async def test_tool_concurrency_cap_and_token_before_slot():
    running = peak = 0

    async def search(q: str) -> str:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1
        return "ok"

    tool = FunctionTool(name="search", fn=search, parameters=SCHEMA, max_concurrency=2)
    result = await pipeline_with(tool, calls_per_sample=3).run_batch([{"prompt": "a"}], n=4)
    assert result.stats.by_status == {"completed": 4}
    assert peak == 2
    assert all(m.content == "ok" for it in result.items
               for m in it.artifacts[artifacts.MESSAGES] if m.role == "tool")
