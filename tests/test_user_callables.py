"""Every user callable the library takes follows one rule (issue 33, item 5).

Callables the pipeline calls from its own async code (``DynamicSampling.keep``,
``on_sample_done``, ``Loop(until=...)``) may be plain or ``async def``: an async one is awaited.
Callables with a synchronous contract (reward functions, score parsers, judger factories) refuse
an ``async def`` at construction, naming the field; callables with an async contract (tool
functions, ``judge`` methods, tool objects) refuse a plain one. A plain callable that returns an
awaitable at run time fails its sample or group with a clear error, and the awaitable is closed
(no "never awaited" warning). "async" here includes ``functools.partial`` of an ``async def``
and objects whose ``__call__`` is ``async def``.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline import (
    AgentMessage,
    AgentRolloutItem,
    ConfigError,
    Context,
    ContractError,
    DynamicSampling,
    Loop,
    Pipeline,
    Status,
    artifacts,
)
from pipeline.judgers import FunctionJudger, JudgerRegistry, JudgerRegistryError, LLMJudger
from pipeline.stages._judge import Judge
from pipeline.testing import ByteTokenizer, SimulatedEngine, capture_logs
from pipeline.tools import FunctionTool, make_registry


@pytest.fixture(autouse=True)
def no_unawaited_coroutines() -> Iterator[None]:
    """Fail a test that leaves a coroutine never awaited (the library must close them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
    leaked = [w for w in caught if "never awaited" in str(w.message)]
    assert leaked == [], [str(w.message) for w in leaked]


async def reward_stage(item: AgentRolloutItem, ctx: Context) -> None:
    """Rewards ``extra.rewards[sample_index]`` (1.0 by default)."""
    rewards = item.data.extra.get("rewards")
    item.artifacts[artifacts.REWARD] = 1.0 if rewards is None else float(
        rewards[item.sample_index])


def make(*stages: Any) -> Pipeline:
    return Pipeline(list(stages) or [reward_stage], tokenizer=ByteTokenizer())


def mixed(i: int) -> dict[str, Any]:
    return {"prompt": f"q{i}", "extra": {"rewards": [0.0, 1.0]}}


# ---- callables awaited when async: keep, on_sample_done, Loop's until ------------------------

async def reject_all(samples: Any) -> bool:
    await asyncio.sleep(0)
    return False


class AsyncRejecter:
    async def __call__(self, samples: Any) -> bool:
        return False


async def reject_with(flag: bool, samples: Any) -> bool:
    return flag


@pytest.mark.parametrize("keep", [reject_all, AsyncRejecter(), functools.partial(reject_with,
                                                                                  False)],
                         ids=["async-def", "async-call", "partial"])
async def test_item5_async_keep_is_awaited(keep: Any) -> None:
    stream = make().stream_groups([mixed(i) for i in range(6)], n=2,
                                  dynamic=DynamicSampling(target_groups=2, max_rounds=2,
                                                          keep=keep))
    async with stream as groups:
        kept = [g async for g in groups]
    assert kept == []  # a coroutine is truthy: unawaited, every group would have been kept
    assert len(stream.report.set_aside) == stream.report.groups_started == 6


async def test_item5_sync_keep_returning_an_awaitable_fails_the_group() -> None:
    stream = make().stream_groups([mixed(i) for i in range(2)], n=2,
                                  dynamic=DynamicSampling(target_groups=2,
                                                          keep=lambda s: reject_all(s)))
    with pytest.raises(ContractError, match="keep") as info:
        async with stream as groups:
            [g async for g in groups]
    assert "awaitable" in str(info.value) and "async def" in str(info.value)
    report = stream.report
    assert len(report.failed) == 1 and report.stopped_by == "error"
    assert report.groups_yielded == 0


async def test_item5_keep_must_be_a_plain_predicate_not_a_generator() -> None:
    async def agen(samples: Any) -> Any:
        yield True

    def gen(samples: Any) -> Any:
        yield True

    for keep in (agen, gen, 3):
        with pytest.raises(ConfigError, match="keep") as info:
            DynamicSampling(target_groups=1, keep=keep)
        assert info.value.field == "keep"


class AsyncRecorder:
    async def __call__(self, item: AgentRolloutItem, sample: Any) -> None:
        await asyncio.sleep(0)


async def async_on_done(item: AgentRolloutItem, sample: Any) -> None:
    await asyncio.sleep(0)


async def tagged_on_done(tag: str, item: AgentRolloutItem, sample: Any) -> None:
    await asyncio.sleep(0)


@pytest.mark.parametrize("on_done", [async_on_done, AsyncRecorder(),
                                     functools.partial(tagged_on_done, "g")],
                         ids=["async-def", "async-call", "partial"])
async def test_item5_async_on_sample_done_is_refused_before_any_work(on_done: Any) -> None:
    """on_sample_done is called synchronously by the runner: an async one would never run
    (it used to be called and its coroutine dropped), so it is refused up front."""
    started: list[str] = []

    async def stage(item: AgentRolloutItem, ctx: Context) -> None:
        started.append(item.uid)

    pipe = make(stage)
    rows = [mixed(0)]
    for call in (lambda: pipe.stream(rows, n=2, on_sample_done=on_done),
                 lambda: pipe.stream_groups(rows, n=2, on_sample_done=on_done)):
        with pytest.raises(ConfigError, match="on_sample_done") as info:
            call()
        assert info.value.field == "on_sample_done" and "async" in str(info.value)
    with pytest.raises(ConfigError, match="on_sample_done"):
        await pipe.run_batch(rows, n=2, on_sample_done=on_done)
    assert started == []


async def test_item5_on_sample_done_returning_an_awaitable_is_reported_not_run() -> None:
    ran: list[str] = []

    async def record(item: AgentRolloutItem) -> None:
        ran.append(item.uid)

    with capture_logs() as logs:
        result = await make().run_batch([mixed(0)], n=2,
                                        on_sample_done=lambda item, sample: record(item))
    assert ran == []  # not awaited behind the caller's back: the callback is declared sync
    assert all(s.status is Status.COMPLETED for s in result.samples)  # a callback never costs
    failures = [e for e in logs if e["event"] == "on_sample_done_failed"]
    assert len(failures) == 2 and "awaitable" in failures[0]["error"]


@pytest.mark.parametrize("bad", [3, "print"])
async def test_item5_on_sample_done_must_be_callable(bad: Any) -> None:
    with pytest.raises(ConfigError, match="on_sample_done"):
        make().stream([mixed(0)], on_sample_done=bad)


async def count_turn(item: AgentRolloutItem, ctx: Context) -> None:
    item.artifacts["turns_run"] = item.artifacts.get("turns_run", 0) + 1


async def test_item5_async_loop_until_is_awaited() -> None:
    async def never(item: AgentRolloutItem) -> bool:
        await asyncio.sleep(0)
        return False

    class AfterTwo:
        async def __call__(self, item: AgentRolloutItem) -> bool:
            return bool(item.artifacts["turns_run"] >= 2)

    pipe = make(Loop([count_turn], max_turns=3, until=never))
    result = await pipe.run_batch([mixed(0)], n=1)
    item = result.items[0]
    assert item.artifacts["turns_run"] == 3  # an unawaited coroutine would end turn 1 as "done"
    assert item.artifacts[artifacts.EXIT_REASON] == "max_turns"
    result = await make(Loop([count_turn], max_turns=5, until=AfterTwo())).run_batch([mixed(0)])
    assert result.items[0].artifacts["turns_run"] == 2
    assert result.items[0].artifacts[artifacts.EXIT_REASON] == "done"


async def test_item5_sync_loop_until_returning_an_awaitable_fails_the_sample() -> None:
    async def never(item: AgentRolloutItem) -> bool:
        return False

    pipe = make(Loop([count_turn], max_turns=3, until=lambda item: never(item)))
    result = await pipe.run_batch([mixed(0)], n=1)
    sample, item = result.samples[0], result.items[0]
    assert sample.status is Status.FAILED and sample.masked
    assert "until" in (item.error or "") and "awaitable" in (item.error or "")
    assert item.artifacts["turns_run"] == 1


def test_item5_loop_until_must_be_a_predicate() -> None:
    from pipeline import StageDefinitionError

    async def agen(item: AgentRolloutItem) -> Any:
        yield True

    for until in (3, agen):
        with pytest.raises(StageDefinitionError, match="until"):
            Loop([count_turn], max_turns=2, until=until)


# ---- sync-only callables refuse async ones at construction -----------------------------------

async def async_reward(data_source: str, solution: str, truth: Any, extra: dict) -> float:
    return 1.0


class AsyncReward:
    async def __call__(self, *args: Any) -> float:
        return 1.0


ASYNC_CALLABLES = [async_reward, AsyncReward(), functools.partial(async_reward, "src")]


@pytest.mark.parametrize("fn", ASYNC_CALLABLES, ids=["async-def", "async-call", "partial"])
def test_item5_function_judger_refuses_async_functions(fn: Any) -> None:
    with pytest.raises(ConfigError, match="fn") as info:
        FunctionJudger(fn, mode="inline")
    assert info.value.field == "fn" and "async" in str(info.value)


@pytest.mark.parametrize("fn", ASYNC_CALLABLES, ids=["async-def", "async-call", "partial"])
def test_item5_llm_judger_refuses_an_async_parser(fn: Any) -> None:
    tok = ByteTokenizer()
    with pytest.raises(ConfigError, match="parse") as info:
        LLMJudger(SimulatedEngine(eos_token_id=tok.eos_token_id), tok, parse=fn)
    assert info.value.field == "parse"


class Scorer:
    name = "scorer"

    async def judge(self, item: AgentRolloutItem) -> float:
        return 1.0


async def make_scorer() -> Scorer:
    return Scorer()


def test_item5_judger_registry_refuses_async_factories() -> None:
    registry = JudgerRegistry(entry_point_group=None)
    with pytest.raises(JudgerRegistryError, match="async"):
        registry.register("scorer", make_scorer)
    registry.register("lazy", lambda: make_scorer())  # plain, but returns a coroutine
    with pytest.raises(JudgerRegistryError, match="awaitable"):
        registry.create("lazy")


def judged(answer: str) -> AgentRolloutItem:
    from pipeline.testing import judge_item
    return judge_item(answer, ground_truth="x")


async def test_item5_sync_reward_function_returning_an_awaitable_fails_the_judger() -> None:
    def lazy(data_source: str, solution: str, truth: Any, extra: dict) -> Any:
        return async_reward(data_source, solution, truth, extra)

    judger = FunctionJudger(lazy, mode="inline")
    with pytest.raises(ContractError, match="awaitable"):
        await judger.judge(judged("x"))

    async def answer(item: AgentRolloutItem, ctx: Context) -> None:
        item.artifacts[artifacts.MESSAGES] = [AgentMessage(role="assistant", content="x")]

    result = await make(answer, Judge(judger)).run_batch([mixed(0)], n=1)
    assert result.samples[0].status is Status.FAILED and result.samples[0].masked
    assert "awaitable" in (result.items[0].error or "")


async def test_item5_llm_parser_returning_an_awaitable_fails_the_judger() -> None:
    from pipeline.judgers import JudgeError
    tok = ByteTokenizer()

    def respond(prompt_ids: list[int], rng: Any) -> list[int]:
        return [*tok.encode("Score: 8"), tok.eos_token_id]

    engine = SimulatedEngine(latency_s=0.001, latency_sigma=0.0, tail_prob=0.0,
                             eos_token_id=tok.eos_token_id, responder=respond)

    async def parse(reply: str) -> float:
        return 8.0

    judger = LLMJudger(engine, tok, parse=lambda reply: parse(reply))
    with pytest.raises((ContractError, JudgeError), match="awaitable"):
        await judger.judge(judged("x"))


# ---- async-only callables refuse plain ones, and accept every async form ---------------------

class AsyncAdd:
    async def __call__(self, a: int, b: int) -> int:
        return a + b


async def add(a: int, b: int) -> int:
    return a + b


@pytest.mark.parametrize("fn", [add, AsyncAdd(), functools.partial(add, b=1)],
                         ids=["async-def", "async-call", "partial"])
async def test_item5_function_tool_takes_every_async_callable(fn: Any) -> None:
    tool = FunctionTool(name="add", fn=fn)
    assert await tool({"a": 1, "b": 1}) == 2


def test_item5_function_tool_refuses_plain_and_generator_functions() -> None:
    async def agen(**kwargs: Any) -> Any:
        yield 1

    for fn in (lambda **kw: None, agen, 3):
        with pytest.raises(ConfigError, match="fn") as info:
            FunctionTool(name="t", fn=fn)
        assert info.value.field == "fn"


def test_item5_tool_objects_need_an_async_call() -> None:
    class SyncTool:
        name = "sync"
        description = ""
        timeout_s = 1.0

        def __init__(self) -> None:
            self.parameters = {"type": "object", "properties": {}}

        def __call__(self, arguments: Any) -> Any:
            return "done"

    with pytest.raises(ConfigError, match="async"):
        make_registry([SyncTool()])


def test_item5_judge_stage_refuses_a_sync_judge_method() -> None:
    class SyncScorer:
        name = "sync"

        def judge(self, item: AgentRolloutItem) -> float:
            return 1.0

    with pytest.raises(ConfigError, match="async def judge"):
        Judge(SyncScorer())
