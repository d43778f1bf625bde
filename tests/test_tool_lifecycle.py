"""Per-trajectory tool resources (create / call / release) and the warm pool, inside CallTools
on a real Pipeline: release once on every outcome, rewards to verl's tool_rewards, pool hits,
health checks and creation failures."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline import AgentMessage, Pipeline, ToolCall, ToolFunction, artifacts
from pipeline.batch import to_verl_outputs
from pipeline.stages import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import ResourceTool, ToolResult, WarmPool, make_registry

SCHEMA = {"type": "object", "properties": {"sql": {"type": "string"}}, "required": ["sql"]}


def ask(calls: int = 1):
    """A stand-in for the model's turn: an assistant message calling ``db`` ``calls`` times
    (a row's ``extra["calls"]`` overrides the number)."""

    async def assistant_turn(item, ctx):
        count = item.data.extra.get("calls", calls)
        tool_calls = [ToolCall(id=f"c{i}", function=ToolFunction(
            name="db", arguments=json.dumps({"sql": f"select {i}"}))) for i in range(count)]
        item.artifacts[artifacts.PROMPT_IDS] = [1, 2, 3]
        item.artifacts[artifacts.MESSAGES] = [
            AgentMessage(role="user", content="query"),
            AgentMessage(role="assistant", content="", tool_calls=tool_calls, token_ids=[2]),
        ]
        item.artifacts[artifacts.RESPONSE_IDS] = [2]
        item.artifacts[artifacts.RESPONSE_MASK] = [1]
        item.artifacts[artifacts.LOGPROBS] = [-0.5]

    return assistant_turn


class Ledger:
    """Resources made and released, so a test can check each is released exactly once."""

    def __init__(self, *, release_raises: bool = False) -> None:
        self.made: list[str] = []
        self.released: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self.release_raises = release_raises

    async def create(self, item) -> str:
        await asyncio.sleep(0.01)
        name = f"conn-{item.uid}-{len(self.made)}"
        self.made.append(name)
        return name

    async def call(self, conn: str, sql: str) -> ToolResult:
        self.calls.append((conn, sql))
        return ToolResult(f"rows for {sql}", reward=0.5)

    async def release(self, conn: str) -> None:
        self.released.append(conn)
        if self.release_raises:
            raise OSError("connection reset while closing")


def tool_of(ledger: Ledger, **kwargs) -> ResourceTool:
    return ResourceTool(name="db", parameters=SCHEMA, create=ledger.create, call=ledger.call,
                        release=ledger.release, **kwargs)


async def hang(item, ctx):
    await asyncio.sleep(3600)


async def boom(item, ctx):
    raise ValueError("judge exploded")


@pytest.mark.parametrize(("after", "status"), [
    (None, "completed"), (boom, "failed"), (hang, "timeout")])
async def test_one_resource_per_sample_released_once_on_every_outcome(after, status):
    ledger = Ledger()
    stages = [ask(calls=3), CallTools(offload=False)] + ([after] if after else [])
    rollout = Pipeline(stages, tokenizer=ByteTokenizer(), tools=[tool_of(ledger)],
                       sample_timeout_s=1.0)
    result = await rollout.run_batch([{"prompt": "a"}, {"prompt": "b"}], n=2)
    assert [s.status for s in result.samples] == [status] * 4
    # three calls of one turn share one resource; each of the 4 samples made exactly one
    assert len(ledger.made) == 4 and sorted(ledger.released) == sorted(ledger.made)
    assert {conn for conn, _ in ledger.calls} == set(ledger.made)
    for item in result.items:
        extra = item.artifacts[artifacts.EXTRA_FIELDS]
        assert extra["tool_rewards"] == [0.5, 0.5, 0.5]
        assert extra["tool_resources_warm"] == 0 and extra["tool_create_wait_s"] > 0
    totals = result.stats.tool_resources
    assert totals["samples"] == 4 and totals["warm"] == 0 and totals["create_wait_s"] > 0


async def test_release_that_raises_is_recorded_never_the_outcome():
    ledger = Ledger(release_raises=True)
    rollout = Pipeline([ask(), CallTools(offload=False)], tokenizer=ByteTokenizer(),
                       tools=[tool_of(ledger)])
    result = await rollout.run_batch([{"prompt": "a"}], n=3)
    assert [s.status for s in result.samples] == ["completed"] * 3
    assert sorted(ledger.released) == sorted(ledger.made) and len(ledger.made) == 3
    for item in result.items:
        failed = [r for r in item.records if r.phase == "cleanup" and r.status == "failed"]
        assert len(failed) == 1 and "connection reset while closing" in failed[0].error_message


async def test_tool_rewards_reach_verls_column():
    ledger = Ledger()
    rollout = Pipeline([ask(calls=2), CallTools(offload=False)], tokenizer=ByteTokenizer(),
                       tools=[tool_of(ledger)])
    rows = [{"prompt": "a"}, {"prompt": "b", "extra": {"calls": 0}}]  # b calls no tool
    result = await rollout.run_batch(rows, n=2)
    outputs = to_verl_outputs(result.samples, items=result.items, use_verl=False)
    # verl's workers always fill the column; a sample without tool rewards gets [], not None
    assert [o["extra_fields"]["tool_rewards"] for o in outputs] == [[0.5, 0.5]] * 2 + [[]] * 2


async def test_warm_pool_hands_out_ready_instances_and_checks_health():
    made: list[int] = []
    destroyed: list[int] = []
    sick = {0}  # the first instance the pool makes fails its health check

    async def create() -> int:
        made.append(len(made))
        return made[-1]

    async def destroy(n: int) -> None:
        destroyed.append(n)

    async def healthy(n: int) -> bool:
        return n not in sick

    async with WarmPool(create, size=2, destroy=destroy, healthy=healthy) as pool:
        await asyncio.sleep(0.05)
        assert pool.stats().idle == 2
        first, warm = await pool.acquire()
        assert (first, warm) == (1, True)  # 0 refused by the health check, destroyed
        assert pool.stats().unhealthy == 1 and 0 in destroyed
        await pool.release(first)
        assert first in destroyed  # a trajectory's instance is never handed out again
        await asyncio.sleep(0.05)
        assert pool.stats().idle == 2
        stats = pool.stats()
        assert (stats.hits, stats.misses, stats.create_failures) == (1, 0, 0)
    assert sorted(destroyed) == sorted(made)  # closing destroys the ready ones


async def test_pool_creation_failures_are_counted_and_the_model_sees_an_error():
    attempts = 0

    async def create() -> str:
        nonlocal attempts
        attempts += 1
        raise ConnectionError("sandbox service refused")

    async def call(box: str, sql: str) -> str:
        return "unreachable"

    async with WarmPool(create, size=1) as pool:
        tool = ResourceTool(name="db", parameters=SCHEMA, call=call, pool=pool)
        rollout = Pipeline([ask(), CallTools(offload=False)], tokenizer=ByteTokenizer(),
                           tools=make_registry([tool]))
        result = await rollout.run_batch([{"prompt": "a"}], n=2)
        assert [s.status for s in result.samples] == ["completed"] * 2
        for item in result.items:
            reply = item.artifacts[artifacts.MESSAGES][-1]
            assert reply.role == "tool" and "sandbox service refused" in reply.content
            assert item.artifacts[artifacts.EXTRA_FIELDS]["tool_create_failures"] == 1
        assert result.stats.tool_resources["create_failures"] == 2
        stats = pool.stats()
        assert stats.misses == 2 and stats.create_failures >= 3  # background + 2 cold


def test_resource_tool_config_errors_name_the_field():
    from pipeline import ConfigError

    async def call(r, **a):
        return None

    with pytest.raises(ConfigError) as exc:
        ResourceTool(name="db", call=call)
    assert exc.value.field == "create"
    with pytest.raises(ConfigError) as exc:
        WarmPool(call, size=0)
    assert exc.value.field == "size"
