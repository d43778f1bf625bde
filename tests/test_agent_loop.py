"""The multi-turn agent loop on the real tiny model, with tool calls forced.

What is forced: a random-weight model never writes a tool call, so a logits processor
(``ForcedText``) restricts some turns to a given set of texts. Turn 0 may only write one of a
few ``<tool_call>`` texts (the model really samples *which* one where they branch, so those
logprobs are real); turn 1 may only write ``Answer: <the last tool result>``. Every other
token is sampled freely. The checks compare the trajectory with independent records: the
engine's own request log, a fresh forward pass of a second model copy, and the chat
template's rendering of the final conversation. The last test needs no forcing: it runs the
shipped tiny policy, which writes its tool calls itself.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from _model_fixtures import ForcedText, rescore, torch

from pipeline import (
    BuildPrompt,
    FinishReason,
    Generate,
    Loop,
    Pipeline,
    SimulatedEngine,
    Status,
    artifacts,
    parse_row,
)
from pipeline._text.render import DRIFT_PREFIX, chat_form, render_turn_delta
from pipeline.models._template import CHAT_TEMPLATE
from pipeline.stages._tools import TEMPLATE_DRIFT, TOOL_CALLS, TOOL_ERRORS, CallTools
from pipeline.testing import ByteTokenizer, capture_logs
from pipeline.tools import FunctionTool, calculator_tool, make_registry, tool_schema
from scenarios import arith_tools

pytest_plugins = ["_model_fixtures"]

CALC = calculator_tool()


def call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


class Script:
    """Per-request constraint: turn 0 -> one of the row's tool-call texts, turn 1 -> the
    answer repeating the last tool result; other turns are sampled freely (with
    ``ban_eos``: freely but never stopping, so length limits are what ends them). Rows are
    recognised by their question text in the prompt."""

    def __init__(self, tokenizer, calls: dict[str, list[str]], answer_turn: int = 1,
                 ban_eos: bool = False) -> None:
        self.tokenizer = tokenizer
        self.calls = calls
        self.answer_turn = answer_turn
        self.ban_eos = ban_eos

    def texts(self, request_id: str, prompt_ids) -> list[str] | None:
        turn = int(request_id.rsplit("-", 1)[1])
        text = self.tokenizer.decode(prompt_ids)
        if turn == 0:
            return next((calls for key, calls in self.calls.items() if key in text), None)
        if turn == self.answer_turn:
            results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
            return [f"Answer: {results[-1] if results else 'none'}"]
        return None

    def __call__(self, request_id: str, prompt_ids) -> ForcedText | None:
        texts = self.texts(request_id, prompt_ids)
        if texts is None:
            return self._no_eos if self.ban_eos else None
        return ForcedText([self.tokenizer.encode(t) for t in texts], self.tokenizer.eos_token_id)


    def _no_eos(self, generated, logits):
        logits[self.tokenizer.eos_token_id] = float("-inf")
        return logits


class RecordingEngine:
    """Passes requests to the real engine and keeps its own log of what came back."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.log: dict[str, tuple[list[int], object]] = {}

    async def generate(self, prompt_ids, sampling, request_id):
        gen = await self.engine.generate(prompt_ids, sampling, request_id)
        self.log[request_id] = (list(prompt_ids), gen)
        return gen

    async def abort(self, request_id):
        await self.engine.abort(request_id)

    async def aclose(self):
        await self.engine.aclose()


def question_row(question: str, answer: str, **extra) -> dict:
    return {"messages": [{"role": "system", "content": arith_tools.SYSTEM_PROMPT},
                         {"role": "user", "content": question}],
            "tools": [tool_schema(CALC)], "ground_truth": answer,
            "data_source": "test", **extra}


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values: ``(value, start, end)``."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


def chat(messages) -> list[dict]:
    return [chat_form(m) for m in messages]


def agent_stages(max_turns: int = 3, **tools_options) -> list:
    return [BuildPrompt(), Loop([Generate(), CallTools(**tools_options)], max_turns=max_turns),
            arith_tools.numeric_match_reward]


