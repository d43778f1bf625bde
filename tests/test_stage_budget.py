"""Per-stage budgets (``stage_timeout_s``) and the stuck gauge, with a real ``CallTools``
stage and a tool that hangs until cancelled."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pipeline import AgentMessage, ConfigError, Pipeline, ToolCall, ToolFunction, artifacts
from pipeline.diagnostics import capture_snapshot, render_text
from pipeline.observability import ProgressHeartbeat, batch_metrics
from pipeline.stages._tools import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import FunctionTool, make_registry

SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


async def ask_search(item, ctx):
    """A stand-in for the model's turn: one call of ``search`` with the row's prompt."""
    query = item.data.messages[-1]["content"]
    call = ToolCall(id="c0", function=ToolFunction(name="search",
                                                   arguments=json.dumps({"q": query})))
    item.artifacts[artifacts.PROMPT_IDS] = [1, 2, 3]
    item.artifacts[artifacts.MESSAGES] = [
        AgentMessage(role="user", content=query),
        AgentMessage(role="assistant", content="", tool_calls=[call], token_ids=[2]),
    ]
    item.artifacts[artifacts.RESPONSE_IDS] = [2]
    item.artifacts[artifacts.RESPONSE_MASK] = [1]
    item.artifacts[artifacts.LOGPROBS] = [-0.5]


def hanging_search(cancelled: list[str]) -> FunctionTool:
    async def search(q: str) -> str:
        if q.startswith("hang"):
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.append(q)
        return f"hits for {q}"

    # The tool's own timeout is far away: only the stage's budget can end the hang.
    return FunctionTool(name="search", fn=search, parameters=SCHEMA, timeout_s=60.0)


async def test_a_hanging_tool_ends_its_sample_on_the_stage_budget():
    cancelled: list[str] = []
    pipe = Pipeline([ask_search, CallTools(offload=False)], tokenizer=ByteTokenizer(),
                    tools=make_registry([hanging_search(cancelled)]),
                    stage_timeout_s={"call_tools": 0.3}, sample_timeout_s=30)
    started = time.monotonic()
    result = await pipe.run_batch([{"prompt": "hang 1"}, {"prompt": "fast"},
                                   {"prompt": "hang 2"}])
    assert time.monotonic() - started < 5
    hung = [it for it in result.items if it.data.messages[-1]["content"].startswith("hang")]
    fast = [it for it in result.items if it not in hung]
    assert [it.status.value for it in fast] == ["completed"]
    for item, sample in zip(result.items, result.samples, strict=True):
        if item in hung:
            assert sample.status.value == "timeout" and sample.finish_reason.value == "timeout"
            assert sample.masked
            assert item.error == "stage 'call_tools' ran past its budget stage_timeout_s=0.3s"
            assert item.error_stage == "call_tools"
            record = item.records[-1]
            assert (record.name, record.status.value, record.error_type) == (
                "call_tools", "timeout", "StageTimeout")
    assert sorted(cancelled) == ["hang 1", "hang 2"]  # the hang was cancelled, not left


async def test_the_sample_deadline_is_told_apart_from_a_stage_budget():
    cancelled: list[str] = []
    pipe = Pipeline([ask_search, CallTools(offload=False)], tokenizer=ByteTokenizer(),
                    tools=make_registry([hanging_search(cancelled)]),
                    stage_timeout_s={"call_tools": 20}, sample_timeout_s=0.3)
    result = await pipe.run_batch([{"prompt": "hang"}])
    assert result.items[0].status.value == "timeout"
    assert result.items[0].error.startswith("sample timed out after 0.3s in stage 'call_tools'")


async def test_a_stage_that_swallows_the_budget_still_runs_out_of_it():
    class Stubborn:
        name = "stubborn"
        stage_timeout_s = 0.1  # the stage's own budget, no config needed

        async def run(self, item, ctx):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                await asyncio.sleep(0.05)  # swallowed: returns as if nothing happened

    result = await Pipeline([Stubborn()], sample_timeout_s=30).run_batch([{"prompt": "x"}])
    item = result.items[0]
    assert item.status.value == "timeout"
    assert item.error.startswith("stage 'stubborn' ran past its budget stage_timeout_s=0.1s "
                                 "(it returned late")
    # The budget's cancellation was taken back: the task carries no pending cancel.
    assert result.stats.by_status == {"timeout": 1}


async def test_a_stage_within_budget_and_a_loop_of_them_complete():
    async def quick(item, ctx):
        await asyncio.sleep(0.01)

    pipe = Pipeline([quick, quick], stage_timeout_s={"quick": 1.0})
    result = await pipe.run_batch([{"prompt": "x"}], n=3)
    assert result.stats.by_status == {"completed": 3}


def test_a_budget_for_no_stage_is_refused_naming_the_field():
    async def quick(item, ctx):
        return None

    with pytest.raises(ConfigError) as err:
        Pipeline([quick], stage_timeout_s={"quik": 1.0})
    assert err.value.field == "stage_timeout_s.quik"
    assert "['quick']" in str(err.value)
    with pytest.raises(ConfigError) as err:
        Pipeline([quick], stage_timeout_s={"quick": -1})
    assert err.value.field == "stage_timeout_s.quick"


async def test_stuck_samples_are_counted_per_stage_in_the_progress_line():
    gate = asyncio.Event()

    async def slow(item, ctx):
        if item.data.messages[-1]["content"] == "stuck":
            await gate.wait()

    pipe = Pipeline([slow], stuck_stage_s=0.1, progress_log_s=None)
    beat = ProgressHeartbeat(pipe, interval_s=60)
    async with beat:
        batch = asyncio.ensure_future(pipe.run_batch([{"prompt": "stuck"}, {"prompt": "ok"},
                                                      {"prompt": "stuck"}]))
        await asyncio.sleep(0.3)
        fields = beat.fields()
        snapshot = capture_snapshot(reason="test")
        gate.set()
        result = await batch
    assert fields["stuck"] == {"slow": 2}
    ours = [s for s in snapshot.samples if s.stage == "slow"]
    assert sorted(s.stuck for s in ours) == [True, True]
    assert "stuck (longer than stuck_stage_s in one stage): slow=2" in render_text(snapshot)
    assert result.stats.by_status == {"completed": 3}
    assert beat.fields()["stuck"] == {}
    metrics = batch_metrics(result, stuck_stage_s=0.1)
    assert metrics["rollout/stuck/slow"] == 2.0
