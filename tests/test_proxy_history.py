"""Token-exact session history: merges, splits and their reasons, echo normalisation, stop
strings, length turns and budgets. Turns run through the proxy's real turn runner on the
simulated engine with the byte-level tokenizer (its ChatML template renders content only)."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import pytest

from pipeline import FinishReason, SamplingParams
from pipeline.proxy import ProxyError, ProxyRequestError, SessionStore
from pipeline.proxy._errors import FinalError
from pipeline.proxy._policy import CHAT_FIELDS, check_fields
from pipeline.proxy._turns import TurnOutcome, TurnRunner
from pipeline.proxy._wire import parse_request
from pipeline.testing import ByteTokenizer, SimulatedEngine
from pipeline.tools import HermesToolParser

TOK = ByteTokenizer()
EOS = TOK.eos_token_id
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


class Script:
    """Simulated-engine responder: the next queued text (plus eos unless ``open=True``)."""

    def __init__(self) -> None:
        self.queue: deque[tuple[str, bool]] = deque()
        self.prompts: list[list[int]] = []

    def push(self, text: str, *, open: bool = False) -> None:
        self.queue.append((text, open))

    def __call__(self, prompt_ids: list[int], rng: Any) -> list[int]:
        self.prompts.append(list(prompt_ids))
        text, open_ended = self.queue.popleft() if self.queue else ("ok", False)
        return TOK.encode(text) + ([] if open_ended else [EOS])


def setup(**sampling: Any) -> tuple[TurnRunner, Any, Script, SimulatedEngine]:
    script = Script()
    engine = SimulatedEngine(latency_s=0, latency_sigma=0, tail_prob=0, responder=script,
                             eos_token_id=EOS)
    runner = TurnRunner(engine, TOK, HermesToolParser(), max_tokens=None, max_turns=50,
                        offload_chars=10_000, abort_timeout_s=5.0)
    store = SessionStore(TOK, max_sessions=10, idle_timeout_s=60)
    session = store.create(sampling=SamplingParams(**{"max_tokens": 100, **sampling}))
    return runner, session, script, engine


async def ask(runner: TurnRunner, session: Any, messages: list[dict[str, Any]],
              **body: Any) -> TurnOutcome:
    return await runner.run(session, parse_request({"model": "m", "messages": messages, **body}))


def reply_dict(outcome: TurnOutcome) -> dict[str, Any]:
    body: dict[str, Any] = {"role": "assistant", "content": outcome.reply.content}
    if outcome.reply.tool_calls:
        body["tool_calls"] = [c.model_dump() for c in outcome.reply.tool_calls]
    return body


BASE = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 1 and 2"}]


async def conversation(runner: TurnRunner, session: Any,
                       script: Script) -> tuple[list[dict[str, Any]], list[TurnOutcome]]:
    """Two rounds of tool calls and a final answer; returns the messages and the outcomes."""
    messages, outcomes = list(BASE), []
    for text in (CALL, CALL, "the answer is 6"):
        script.push(text)
        outcome = await ask(runner, session, messages, tools=TOOLS)
        outcomes.append(outcome)
        messages.append(reply_dict(outcome))
        if outcome.reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": outcome.reply.tool_calls[0].id,
                             "content": str(3 * len(outcomes))})
    return messages, outcomes


async def test_turns_merge_into_one_sequence_with_template_tokens_masked():
    runner, session, script, _ = setup()
    _messages, outcomes = await conversation(runner, session, script)
    assert [o.finish_reason for o in outcomes] == ["tool_calls", "tool_calls", "stop"]
    assert outcomes[0].reply.content is None and outcomes[2].reply.content == "the answer is 6"
    history = session.history
    assert len(history.segments) == 1 and history.splits == {}
    seg = history.segments[0]
    assert seg.prompt_ids == TOK.encode(TOK.apply_chat_template(BASE, tools=TOOLS,
                                                                add_generation_prompt=True))
    call_ids = [*TOK.encode(CALL), EOS]
    tool_turn = "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"
    expected = (call_ids + TOK.encode(tool_turn.format(3)) + call_ids
                + TOK.encode(tool_turn.format(6)) + TOK.encode("the answer is 6") + [EOS])
    assert seg.response_ids == expected
    delta = len(TOK.encode(tool_turn.format(3)))
    assert seg.response_mask == ([1] * len(call_ids) + [0] * delta + [1] * len(call_ids)
                                 + [0] * delta + [1] * 16)
    assert [lp == 0.0 for lp in seg.logprobs] == [m == 0 for m in seg.response_mask]
    # each engine request was the sequence so far; prompt tokens are reused, not re-rendered
    sequence = seg.sequence()
    for prompt in script.prompts:
        assert sequence[:len(prompt)] == prompt
    assert [o.cached_tokens for o in outcomes] == [0, len(seg.prompt_ids) + len(call_ids),
                                                   len(script.prompts[2]) - delta]
    assert (seg.tool_turns, seg.drift, [t.merged for t in session.turns]) == (
        2, 0, [False, True, True])


ECHOES = {  # name: (the model's text, how the agent sends the reply back)
    "content None as empty string": (CALL, lambda r: {**r, "content": ""}),
    "content padded with whitespace": ("thinking " + CALL,
                                       lambda r: {**r, "content": f"  {r['content']}\n"}),
    "SDK extra fields": (CALL, lambda r: {**r, "refusal": None, "audio": None,
                                          "annotations": [], "function_call": None}),
    "call id rewritten": (CALL, lambda r: {**r, "tool_calls": [
        {**c, "id": "other"} for c in r["tool_calls"]]}),
    "arguments re-serialised": (CALL, lambda r: {**r, "tool_calls": [
        {**c, "function": {"name": c["function"]["name"],
                           "arguments": json.dumps(json.loads(c["function"]["arguments"]),
                                                   separators=(",", ":"), sort_keys=True)}}
        for c in r["tool_calls"]]}),
    "arguments as an object": (CALL, lambda r: {**r, "tool_calls": [
        {**c, "function": {"name": c["function"]["name"],
                           "arguments": {"b": 2, "a": 1}}} for c in r["tool_calls"]]}),
}


@pytest.mark.parametrize("variant", sorted(ECHOES))
async def test_an_agents_own_echo_of_a_reply_still_merges(variant):
    runner, session, script, _ = setup()
    text, resend = ECHOES[variant]
    script.push(text)
    first = await ask(runner, session, BASE, tools=TOOLS)
    echo = resend(reply_dict(first))
    later = [*BASE, echo, {"role": "tool", "tool_call_id": "x", "content": "3"}]
    second = await ask(runner, session, later, tools=TOOLS)
    assert session.turns[1].merged, variant
    assert session.history.splits == {}
    third = await ask(runner, session, [*later, reply_dict(second),
                                        {"role": "user", "content": "and?"}], tools=TOOLS)
    assert third.turn is not None and third.turn.merged
    # a real edit of the same reply does split
    edited = [*BASE, {**echo, "content": "something else"}, later[-1]]
    await ask(runner, session, edited, tools=TOOLS)
    assert session.history.splits == {"edited": 1}


async def test_developer_role_and_text_parts_compare_like_system_and_strings():
    runner, session, _, _ = setup()
    parts = [{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                {"type": "text", "text": "brief"}]},
             BASE[1]]
    first = await ask(runner, session, parts)
    await ask(runner, session, [*BASE, reply_dict(first), {"role": "user", "content": "more"}])
    assert session.turns[1].merged and session.history.splits == {}


async def test_rewritten_histories_split_with_their_reasons():
    runner, session, script, _ = setup()
    messages, _ = await conversation(runner, session, script)
    history = session.history
    first = history.segments[0]
    # retry: the last request again; the new prompt reuses the recorded tokens exactly
    retry = messages[:-1]
    await ask(runner, session, retry, tools=TOOLS)
    assert history.splits == {"retry": 1}
    second = history.segments[1]
    assert (second.reason, second.prompt_ids) == ("retry", script.prompts[2])
    assert second.reused_tokens == len(script.prompts[2]) - len(TOK.encode(
        "\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n"))
    # continuing the first branch merges into it again: no new split
    await ask(runner, session, [*messages, {"role": "user", "content": "thanks"}], tools=TOOLS)
    assert history.splits == {"retry": 1} and history.current is first
    # truncated: an earlier prefix, ending on a tool result
    await ask(runner, session, messages[:4], tools=TOOLS)
    assert history.splits == {"retry": 1, "truncated": 1}
    assert history.segments[2].prompt_ids == script.prompts[1]
    # edited: the question changed; nothing before it is a model turn, so it is rendered
    edited = [BASE[0], {"role": "user", "content": "add 2 and 2"}, *messages[2:]]
    await ask(runner, session, edited, tools=TOOLS)
    seg = history.segments[3]
    assert (seg.reason, seg.at_message, seg.reused_tokens) == ("edited", 1, 0)
    assert seg.prompt_ids == TOK.encode(TOK.apply_chat_template(
        edited, tools=TOOLS, add_generation_prompt=True))
    # a summary after the first model turn keeps that turn's tokens
    summary = [*messages[:3], {"role": "user", "content": "summary: 3 so far"}]
    await ask(runner, session, summary, tools=TOOLS)
    seg = history.segments[4]
    assert (seg.reason, seg.at_message) == ("edited", 3)
    assert seg.prompt_ids[:seg.reused_tokens] == first.sequence()[:seg.reused_tokens]
    assert seg.reused_tokens == len(first.prompt_ids) + len(TOK.encode(CALL)) + 1
    # new tools: the system prompt changes, everything is rendered again
    other_tools = [{"type": "function", "function": {"name": "mul"}}]
    await ask(runner, session, messages, tools=other_tools)
    assert history.segments[5].reason == "tools_changed"
    assert history.splits == {"retry": 1, "truncated": 1, "edited": 2, "tools_changed": 1}
    # model output is never re-tokenized: every model run of every segment is an engine reply
    replies = {tuple([*TOK.encode(CALL), EOS]), tuple([*TOK.encode("the answer is 6"), EOS]),
               tuple([*TOK.encode("ok"), EOS])}
    for seg in history.segments:
        run: list[int] = []
        for token, mask in zip([*seg.response_ids, -1], [*seg.response_mask, 0], strict=True):
            if mask:
                run.append(token)
            elif run:
                assert tuple(run) in replies
                run = []


async def test_stop_strings_cut_the_reply_and_the_next_turn_closes_it():
    runner, session, script, _ = setup()
    script.push("alpha STOP beta gamma")
    first = await ask(runner, session, BASE, stop=["STOP"])
    assert (first.reply.content, first.finish_reason) == ("alpha ", "stop")
    kept = first.reply.token_ids
    assert kept == TOK.encode("alpha STOP")  # sampled tokens up to the stop, never re-encoded
    assert session.turns[0].stop_string == "STOP"
    assert session.turns[0].raw_finish_reason == "stop_string"
    await ask(runner, session, [*BASE, reply_dict(first), {"role": "user", "content": "go"}])
    seg = session.history.segments[0]
    delta = seg.response_ids[len(kept):]
    # the template's end of turn was added (mask 0) since the model never sampled it
    assert delta[:len(TOK.encode("<|im_end|>\n<|im_start|>user\ngo"))] == TOK.encode(
        "<|im_end|>\n<|im_start|>user\ngo")
    assert seg.response_mask[len(kept)] == 0


async def test_single_token_stop_strings_also_stop_the_engine():
    runner, session, script, _engine = setup()
    script.push("abc;def")
    outcome = await ask(runner, session, BASE, stop=";")
    assert outcome.reply.content == "abc"
    assert session.turns[0].sampling["stop_token_ids"] == list(TOK.encode(";"))


async def test_a_length_cut_turn_gets_the_end_of_turn_token_before_the_next():
    runner, session, script, _ = setup()
    script.push("x" * 50, open=True)
    first = await ask(runner, session, BASE, max_tokens=5)
    assert first.finish_reason == "length" and first.reply.token_ids == TOK.encode("xxxxx")
    await ask(runner, session, [*BASE, reply_dict(first), {"role": "user", "content": "go"}])
    seg = session.history.segments[0]
    assert seg.response_ids[5] == EOS and seg.response_mask[5] == 0
    assert session.turns[1].merged


async def test_a_spent_response_budget_ends_the_segment_on_length_with_a_final_error():
    runner, session, script, _ = setup(max_response_tokens=40)
    script.push(CALL)
    first = await ask(runner, session, BASE, tools=TOOLS)
    assert len(first.reply.token_ids) == 40 and first.finish_reason == "length"
    seg = session.history.segments[0]
    # the turn was cut by the budget, not by its own max_tokens
    assert (seg.finish_reason, seg.raw_finish_reason) == (FinishReason.LENGTH, "response_budget")
    later = [*BASE, reply_dict(first), {"role": "user", "content": "go on"}]
    with pytest.raises(FinalError) as refused:
        await ask(runner, session, later, tools=TOOLS)
    assert (refused.value.status, refused.value.code) == (404, "response_budget_exhausted")
    assert refused.value.final and session.ended == "response_budget"
    assert len(session.turns) == 1 and session.requests == 2
    assert (seg.finish_reason, seg.raw_finish_reason) == (FinishReason.LENGTH, "response_budget")


async def test_locked_sampling_ignores_the_agents_temperature_and_caps_max_tokens():
    runner, session, _, _ = setup()
    session.sampling = SamplingParams(temperature=0.9, max_tokens=8, seed=3)
    session.lock_sampling = True
    await ask(runner, session, BASE, temperature=0.0, max_tokens=64, seed=11)
    used = session.turns[0].sampling
    assert (used["temperature"], used["max_tokens"], used["seed"]) == (0.9, 8, 3)
    assert session.turns[0].request["temperature"] == 0.0
    session.lock_sampling = False
    await ask(runner, session, BASE, temperature=0.0, max_completion_tokens=64, seed=11)
    used = session.turns[1].sampling
    assert (used["temperature"], used["max_tokens"], used["seed"]) == (0.0, 64, 11)


async def test_tool_choice_none_and_unreadable_calls_come_back_as_text():
    runner, session, script, _ = setup()
    script.push(CALL)
    plain = await ask(runner, session, BASE, tools=TOOLS, tool_choice="none")
    assert plain.reply.content == CALL and not plain.reply.tool_calls
    broken = '<tool_call>{"name": "add", "arguments": </tool_call>'
    script.push(broken)
    runner2, session2, script2, _ = setup()
    script2.push(broken)
    outcome = await ask(runner2, session2, BASE, tools=TOOLS)
    assert outcome.reply.content == broken and outcome.finish_reason == "stop"
    assert "tool_call_errors" in (outcome.reply.model_extra or {})


async def test_a_prompt_over_the_context_is_a_400_and_engine_failures_leave_no_trace():
    runner, session, _, engine = setup()
    runner.max_model_len = 20
    with pytest.raises(ProxyRequestError) as info:
        await ask(runner, session, BASE)
    assert info.value.code == "context_length_exceeded" and info.value.status == 400
    runner.max_model_len = None
    engine.error_rate = 1.0
    with pytest.raises(ProxyError) as failed:
        await ask(runner, session, BASE)
    assert failed.value.status == 502 and session.history.segments == []
    engine.error_rate = 0.0
    outcome = await ask(runner, session, BASE)
    assert outcome.turn is not None and outcome.turn.index == 0


async def test_invalid_messages_are_request_errors_naming_the_message():
    runner, session, _, _ = setup()
    with pytest.raises(ProxyRequestError) as info:
        await ask(runner, session, [*BASE, {"role": "user", "content": [{"type": "image_url"}]}])
    assert info.value.param == "messages.2.content.0.type"
    for bad in ({"role": "wizard", "content": "x"}, {"role": []}, "just text"):
        with pytest.raises(ProxyRequestError) as info:
            await ask(runner, session, [bad])
        assert info.value.param.startswith("messages.0") and info.value.status == 400
    for refused in ({"n": 2}, {"top_logprobs": 3}):
        with pytest.raises(FinalError) as final:
            check_fields({"messages": BASE, **refused}, CHAT_FIELDS, frozenset())
        assert final.value.param == next(iter(refused)) and final.value.status == 404
    # JSON nulls where OpenAI's spec allows them (the SDK forwards unset options as null)
    nulls = dict.fromkeys(("n", "stream", "logprobs", "top_logprobs", "temperature", "top_p",
                           "max_tokens", "seed", "stop", "tools", "tool_choice",
                           "stream_options", "parallel_tool_calls"))
    accepted = parse_request({"messages": BASE, **nulls})
    assert check_fields({"messages": BASE, **nulls}, CHAT_FIELDS, frozenset()) == frozenset()
    outcome = await runner.run(session, accepted)
    assert outcome.turn is not None and outcome.logprobs is None


class ThinkingBytes(ByteTokenizer):
    """The byte tokenizer with a template option, as Qwen3's ``enable_thinking``: off, the
    generation prompt opens an empty think block."""

    def apply_chat_template(self, conversation: Any, *, enable_thinking: bool = True,
                            **kwargs: Any) -> Any:
        text = super().apply_chat_template(conversation, **kwargs)
        if kwargs.get("add_generation_prompt") and not enable_thinking:
            text += "<think>\n\n</think>\n\n"
        return text


async def test_chat_template_kwargs_reach_every_rendering_and_a_change_starts_a_segment():
    """vLLM's ``chat_template_kwargs`` extension: the options reach the prompt and each
    merged turn's delta; a request with other options starts a new segment."""
    tok = ThinkingBytes()
    script = Script()
    engine = SimulatedEngine(latency_s=0, latency_sigma=0, tail_prob=0, responder=script,
                             eos_token_id=EOS)
    runner = TurnRunner(engine, tok, HermesToolParser(), max_tokens=None, max_turns=50,
                        offload_chars=10_000, abort_timeout_s=5.0)
    session = SessionStore(tok, max_sessions=10, idle_timeout_s=60).create(
        sampling=SamplingParams(max_tokens=100))
    off = {"enable_thinking": False}
    first = await ask(runner, session, BASE, chat_template_kwargs=off)
    think_off = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(script.prompts[-1]).endswith(think_off)
    messages = [*BASE, reply_dict(first), {"role": "user", "content": "and 2 and 3?"}]
    second = await ask(runner, session, messages, chat_template_kwargs=off)
    assert second.turn is not None and second.turn.merged
    assert tok.decode(script.prompts[-1]).endswith(think_off)
    messages = [*messages, reply_dict(second), {"role": "user", "content": "thanks"}]
    third = await ask(runner, session, messages)  # thinking on again: another rendering
    assert third.turn is not None and not third.turn.merged
    assert third.turn.split_reason == "tools_changed"
    assert not tok.decode(script.prompts[-1]).endswith(think_off)


@pytest.mark.parametrize("options", [{"tokenize": True}, {"tools": []}, {"not a name": 1}])
def test_reserved_or_malformed_chat_template_kwargs_are_refused(options):
    with pytest.raises(ProxyRequestError) as info:
        parse_request({"model": "m", "messages": BASE, "chat_template_kwargs": options})
    assert "chat_template_kwargs" in str(info.value)