async def test_forced_tool_calls_give_token_exact_trajectories(make_engine, tiny_tokenizer,
                                                               reference_model):
    tok = tiny_tokenizer
    calls = {
        "12 apples": [call_text("calculator", '{"expression": "12 + 5 * 3"}'),
                      call_text("calculator", '{"expression": "(12 + 5) * 3"}')],
        "7 boxes": [call_text("calculator", '{"expression": "7 * 6"}'),
                    call_text("calculator", '{"expression": "7 + 6"}')],
    }
    script = Script(tok, calls)
    engine = RecordingEngine(make_engine(processor_factory=script))
    rows = [question_row("Ava has 12 apples and buys 5 bags of 3. How many?", "27"),
            question_row("There are 7 boxes of 6 pens. How many pens?", "42")]
    pipe = Pipeline(agent_stages(), engine=engine, tokenizer=tok, tools=make_registry([CALC]),
                    sampling={"max_tokens": 48, "max_response_tokens": 200})
    result = await pipe.run_batch(rows, n=3)
    assert result.stats.by_status == {"completed": 6}
    assert result.stats.by_exit_reason == {"done": 6}
    branching = 0
    for sample, item in zip(result.samples, result.items, strict=True):
        row = item.data
        # the prompt is exactly the chat template's rendering
        assert sample.prompt_ids == tok.apply_chat_template(
            row.messages, tools=row.tools, add_generation_prompt=True)["input_ids"]
        ids, mask, logprobs = sample.response_ids, sample.response_mask, sample.logprobs
        assert len(ids) == len(mask) == len(logprobs) <= 200
        assert all(math.isfinite(lp) for lp in logprobs)
        # model tokens (mask 1) are exactly what the engine sampled, turn by turn, and each
        # request's prompt was exactly the trajectory's ids so far (token in, token out)
        segments = runs(mask)
        model_runs = [(s, e) for m, s, e in segments if m == 1]
        assert [m for m, _, _ in segments] == [1, 0, 1]
        for turn, (start, end) in enumerate(model_runs):
            sent, gen = engine.log[f"{item.uid}-{turn}"]
            assert ids[start:end] == gen.token_ids and logprobs[start:end] == gen.logprobs
            assert sent == sample.prompt_ids + ids[:start]
        # logprobs re-scored by a forward pass of an independent copy of the model, under
        # the same constraint (the processed distribution the engine sampled from)
        full = sample.prompt_ids + ids
        raw = rescore(reference_model, full, len(sample.prompt_ids))
        for turn, (start, end) in enumerate(model_runs):
            forced = script(f"{item.uid}-{turn}", full[:len(sample.prompt_ids) + start])
            for j in range(start, end):
                allowed = sorted(forced.allowed(ids[start:j]))
                assert ids[j] in allowed
                expected = torch.log_softmax(raw[j][allowed], -1)[allowed.index(ids[j])]
                assert logprobs[j] == pytest.approx(float(expected), abs=1e-4)
                branching += len(allowed) > 1
        # tool tokens carry mask 0 and logprob 0 and are the template's tool turn
        _, start, end = segments[1]
        result_text = item.artifacts[artifacts.MESSAGES][-2].content
        assert tok.decode(ids[start:end]) == (
            f"\n<|im_start|>tool\n<tool_response>\n{result_text}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
        assert set(logprobs[start:end]) == {0.0}
        # the whole trajectory equals a from-scratch rendering of the final conversation
        rendered = tok.apply_chat_template(chat(item.artifacts[artifacts.MESSAGES]),
                                           tools=row.tools, tokenize=False)
        assert tok.encode(rendered) == full + tok.encode("\n")
        chosen = item.artifacts[artifacts.MESSAGES][2].tool_calls[0].function.arguments
        right = chosen in ('{"expression": "12 + 5 * 3"}', '{"expression": "7 * 6"}')
        assert sample.reward == (1.0 if right else 0.0)
        assert (sample.tool_turns, item.artifacts[artifacts.TURNS]) == (1, 2)
        assert sample.finish_reason is FinishReason.STOP
        assert {k: sample.extra_fields[k] for k in (TOOL_CALLS, TOOL_ERRORS, TEMPLATE_DRIFT)} == {
            TOOL_CALLS: 1, TOOL_ERRORS: 0, TEMPLATE_DRIFT: 0}
    assert branching == 6  # one real choice per sample: where the two call texts differ


async def test_bad_tool_calls_become_error_messages_the_model_sees(make_engine,
                                                                   tiny_tokenizer):
    tok = tiny_tokenizer

    async def slow(city: str) -> str:
        await asyncio.sleep(5)
        return "sunny"

    async def broken(city: str) -> str:
        raise RuntimeError("backend down")

    tools = make_registry([CALC, FunctionTool(name="slow", fn=slow, timeout_s=0.05),
                           FunctionTool(name="broken", fn=broken)])
    cases = {
        "case malformed": ('{"expression": 12 + }', "calculator", "not valid JSON", "parse"),
        "case unknown": ('{"city": "Oslo"}', "weather", "unknown tool 'weather'",
                         "unknown_tool"),
        "case wrongtype": ('{"expression": 12}', "calculator", "expected string, got integer",
                           "invalid_arguments"),
        "case divzero": ('{"expression": "1 / 0"}', "calculator", "division by zero",
                         "tool_exception"),
        "case raises": ('{"city": "Oslo"}', "broken", "RuntimeError: backend down",
                        "tool_exception"),
        "case slow": ('{"city": "Oslo"}', "slow", "timed out after 0.05s", "timeout"),
    }
    script = Script(tok, {key: [call_text(name, args)] for key, (args, name, _, _)
                          in cases.items()})
    engine = make_engine(processor_factory=script)
    pipe = Pipeline(agent_stages(), engine=engine, tokenizer=tok, tools=tools,
                    sampling={"max_tokens": 200})
    result = await pipe.run_batch([question_row(f"{key}: go", "0") for key in cases])
    for item, sample, (_, _, message, kind) in zip(result.items, result.samples,
                                                   cases.values(), strict=True):
        assert sample.status is Status.COMPLETED, sample.error
        reply = item.artifacts[artifacts.MESSAGES][3]
        assert reply.role == "tool" and reply.content.startswith("Error: ")
        assert message in reply.content and reply.model_extra["error"] == kind
        tool_tokens = [t for t, m in zip(sample.response_ids, sample.response_mask,
                                         strict=True) if m == 0]
        assert message in tok.decode(tool_tokens)  # the model's next turn saw the error
        assert sample.extra_fields[TOOL_ERRORS] == 1 and sample.tool_turns == 1
        final = item.artifacts[artifacts.MESSAGES][-1]
        assert final.content.startswith("Answer: Error:")


async def test_length_budget_ends_with_the_limit_that_hit(make_engine, tiny_tokenizer):
    tok = tiny_tokenizer
    call = call_text("calculator", '{"expression": "2 + 2"}')
    script = Script(tok, {"two": [call]}, answer_turn=-1, ban_eos=True)  # turn 1+: free
    row = question_row("What is two plus two?", "4")
    prompt_len = len(tok.apply_chat_template(row["messages"], tools=row["tools"],
                                             add_generation_prompt=True)["input_ids"])
    first = len(tok.encode(call)) + 1  # the forced call and its eos
    delta = len(tok.encode("\n<|im_start|>tool\n<tool_response>\n4\n</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n"))

    async def run(max_model_len=1024, **sampling):
        engine = RecordingEngine(make_engine(processor_factory=script,
                                             max_model_len=max_model_len))
        pipe = Pipeline(agent_stages(max_turns=4), engine=engine, tokenizer=tok,
                        tools=make_registry([CALC]), sampling=sampling)
        sample = await pipe.run(row)
        assert sample.status is Status.COMPLETED
        assert (sample.finish_reason, sample.exit_reason) == (FinishReason.LENGTH, "length")
        assert all(len(sent) + len(gen.token_ids) <= max_model_len
                   for sent, gen in engine.log.values())
        return sample

    cases = [  # (engine max_model_len, sampling, expected raw reason, expected response len)
        (1024, {"max_tokens": 8}, "max_tokens", 8),
        (1024, {"max_tokens": 64, "max_response_tokens": first - 3}, "response_budget",
         first - 3),
        (1024, {"max_tokens": 64, "max_response_tokens": first + delta}, "response_budget",
         first),
        (1024, {"max_tokens": 64, "max_response_tokens": first + delta + 5}, "response_budget",
         first + delta + 5),
        (1024, {"max_tokens": first, "max_response_tokens": 2 * first + delta + 10},
         "max_tokens", 2 * first + delta),
        (prompt_len + first + 3, {"max_tokens": 64}, "context", first),
        (prompt_len + first + delta + 7, {"max_tokens": 64}, "context", first + delta + 7),
        (prompt_len - 1, {"max_tokens": 64}, "context", 0),
    ]
    for max_model_len, sampling, raw, length in cases:
        sample = await run(max_model_len, **sampling)
        assert (sample.raw_finish_reason, len(sample.response_ids)) == (raw, length), sampling
        budget = sampling.get("max_response_tokens")
        assert budget is None or len(sample.response_ids) <= budget


async def test_a_template_that_rewrites_history_is_counted_as_drift(make_engine,
                                                                     tiny_tokenizer):
    marker = "{{- '<|im_start|>assistant\\n' -}}{{- text(m.content) -}}"
    assert marker in CHAT_TEMPLATE
    drifting = copy.deepcopy(tiny_tokenizer)
    drifting.chat_template = CHAT_TEMPLATE.replace(
        marker, marker + "{%- if not loop.last -%}{{- '(seen)' -}}{%- endif -%}")
    call = call_text("calculator", '{"expression": "2 + 2"}')
    engine = make_engine(processor_factory=Script(drifting, {"two": [call]}))
    pipe = Pipeline(agent_stages(), engine=engine, tokenizer=drifting,
                    tools=make_registry([CALC]), sampling={"max_tokens": 32})
    with capture_logs() as logs:
        sample = await pipe.run(question_row("What is two plus two?", "4"))
    assert sample.status is Status.COMPLETED and sample.tool_turns == 1
    assert sample.extra_fields[TEMPLATE_DRIFT] == 1
    assert any(e["event"] == "template_drift" and DRIFT_PREFIX in e["kinds"] for e in logs)


def qwen3_template() -> str:
    """Qwen3's original chat template, as trl ships it (read, not imported: trl pulls in
    accelerate and datasets)."""
    spec = importlib.util.find_spec("trl")
    assert spec is not None and spec.submodule_search_locations, "trl is not installed"
    folder = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    return (folder / "qwen3.jinja").read_text()


async def test_qwen3_history_rewrite_keeps_the_sampled_tokens_and_renders_only_the_bridge(
        make_engine, tiny_tokenizer):
    """Qwen3's template renders an empty ``<think></think>`` in the last assistant turn only:
    once a tool result follows, the earlier turn renders without it (not prefix-stable). The
    delta used to be cut at the longest common *character* prefix, so every tool turn appended
    a garbled copy of the model's call starting mid-token (``\\nool_call>...``) as context.
    Now the model's tokens stay as sampled and each tool turn adds exactly the template's
    bridge: the end of turn, the tool response, the next generation prompt."""
    qwen3 = copy.deepcopy(tiny_tokenizer)
    qwen3.chat_template = qwen3_template()
    turns = [call_text("calculator", '{"expression": "2 + 2"}'),
             call_text("calculator", '{"expression": "4 * 1"}'), "Answer: 4"]

    def script(request_id, prompt_ids):
        text = turns[int(request_id.rsplit("-", 1)[1])]
        return ForcedText([qwen3.encode(text)], qwen3.eos_token_id)

    engine = make_engine(processor_factory=script)
    pipe = Pipeline(agent_stages(), engine=engine, tokenizer=qwen3,
                    tools=make_registry([CALC]), sampling={"max_tokens": 48})
    sample = await pipe.run(question_row("What is two plus two?", "4"))
    assert sample.status is Status.COMPLETED and sample.tool_turns == 2, sample.error
    assert sample.extra_fields[TEMPLATE_DRIFT] == 2  # recorded: the template rewrote history
    context = [qwen3.decode(sample.response_ids[start:end]) for mask, start, end
               in runs(sample.response_mask) if mask == 0]
    assert context == ["\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>"
                       "\n<|im_start|>assistant\n"] * 2, context
    sampled = [qwen3.decode(sample.response_ids[start:end]) for mask, start, end
               in runs(sample.response_mask) if mask == 1]
    assert sampled == [turn + "<|im_end|>" for turn in turns], sampled


THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


async def test_template_options_from_the_pipeline_and_the_row_reach_every_rendering(
        make_engine, tiny_tokenizer):
    """``enable_thinking`` (Qwen3's template option) from ``chat_template_kwargs``: the
    pipeline's default, a row's own value over it, in the prompt and in every tool turn's
    bridge (each next generation prompt opens the empty think block the model then follows)."""
    qwen3 = copy.deepcopy(tiny_tokenizer)
    qwen3.chat_template = qwen3_template()
    turns = [call_text("calculator", '{"expression": "2 + 2"}'), "Answer: 4"]

    def script(request_id, prompt_ids):
        text = turns[int(request_id.rsplit("-", 1)[1])]
        return ForcedText([qwen3.encode(text)], qwen3.eos_token_id)

    pipe = Pipeline(agent_stages(), engine=make_engine(processor_factory=script),
                    tokenizer=qwen3, tools=make_registry([CALC]), sampling={"max_tokens": 48},
                    chat_template_kwargs={"enable_thinking": False})
    result = await pipe.run_batch([
        question_row("What is two plus two?", "4"),
        question_row("What is two plus two?", "4",
                     chat_template_kwargs={"enable_thinking": True})], n=1)
    off, on = result.samples
    assert [s.status for s in result.samples] == [Status.COMPLETED] * 2, \
        [s.error for s in result.samples]
    assert qwen3.decode(off.prompt_ids).endswith(THINK_OFF)
    assert not qwen3.decode(on.prompt_ids).endswith(THINK_OFF)
    bridge = [qwen3.decode(off.response_ids[start:end]) for mask, start, end
              in runs(off.response_mask) if mask == 0]
    assert len(bridge) == 1 and bridge[0].endswith("</tool_response><|im_end|>\n" + THINK_OFF)
    bridge = [qwen3.decode(on.response_ids[start:end]) for mask, start, end
              in runs(on.response_mask) if mask == 0]
    assert len(bridge) == 1 and bridge[0].endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(("options", "says"), [
    ({"tokenize": True}, "option 'tokenize' is set by the pipeline itself"),
    ({"add_generation_prompt": False}, "option 'add_generation_prompt' is set by the pipeline"),
    ({"enable thinking": False}, "option name 'enable thinking' is not an identifier"),
    ("enable_thinking", "Input should be a valid dictionary"),
])
def test_bad_template_options_are_refused_naming_the_field(options, says):
    from pipeline import ConfigError, RowError

    with pytest.raises(RowError, match=says) as row_error:
        parse_row({"prompt": "hi", "chat_template_kwargs": options}, index=7)
    assert "chat_template_kwargs" in str(row_error.value) and "row 7" in str(row_error.value)
    with pytest.raises(ConfigError, match=says) as config_error:
        Pipeline([BuildPrompt(), Generate()], tokenizer=ByteTokenizer(),
                 chat_template_kwargs=options)
    assert config_error.value.field == "chat_template_kwargs"


def test_qwen3_delta_for_a_follow_up_question_is_the_bridge_only(tiny_tokenizer):
    """The proxy's case: the agent asks a follow-up question after the model's answer (the
    earlier turn loses its empty think block in Qwen3's rendering): the delta is the end of
    the turn, the question and the generation prompt, nothing of the model's own text."""
    from pipeline import AgentMessage

    qwen3 = copy.deepcopy(tiny_tokenizer)
    qwen3.chat_template = qwen3_template()
    conversation = [AgentMessage(role="user", content="What is 2 + 2?"),
                    AgentMessage(role="assistant", content="It is 4.")]
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    delta = render_turn_delta(qwen3, conversation,
                              [AgentMessage(role="user", content="And 3 + 3?")], None, end)
    assert delta.text == ("\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n"
                          "<|im_start|>assistant\n"), delta.text
    assert delta.drift == (DRIFT_PREFIX,) and delta.ids == qwen3.encode(delta.text)


def test_qwen3_delta_after_a_stop_the_template_does_not_render_is_still_the_bridge(
        tiny_tokenizer):
    """The model ended its turn on ``<|endoftext|>`` (also an eos of Qwen's), which the
    template never renders, on the template that rewrites the turn: the delta starts after
    the turn's rendered end in the new rendering, never inside the model's own text."""
    from pipeline import AgentMessage, ToolCall, ToolFunction

    qwen3 = copy.deepcopy(tiny_tokenizer)
    qwen3.chat_template = qwen3_template()
    conversation = [AgentMessage(role="user", content="What is 2 + 3?"),
                    AgentMessage(role="assistant", content="", tool_calls=[ToolCall(
                        id="c1", function=ToolFunction(name="calc",
                                                       arguments='{"e": "2 + 3"}'))])]
    endoftext = qwen3.convert_tokens_to_ids("<|endoftext|>")
    delta = render_turn_delta(qwen3, conversation, [AgentMessage(
        role="tool", content="5", tool_call_id="c1")], None, endoftext)
    assert delta.text == ("<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>"
                          "\n<|im_start|>assistant\n"), delta.text
    assert set(delta.drift) == {DRIFT_PREFIX, "closing"}


def test_turn_delta_with_the_byte_tokenizer():
    from pipeline import AgentMessage, ToolCall, ToolFunction

    tok = ByteTokenizer()
    conversation = [
        AgentMessage(role="user", content="hi"),
        AgentMessage(role="assistant", content="calling", tool_calls=[ToolCall(
            id="c", function=ToolFunction(name="f", arguments="{}"))]),
    ]
    delta = render_turn_delta(tok, conversation, [AgentMessage(role="tool", content="ok",
                                                               tool_call_id="c")],
                              None, tok.eos_token_id)
    assert delta.text == "\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n"
    assert delta.ids == tok.encode(delta.text) and delta.drift == ()
    odd = render_turn_delta(tok, conversation, [], None, tok.encode("z")[0])
    assert "closing" in odd.drift


async def test_sample_deadline_cancels_a_running_tool(make_engine, tiny_tokenizer):
    tok = tiny_tokenizer
    state = {"started": False, "cancelled": False}

    async def wait(city: str) -> str:
        state["started"] = True
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        return "late"

    tools = make_registry([FunctionTool(name="wait", fn=wait, timeout_s=60)])
    script = Script(tok, {"weather": [call_text("wait", '{"city": "Oslo"}')]})
    pipe = Pipeline(agent_stages(), engine=make_engine(processor_factory=script), tokenizer=tok,
                    tools=tools, sample_timeout_s=2.0, sampling={"max_tokens": 32})
    sample = await pipe.run(question_row("weather in Oslo?", "0"))
    assert sample.status is Status.TIMEOUT and sample.masked
    assert state == {"started": True, "cancelled": True}


async def test_over_sampling_really_aborts_engine_requests(make_engine, tiny_tokenizer):
    tok = tiny_tokenizer
    quick = Script(tok, {"quick": ["Answer: 1"]})
    engine = make_engine(processor_factory=quick, eos_token_ids=())
    rows = [question_row("quick one", "1", sampling={"stop_token_ids": [tok.eos_token_id]})]
    rows += [question_row(f"long one {i}", "0") for i in range(3)]
    pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tok,
                    sampling={"max_tokens": 900})
    result = await pipe.run_batch(rows, num_needed=1)
    assert [s.status for s in result.samples] == [Status.COMPLETED] + [Status.ABORTED] * 3
    for _ in range(300):
        if engine.inflight_requests == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.inflight_requests == 0
    assert engine.counters.generated_tokens < 3 * 900


