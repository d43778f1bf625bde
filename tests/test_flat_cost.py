"""What a finished batch leaves for the collector (issue 43): no reference cycle of ours, and
trainer views that share the item's lists instead of copying them (one copy less per token
list, and four objects less per sample for the collector to walk)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from pipeline import (
    AgentMessage,
    AsyncRollout,
    BuildPrompt,
    DatasetRow,
    FinishReason,
    Generate,
    Pipeline,
    RowError,
    SamplingParams,
    SimulatedEngine,
    Status,
    artifacts,
)
from pipeline._data.messages import assistant_message, prompt_message, tool_call, tool_message
from pipeline._data.models import ToolCall, ToolFunction
from pipeline._data.rows import parse_row
from pipeline.testing import ByteTokenizer


@pytest.fixture
def saved_garbage() -> Iterator[list[object]]:
    """``gc.garbage`` filled with what the collector finds unreachable (``DEBUG_SAVEALL``);
    the debug flag is put back as it was."""
    previous = gc.get_debug()
    gc.collect()
    gc.set_debug(previous | gc.DEBUG_SAVEALL)
    gc.garbage.clear()
    try:
        yield gc.garbage
    finally:
        gc.set_debug(previous)
        gc.garbage.clear()


def ours(garbage: list[object]) -> list[str]:
    return sorted({type(o).__qualname__ for o in garbage
                   if type(o).__module__.startswith("pipeline")})


def two_stage_pipeline(**options: object) -> Pipeline:
    tok = ByteTokenizer()
    return Pipeline([BuildPrompt(), Generate()], tokenizer=tok,
                    engine=SimulatedEngine(latency_s=0.001, latency_sigma=0.0, tail_prob=0.0),
                    sampling={"max_tokens": 8}, **options)


def test_a_finished_batch_leaves_no_reference_cycle_of_ours(saved_garbage: list[object]):
    async def fails(item, ctx) -> None:
        raise ValueError("a stage's bug")

    async def main() -> None:
        pipe = two_stage_pipeline(max_concurrency=64)
        result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(300)], n=2)
        assert result.stats.by_status == {"completed": 600}
        failing = Pipeline([fails], tokenizer=ByteTokenizer())
        failed = await failing.run_batch([{"prompt": "q"}] * 3)
        assert failed.stats.by_status == {"failed": 3}

    asyncio.run(main())
    gc.collect()
    # The runner's own objects (runs, producers, contexts, items) are freed by reference
    # counting alone; the collector never has to find them.
    assert ours(saved_garbage) == []


def test_a_finished_stream_leaves_no_reference_cycle_of_ours(saved_garbage: list[object]):
    async def main() -> None:
        pipe = two_stage_pipeline()
        async with pipe.stream([{"prompt": f"q{i}"} for i in range(50)]) as samples:
            seen = [sample async for sample, _ in samples]
        assert len(seen) == 50

    asyncio.run(main())
    gc.collect()
    assert ours(saved_garbage) == []


async def test_a_sample_shares_the_finished_items_token_lists():
    pipe = two_stage_pipeline()
    result = await pipe.run_batch([{"prompt": "q"}])
    (sample,), (item,) = result.samples, result.items
    assert sample.status is Status.COMPLETED
    assert sample.prompt_ids is item.artifacts[artifacts.PROMPT_IDS]
    assert sample.response_ids is item.artifacts[artifacts.RESPONSE_IDS]
    assert sample.logprobs is item.artifacts[artifacts.LOGPROBS]
    assert sample.model_fields_set == set(type(sample).model_fields)


async def test_values_a_validation_would_convert_still_go_through_it():
    async def odd_values(item, ctx) -> None:
        art = item.artifacts
        art[artifacts.PROMPT_IDS] = [1, True]  # a bool among the ids
        art[artifacts.RESPONSE_IDS] = [5, 6]
        art[artifacts.RESPONSE_MASK] = [1, 1]
        art[artifacts.LOGPROBS] = [0, -0.5]  # an int among the logprobs

    pipe = Pipeline([odd_values], tokenizer=ByteTokenizer())
    result = await pipe.run_batch([{"prompt": "q"}])
    (sample,), (item,) = result.samples, result.items
    assert sample.status is Status.COMPLETED
    assert sample.prompt_ids == [1, 1] and type(sample.prompt_ids[1]) is int
    assert sample.logprobs == [0.0, -0.5] and type(sample.logprobs[0]) is float
    assert sample.prompt_ids is not item.artifacts[artifacts.PROMPT_IDS]


async def test_ids_that_are_not_ints_still_fail_the_sample_build():
    async def bad_ids(item, ctx) -> None:
        item.artifacts[artifacts.RESPONSE_IDS] = ["x"]
        item.artifacts[artifacts.RESPONSE_MASK] = [1]

    pipe = Pipeline([bad_ids], tokenizer=ByteTokenizer())
    sample = await pipe.run({"prompt": "q"})
    assert sample.masked and sample.status is Status.FAILED
    assert "building the sample failed" in (sample.error or "")


async def test_an_abandoned_sample_keeps_copies_its_stage_cannot_change():
    release = asyncio.Event()

    async def deaf(item, ctx) -> None:
        item.artifacts[artifacts.RESPONSE_IDS] = ids = [7]
        item.artifacts[artifacts.RESPONSE_MASK] = mask = [1]
        while not release.is_set():  # swallows the deadline's and every later cancel
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue
        ids.append(8)  # the stage goes on writing after its sample was handed over
        mask.append(1)

    pipe = Pipeline([deaf], tokenizer=ByteTokenizer(), sample_timeout_s=0.05,
                    cleanup_timeout_s=0.05)
    result = await asyncio.wait_for(pipe.run_batch([{"prompt": "q"}]), 10)
    (sample,), (item,) = result.samples, result.items
    assert sample.status is Status.TIMEOUT and "abandoned" in (sample.error or "")
    release.set()
    for _ in range(100):
        if item.artifacts[artifacts.RESPONSE_IDS] == [7, 8]:
            break
        await asyncio.sleep(0.01)
    assert item.artifacts[artifacts.RESPONSE_IDS] == [7, 8]
    assert sample.response_ids == [7] and sample.response_mask == [0]


# Messages and rows built without validation must be what validation builds.

@pytest.mark.parametrize("raw", [
    {"role": "user", "content": "hi"},
    {"role": "system", "content": None},
    {"role": "tool", "content": "4", "tool_call_id": "call_0", "name": "calc"},
])
def test_a_plain_prompt_message_is_what_validation_makes(raw: dict[str, object]):
    built, validated = prompt_message(raw), AgentMessage.model_validate(raw)
    assert built == validated and built.model_dump() == validated.model_dump()
    built.extra_note = "x"  # an extra field: in this message's own field set only
    assert "extra_note" in built.model_fields_set and built.model_dump()["extra_note"] == "x"
    again = prompt_message(raw)
    assert "extra_note" not in again.model_fields_set
    assert again.model_dump() == validated.model_dump()


@pytest.mark.parametrize("raw", [
    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "user", "content": "hi", "reasoning_content": "r"},
])
def test_other_prompt_messages_are_validated(raw: dict[str, object]):
    built = prompt_message(raw)
    assert built == AgentMessage.model_validate(raw)
    assert built.model_fields_set == set(raw)  # validation's own field set


def test_an_assistant_message_keeps_plain_lists_and_validates_others():
    ids, logprobs = [5, 6], [-0.5, -0.25]
    built = assistant_message("hi", ids, logprobs, FinishReason.STOP,
                              extra={"reasoning_content": "r"})
    assert built.token_ids is ids and built.logprobs is logprobs
    assert built == AgentMessage(role="assistant", content="hi", token_ids=ids,
                                 logprobs=logprobs, finish_reason=FinishReason.STOP,
                                 reasoning_content="r")
    odd = assistant_message("hi", [5, True], [0, -0.5], FinishReason.STOP)
    assert odd.token_ids == [5, 1] and type(odd.token_ids[1]) is int
    assert odd.logprobs == [0.0, -0.5] and type(odd.logprobs[0]) is float


def test_a_plain_row_is_what_validation_makes_and_keeps_the_callers_messages():
    raw = {"messages": [{"role": "user", "content": "q"}], "ground_truth": "4",
           "data_source": "math", "sampling": {"temperature": 0.5}, "tools": None}
    row = parse_row(raw, 0)
    assert row == DatasetRow.model_validate({**raw, "extra": {}})
    assert row.messages is raw["messages"]  # not copied: the caller's list and dicts
    # Template options still go through their validator.
    with pytest.raises(RowError, match="chat_template_kwargs"):
        parse_row({"prompt": "q", "chat_template_kwargs": {"tools": []}}, 0)


async def test_a_groups_samples_share_prompt_ids_and_prompt_messages():
    pipe = two_stage_pipeline()
    result = await pipe.run_batch([{"prompt": "q0"}, {"prompt": "q1"}], n=3)
    assert result.stats.by_status == {"completed": 6}
    first, second = result.items[:3], result.items[3:]
    for group in (first, second):
        ids = {id(item.artifacts[artifacts.PROMPT_IDS]) for item in group}
        assert len(ids) == 1  # one list for the group
        lists = [item.artifacts[artifacts.MESSAGES] for item in group]
        assert len({id(messages) for messages in lists}) == 3  # a list of its own each
        assert all(messages[0] is lists[0][0] for messages in lists)  # the same prompt message
        assert all(len(messages) == 2 and messages[1].role == "assistant"
                   for messages in lists)  # each with its own assistant turn only
    assert first[0].artifacts[artifacts.PROMPT_IDS] != second[0].artifacts[artifacts.PROMPT_IDS]
    assert first[0].artifacts[artifacts.MESSAGES][0].content == "q0"
    assert second[0].artifacts[artifacts.MESSAGES][0].content == "q1"


# A tool loop's calls and replies (issue 43: 9 of 70 tracked objects per 3-call sample were
# their own field sets).

_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>'


def _three_calls_then_answer(tok: ByteTokenizer):
    def reply(prompt_ids: list[int], rng: object) -> list[int]:
        calls = tok.decode(prompt_ids).count("<tool_call>")
        text = _CALL if calls < 3 else "Answer: 3"
        return [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]
    return reply


def tool_loop_pipeline() -> Pipeline:
    """BuildPrompt, then Generate and CallTools in a loop: three calculator calls, an answer."""
    from pipeline import Loop
    from pipeline.stages import CallTools
    from pipeline.tools import calculator_tool

    tok = ByteTokenizer()
    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0,
                             responder=_three_calls_then_answer(tok))
    return Pipeline([BuildPrompt(), Loop([Generate(), CallTools()], max_turns=5)],
                    engine=engine, tokenizer=tok, tools=[calculator_tool()],
                    sampling={"max_tokens": 256})


async def test_a_tool_loops_calls_and_replies_keep_no_field_set_of_their_own():
    pipe = tool_loop_pipeline()
    schema = {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
    result = await pipe.run_batch([{"prompt": f"q{i}", "tools": [schema]} for i in range(10)])
    assert result.stats.by_status == {"completed": 10}
    calls = [call for item in result.items for m in item.artifacts[artifacts.MESSAGES]
             if m.tool_calls for call in m.tool_calls]
    replies = [m for item in result.items for m in item.artifacts[artifacts.MESSAGES]
               if m.role == "tool"]
    assert len(calls) == len(replies) == 30
    assert {r.content for r in replies} == {"3"}
    # One field set per model class, shared by every call, function and reply of the batch.
    for models in (calls, [c.function for c in calls], replies):
        assert len({id(m.__pydantic_fields_set__) for m in models}) == 1
    # And they are what validation makes.
    assert calls[0] == ToolCall(id=calls[0].id, function=ToolFunction(
        name="calculator", arguments='{"expression": "1 + 2"}'))
    assert replies[0] == AgentMessage(role="tool", content="3", tool_call_id=calls[0].id,
                                      name="calculator")


def test_tool_call_and_tool_message_are_what_validation_makes():
    built = tool_call("call_0_0", "calc", '{"x": 1}')
    validated = ToolCall(id="call_0_0", function=ToolFunction(name="calc", arguments='{"x": 1}'))
    assert built == validated and built.model_dump() == validated.model_dump()
    assert built.model_fields_set == {"id", "type", "function"}
    reply = tool_message("4", "call_0_0", "calc")
    assert reply.model_dump() == AgentMessage(role="tool", content="4", tool_call_id="call_0_0",
                                              name="calc").model_dump()
    failed = tool_message("Error: boom", "call_0_0", "calc", "tool_exception")
    assert failed.model_extra == {"error": "tool_exception"}
    parts = [{"type": "text", "text": "4"}]
    assert tool_message(parts, "c", "calc").content == parts  # validated as before


# What a sample holds while it waits (issue 43, fourth round): the frames of its task, and
# no response lists before its first turn's engine call returned.

def await_chain(task: asyncio.Task[object]) -> list[str]:
    """The qualified names of the coroutines ``task`` is suspended in, outermost first."""
    names: list[str] = []
    coro: object = task.get_coro()
    while asyncio.iscoroutine(coro):
        names.append(coro.cr_code.co_qualname)  # type: ignore[attr-defined]
        coro = coro.cr_await  # type: ignore[attr-defined]
    return names


def sample_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("sample:")]


async def wait_for_requests(engine: SimulatedEngine, count: int) -> None:
    for _ in range(1000):  # bounded: the samples reach the engine within a few iterations
        if len(engine.in_flight) == count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{len(engine.in_flight)} requests reached the engine, not {count}")


async def test_a_sample_waiting_on_the_engine_holds_one_runner_frame_and_no_response_lists():
    pipe = Pipeline([BuildPrompt(), Generate()], tokenizer=ByteTokenizer(),
                    engine=SimulatedEngine(latency_s=60.0, latency_sigma=0.0, tail_prob=0.0),
                    sampling={"max_tokens": 8}, max_concurrency=2)
    batch = asyncio.ensure_future(pipe.run_batch([{"prompt": f"q{i}"} for i in range(4)]))
    engine = pipe.resources.engine
    assert isinstance(engine, SimulatedEngine)
    await wait_for_requests(engine, 2)
    chains = sorted(await_chain(task) for task in sample_tasks())
    # The runner's coroutine is the task's own (no producer frame above it) and awaits the
    # stage's own coroutine (no _execute or run_stage frame between).
    running = ["SampleRunner._run_sample", "Generate.run", "SimulatedEngine.generate"]
    # A sample queued for a concurrency slot waits on its future in FifoSlots.wait itself.
    queued = ["SampleRunner._run_sample", "FifoSlots.wait"]
    assert chains == [queued, queued, running, running]
    waiting = [ctx.item for ctx in pipe._inflight.values()]
    assert len(waiting) == 2
    for item in waiting:
        assert artifacts.PROMPT_IDS in item.artifacts
        assert artifacts.RESPONSE_IDS not in item.artifacts  # made once the engine answers
        assert artifacts.LOGPROBS not in item.artifacts
    engine.latency_s = 0.0  # the queued samples then complete at once
    for request_id in list(engine.in_flight):
        await engine.abort(request_id)  # the waiting two end aborted, with empty lists as before
    result = await asyncio.wait_for(batch, 30)
    assert result.stats.by_status == {"aborted": 2, "completed": 2}
    for item in waiting:
        assert item.status is Status.ABORTED
        assert item.artifacts[artifacts.RESPONSE_IDS] == []
        assert item.artifacts[artifacts.RESPONSE_MASK] == []
        assert item.artifacts[artifacts.LOGPROBS] == []


async def test_a_request_waiting_on_the_simulated_engine_holds_its_reply_untracked():
    # The simulated engine is the flat-cost benchmark's baseline: its reply, drawn before
    # the latency wait, waits as tuples of plain values (which the collector stops tracking
    # at its first pass), not as two lists per request in flight for every pass to walk.
    engine = SimulatedEngine(latency_s=60.0, latency_sigma=0.0, tail_prob=0.0)
    prompt = [1, 2, 3]
    request = asyncio.ensure_future(engine.generate(prompt, SamplingParams(max_tokens=8), "r"))
    await wait_for_requests(engine, 1)
    gc.collect()
    held = request.get_coro().cr_frame.f_locals  # type: ignore[attr-defined]
    assert [name for name, value in held.items() if gc.is_tracked(value)
            and type(value) in (list, tuple) and value is not prompt] == []
    assert len(held["drawn_ids"]) == len(held["drawn_logprobs"]) > 0
    drawn = list(held["drawn_ids"]), list(held["drawn_logprobs"])
    del held
    engine.in_flight["r"].set_result(False)  # the latency ends now: the reply is returned
    gen = await request
    assert type(gen.token_ids) is list and type(gen.logprobs) is list
    assert (gen.token_ids, gen.logprobs) == drawn
    assert gen.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_a_turn_that_ends_before_the_engine_still_leaves_empty_response_lists():
    pipe = Pipeline([BuildPrompt(), Generate()], tokenizer=ByteTokenizer(),
                    sampling={"max_tokens": 8})  # no engine: Generate raises before it
    sample = await pipe.run({"prompt": "q"})
    assert sample.status is Status.FAILED and "needs an engine" in (sample.error or "")
    (item,) = (await pipe.run_batch([{"prompt": "q"}])).items
    assert item.artifacts[artifacts.RESPONSE_IDS] == []
    assert item.artifacts[artifacts.RESPONSE_MASK] == []
    assert item.artifacts[artifacts.LOGPROBS] == []


async def test_a_single_turn_samples_message_holds_the_response_lists():
    pipe = two_stage_pipeline()
    result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(3)])
    assert result.stats.by_status == {"completed": 3}
    for item, sample in zip(result.items, result.samples, strict=True):
        (turn,) = [m for m in item.artifacts[artifacts.MESSAGES] if m.role == "assistant"]
        assert turn.token_ids is sample.response_ids  # one list, not two equal ones
        assert turn.logprobs is sample.logprobs
        assert turn.model_dump() == AgentMessage.model_validate(turn.model_dump()).model_dump()
        assert turn.token_ids and len(turn.token_ids) == len(turn.logprobs or ())


async def test_a_multi_turn_samples_messages_keep_their_own_lists():
    pipe = tool_loop_pipeline()
    (item,) = (await pipe.run_batch([{"prompt": "q"}])).items
    turns = [m for m in item.artifacts[artifacts.MESSAGES] if m.role == "assistant"]
    assert len(turns) == 4
    response = item.artifacts[artifacts.RESPONSE_IDS]
    assert all(turn.token_ids is not response for turn in turns)
    assert sum(len(turn.token_ids or ()) for turn in turns) < len(response)  # tool tokens too


async def test_a_stream_keeps_no_sample_its_consumer_dropped():
    # What a stream has yielded is its consumer's: a stream (or an AsyncRollout, which runs
    # one producer for its whole life) that kept every run would keep every sample and item
    # alive until it ends, for the collector to walk on each of its full passes.
    pipe = two_stage_pipeline(max_concurrency=4)
    taken: list[tuple[weakref.ref[object], weakref.ref[object]]] = []
    async with pipe.stream([{"prompt": f"q{i}"} for i in range(40)]) as samples:
        async for sample, item in samples:
            taken.append((weakref.ref(sample), weakref.ref(item)))
            del sample, item
            if len(taken) == 30:  # ten samples still to come: the stream is running
                # The stream's generator holds the one it yielded last until asked again.
                alive = [i for i, pair in enumerate(taken)
                         if any(ref() is not None for ref in pair)]
                assert alive == [29]
    assert samples.report.samples_yielded == 40
    assert samples.report.by_status == {"completed": 40}


async def test_a_group_stream_and_an_async_rollout_keep_no_group_they_handed_over():
    pipe = two_stage_pipeline(max_concurrency=4)
    taken: list[weakref.ref[object]] = []
    async with pipe.stream_groups([{"prompt": f"q{i}"} for i in range(12)], n=2) as groups:
        async for group in groups:
            taken.extend(weakref.ref(x) for x in (*group.samples, *group.items))
            del group
            if len(taken) == 16:  # the last group (4 objects) is held until asked again
                assert [i for i, ref in enumerate(taken) if ref() is not None] == [12, 13, 14, 15]
    engine = SimulatedEngine(latency_s=0.001, latency_sigma=0.0, tail_prob=0.0)
    pipe = Pipeline([BuildPrompt(), Generate()], tokenizer=ByteTokenizer(), engine=engine,
                    sampling={"max_tokens": 8})
    taken = []
    async with AsyncRollout(pipe, [{"prompt": f"q{i}"} for i in range(12)], n=2,
                            batch_groups=2, max_inflight=4) as rollout:
        for _ in range(4):
            batch = await rollout.next_batch()
            taken.extend(weakref.ref(x) for g in batch for x in (*g.samples, *g.items))
            del batch
            await rollout.update_weights()
        assert len(taken) == 32
        assert [i for i, ref in enumerate(taken) if ref() is not None] == []