async def test_arith_scenario_runs_and_rewards_a_correct_forced_answer(make_engine,
                                                                       tiny_tokenizer):
    rows = arith_tools.rows(4, seed=3)
    assert rows == arith_tools.rows(4, seed=3) and rows != arith_tools.rows(4, seed=4)
    assert arith_tools.__doc__.startswith("rollout run arith")
    for raw in rows:
        parse_row(raw)
        assert raw["tools"] == [tool_schema(arith_tools.tools()["calculator"])]
        assert float(raw["ground_truth"]).is_integer()
    tok = tiny_tokenizer
    # force the tool call to compute the ground truth itself, so the answer is right
    script = Script(tok, {r["messages"][1]["content"][:30]: [
        call_text("calculator", f'{{"expression": "{r["ground_truth"]} + 0"}}')] for r in rows})
    pipe = Pipeline(arith_tools.stages(), engine=make_engine(processor_factory=script),
                    tokenizer=tok, tools=arith_tools.tools(), sampling={"max_tokens": 64})
    result = await pipe.run_batch(rows, n=2)
    assert result.stats.by_status == {"completed": 8}
    assert [s.reward for s in result.samples] == [1.0] * 8
    assert result.samples[0].reward_payload["acc"] is True
    assert arith_tools.extract_number("so Answer: 1,234.") == 1234.0
    assert arith_tools.extract_number("no digits") is None


async def test_the_tiny_policy_calls_the_tool_unforced():
    """The shipped tiny policy (not the random model) writes real tool calls on its own: the
    loop runs them, the tool turn is masked template tokens, and the reward follows the
    final answer. Nothing is forced here."""
    from pipeline.engines.transformers import TransformersEngine
    from pipeline.models import tiny_policy_dir

    engine = TransformersEngine.from_pretrained(tiny_policy_dir(), max_model_len=2048)
    tok = engine.tokenizer
    pipe = Pipeline(arith_tools.stages(), engine=engine, tokenizer=tok,
                    tools=arith_tools.tools(), seed=1, sampling={"max_tokens": 96})
    try:
        result = await pipe.run_batch(arith_tools.rows(8, seed=11), n=2)
    finally:
        await engine.aclose()
    assert result.stats.by_status == {"completed": 16}
    with_tool = [(s, i) for s, i in zip(result.samples, result.items, strict=True)
                 if s.tool_turns == 1]
    assert len(with_tool) >= 10 and result.stats.tool_errors == 0
    for sample, item in with_tool:
        messages = item.artifacts[artifacts.MESSAGES]
        call = messages[2].tool_calls[0].function
        expression = json.loads(call.arguments)["expression"]
        assert call.name == "calculator"
        assert messages[3].content == await CALC.fn(expression=expression)
        assert [m for m, _, _ in runs(sample.response_mask)] == [1, 0, 1]
        predicted = arith_tools.extract_number(messages[-1].content or "")
        assert sample.reward == float(predicted == float(item.data.ground_truth))


async def test_rows_without_tools_get_the_registrys_schemas_in_the_prompt(tiny_tokenizer):
    """As verl's tool agent loop gives every prompt its configured tools: a row with no
    ``tools`` key is rendered with the pipeline registry's schemas, ``tools: []`` with none,
    and a row's own list wins."""
    other = {"type": "function", "function": {"name": "lookup", "description": "Look up.",
                                              "parameters": {"type": "object"}}}
    rows = [{"messages": [{"role": "user", "content": f"Q{i}"}], **extra}
            for i, extra in enumerate([{}, {"tools": []}, {"tools": [other]}])]
    pipe = Pipeline([BuildPrompt()], engine=SimulatedEngine(), tokenizer=tiny_tokenizer,
                    tools=[CALC])
    result = await pipe.run_batch(rows)
    texts = [tiny_tokenizer.decode(s.prompt_ids) for s in result.samples]
    prompts = {re.search(r"Q(\d)", text).group(1): text for text in texts}  # type: ignore[union-attr]
    assert '"name": "calculator"' in prompts["0"]
    assert "<tools>" not in prompts["1"] and "calculator" not in prompts["1"]
    assert '"name": "lookup"' in prompts["2"] and "calculator" not in prompts["2"]
