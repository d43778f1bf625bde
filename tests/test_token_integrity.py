"""Live token-integrity checks (issue 36 item 4): each check catches a real corruption,
injected through a hostile engine or stage, and quarantines exactly that sample with the
reason while the rest of the batch completes; clean multi-turn tool loops on the real tiny
model, in the loop and through the proxy with the real ``openai`` SDK, show no mismatch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

import pytest

from pipeline import (
    BuildPrompt,
    Generate,
    Generation,
    Loop,
    Pipeline,
    PipelineConfig,
    SimulatedEngine,
    TokenIntegrityError,
    artifacts,
)
from pipeline._text import integrity
from pipeline.cli._report import summary
from pipeline.observability import ALWAYS_KEYS, batch_metrics
from pipeline.proxy import ProxyServer, RemoteAgent
from pipeline.proxy._history import History
from pipeline.stages import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import calculator_tool, make_registry
from scenarios import arith_tools

TOK = ByteTokenizer()
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def scripted(prompt_ids: list[int], rng: Any) -> list[int]:
    """Turn 0: a calculator call; after a tool result: the answer; always ends on eos."""
    text = TOK.decode(prompt_ids)
    reply = "Answer: 4" if "<|im_start|>tool" in text else CALL
    return [*TOK.encode(reply), TOK.eos_token_id]


def is_bad(prompt_ids: list[int]) -> bool:
    return "BAD" in TOK.decode(prompt_ids)


def after_tool(prompt_ids: list[int]) -> bool:
    return "<|im_start|>tool" in TOK.decode(prompt_ids)


class LyingTextEngine(SimulatedEngine):
    """On the BAD row's second turn, returns ids of ``Answer: 5`` but the text
    ``Answer: 4`` (a server whose detokenizer and ids disagree)."""

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str) -> Generation:
        gen = await super().generate(prompt_ids, sampling, request_id)
        text = TOK.decode(gen.token_ids, skip_special_tokens=True)
        if is_bad(list(prompt_ids)) and after_tool(list(prompt_ids)):
            ids = [*TOK.encode(text.replace("4", "5")), TOK.eos_token_id]
            return dataclasses.replace(gen, token_ids=ids, logprobs=gen.logprobs[:len(ids)],
                                       text=text)
        return dataclasses.replace(gen, text=text)


class ShortLogprobsEngine(SimulatedEngine):
    """On the BAD row's second turn, one logprob short."""

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str) -> Generation:
        gen = await super().generate(prompt_ids, sampling, request_id)
        if is_bad(list(prompt_ids)) and after_tool(list(prompt_ids)):
            return dataclasses.replace(gen, logprobs=gen.logprobs[:-1])
        return gen


async def rewrite_history(item: Any, ctx: Any) -> None:
    """A hostile stage: on the BAD row, after the tool turn, re-tokenizes the history the way
    a re-rendering loop would (here: the assistant's tool call loses its last token)."""
    art = item.artifacts
    if "BAD" in item.data.messages[-1]["content"] and art.get(artifacts.TOOL_TURNS):
        response = art[artifacts.RESPONSE_IDS]
        call_end = len(TOK.encode(CALL))  # the sampled eos after the call
        del response[call_end]
        del art[artifacts.RESPONSE_MASK][call_end]
        del art[artifacts.LOGPROBS][call_end]


async def replace_prompt(item: Any, ctx: Any) -> None:
    """A hostile stage: on the BAD row, swaps in a re-rendered prompt that differs."""
    art = item.artifacts
    if "BAD" in item.data.messages[-1]["content"] and art.get(artifacts.TOOL_TURNS):
        art[artifacts.PROMPT_IDS] = [*art[artifacts.PROMPT_IDS][:-1], TOK.encode("x")[0]]


ROWS = [{"prompt": f"Question {i}: what is 2 + 2?", "tools": TOOLS} for i in range(5)]
ROWS[2] = {"prompt": "Question BAD: what is 2 + 2?", "tools": TOOLS}


def loop_pipeline(engine: SimulatedEngine, *extra: Any, **options: Any) -> Pipeline:
    return Pipeline([BuildPrompt(), Loop([Generate(), CallTools(), *extra], max_turns=4)],
                    engine=engine, tokenizer=TOK, tools=make_registry([calculator_tool()]),
                    sampling={"max_tokens": 128}, sample_timeout_s=30, **options)


def assert_only_bad_quarantined(result: Any, reason: str, turn: int) -> str:
    statuses = [s.status for s in result.samples]
    assert statuses == ["completed", "completed", "failed", "completed", "completed"], \
        [s.error for s in result.samples]
    bad = result.samples[2]
    assert bad.masked and bad.finish_reason == "error"
    assert bad.error is not None and f"token integrity: {reason}: turn {turn}: " in bad.error
    assert result.items[2].artifacts[artifacts.TOKEN_INTEGRITY] == reason
    assert result.stats.token_integrity == {reason: 1}
    metrics = batch_metrics(result)
    assert metrics[f"rollout/token_integrity/{reason}"] == 1.0
    assert sum(metrics[f"rollout/token_integrity/{r}"] for r in integrity.REASONS) == 1.0
    assert "token integrity failed" in summary(result)
    for sample in result.samples[:2] + result.samples[3:]:
        assert sample.tool_turns == 1 and not sample.masked
    return bad.error


def engine(cls: type[SimulatedEngine] = SimulatedEngine) -> SimulatedEngine:
    return cls(latency_s=0.0, latency_sigma=0, tail_prob=0, responder=scripted,
               eos_token_id=TOK.eos_token_id)


async def test_loop_decode_check_quarantines_ids_that_decode_to_other_text():
    result = await loop_pipeline(engine(LyingTextEngine)).run_batch(ROWS)
    error = assert_only_bad_quarantined(result, "decode", 1)
    assert "'5'" in error and "'4'" in error and "at character 8" in error


async def test_loop_logprobs_check_quarantines_a_turn_one_logprob_short():
    result = await loop_pipeline(engine(ShortLogprobsEngine)).run_batch(ROWS)
    error = assert_only_bad_quarantined(result, "logprobs", 1)
    assert "9 logprobs for 10 sampled tokens" in error


async def test_loop_prefix_check_quarantines_a_rewritten_history():
    result = await loop_pipeline(engine(), rewrite_history).run_batch(ROWS)
    error = assert_only_bad_quarantined(result, "prefix", 1)
    assert "no longer extends the previous turn" in error


async def test_loop_prefix_check_quarantines_a_replaced_prompt():
    result = await loop_pipeline(engine(), replace_prompt).run_batch(ROWS)
    error = assert_only_bad_quarantined(result, "prefix", 1)
    assert "prompt ids were replaced" in error


async def test_checks_off_lets_the_corruption_through_as_before():
    result = await loop_pipeline(engine(LyingTextEngine),
                                 token_integrity_checks=False).run_batch(ROWS)
    assert result.stats.by_status == {"completed": 5}
    assert result.stats.token_integrity == {}
    assert PipelineConfig.from_dict({"token_integrity_checks": False}).token_integrity_checks \
        is False


async def test_clean_simulated_tool_loop_has_no_mismatch_and_zero_counters():
    result = await loop_pipeline(engine(LyingTextEngine)).run_batch(ROWS[:2] + ROWS[3:], n=3)
    assert result.stats.by_status == {"completed": 12}
    assert result.stats.token_integrity == {}
    metrics = batch_metrics(result)
    for reason in integrity.REASONS:
        assert f"rollout/token_integrity/{reason}" in ALWAYS_KEYS
        assert metrics[f"rollout/token_integrity/{reason}"] == 0.0
    assert "token integrity" not in summary(result)


def test_error_names_reason_turn_and_detail():
    exc = integrity.fail("prefix", 3, "position 7 holds token 1 instead of token 2")
    assert isinstance(exc, TokenIntegrityError)
    assert (exc.reason, exc.turn) == ("prefix", 3)
    assert str(exc) == "token integrity: prefix: turn 3: position 7 holds token 1 instead " \
        "of token 2"
    assert integrity.prefix_mismatch([1, 2, 3], [1, 2, 3, 4]) is None
    assert "position 1" in (integrity.prefix_mismatch([1, 2, 3], [1, 9, 3, 4]) or "")


# ----- the proxy, driven by the real openai SDK ---------------------------------------------

openai = pytest.importorskip("openai")

TASK_TOOLS = TOOLS


async def sdk_agent(endpoint: Any, turns: list[int] | None = None) -> str | None:
    """A plain tool loop on the official SDK: call the model, answer its tool calls with the
    calculator; the number of model calls it took goes to ``turns`` when given."""
    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                                max_retries=0)
    messages = list(endpoint.task["messages"])
    calculator = arith_tools.tools()["calculator"]
    try:
        for turn in range(4):
            reply = await client.chat.completions.create(
                model=endpoint.model, messages=messages, tools=endpoint.task["tools"],
                logprobs=True)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                if turns is not None:
                    turns.append(turn + 1)
                return message.content
            for call in message.tool_calls:
                result = await calculator(json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": str(result)})
    finally:
        await client.close()
    if turns is not None:
        turns.append(4)
    return None


class PrefixCorruptingHistory(History):
    """Renders a merge whose prompt lost one token of the recorded sequence (the BAD
    session only): a proxy that re-tokenized the history instead of extending it."""

    def render(self, match: Any, vision: Any = None) -> Any:
        plan = super().render(match, vision)
        if match.segment is not None and "BAD" in TOK.decode(plan.prompt_ids):
            del plan.prompt_ids[len(match.segment.prompt_ids) + 3]
        return plan


def proxy_rows() -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": r["prompt"]}], "tools": TOOLS}
            for r in ROWS]


async def run_proxy_batch(engine: Any, tokenizer: Any = TOK, rows: list[dict[str, Any]] | None
                          = None, **proxy_options: Any) -> Any:
    async with ProxyServer(engine, tokenizer, model_name="m", **proxy_options) as proxy:
        pipe = Pipeline([RemoteAgent(sdk_agent, proxy=proxy)], engine=engine,
                        tokenizer=tokenizer, sampling={"max_tokens": 128}, sample_timeout_s=60)
        return await pipe.run_batch(rows if rows is not None else proxy_rows())


async def test_proxy_decode_check_quarantines_the_lying_session():
    result = await run_proxy_batch(engine(LyingTextEngine))
    error = assert_only_bad_quarantined(result, "decode", 1)
    assert "proxy session" in error


async def test_proxy_logprobs_check_quarantines_the_short_session():
    result = await run_proxy_batch(engine(ShortLogprobsEngine))
    error = assert_only_bad_quarantined(result, "logprobs", 1)
    assert "9 logprobs for 10 sampled tokens" in error


async def test_proxy_prefix_check_quarantines_a_prompt_that_does_not_extend_the_segment(
        monkeypatch):
    monkeypatch.setattr("pipeline.proxy._sessions.History", PrefixCorruptingHistory)
    result = await run_proxy_batch(engine())
    error = assert_only_bad_quarantined(result, "prefix", 1)
    assert "differs from the previous turn's sequence at position" in error


async def test_proxy_checks_off_an_engine_short_of_logprobs_is_an_engine_error_not_a_crash():
    """With the checks off nothing aligns the logprobs: the turn is refused as the engine's
    fault (502, the counts named), the agent's sample fails with that error, the others
    complete; the proxy never answers 500."""
    result = await run_proxy_batch(engine(ShortLogprobsEngine), token_integrity_checks=False)
    assert result.stats.by_status == {"completed": 4, "failed": 1}, \
        [s.error for s in result.samples]
    (failed,) = [s for s in result.samples if s.status == "failed"]
    assert "9 logprobs for 10 sampled tokens" in (failed.error or ""), failed.error


async def test_proxy_checks_off_and_a_split_is_not_a_mismatch():
    off = await run_proxy_batch(engine(LyingTextEngine), token_integrity_checks=False)
    assert off.stats.by_status == {"completed": 5}
    # a retried request starts a new segment (a documented split): no mismatch
    eng = engine()
    async with ProxyServer(eng, TOK, model_name="m") as proxy:
        session = proxy.create_session()
        client = openai.AsyncOpenAI(base_url=proxy.session_url(session),
                                    api_key=session.api_key)
        messages = [{"role": "user", "content": "what is 2 + 2?"}]
        first = await client.chat.completions.create(model="m", messages=messages,
                                                     tools=TOOLS)
        await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        call = first.choices[0].message
        await client.chat.completions.create(
            model="m", tools=TOOLS, messages=[*messages, call.model_dump(exclude_none=True),
                                              {"role": "tool", "content": "4",
                                               "tool_call_id": call.tool_calls[0].id}])
        await client.close()
        record = proxy.record(session.id)
    assert record.num_splits >= 1 and record.token_integrity == []


# ----- the real tiny model: clean multi-turn tool loops show no mismatch ---------------------

@pytest.fixture(scope="module")
def tiny_policy():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from pipeline.engines.transformers import TransformersEngine
    from pipeline.models import tiny_policy_dir

    return TransformersEngine.from_pretrained(tiny_policy_dir(), max_batch_size=64,
                                              max_model_len=2048)


class ServerText:
    """The real engine, reporting the text a server would (its tokenizer's decode)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str) -> Generation:
        gen = await self.engine.generate(prompt_ids, sampling, request_id)
        text = self.engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        return dataclasses.replace(gen, text=text)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def aclose(self) -> None:
        pass


async def test_tiny_policy_tool_loop_has_no_mismatch(tiny_policy):
    from scenarios.train_tiny_policy import HELDOUT_SEED

    tok = tiny_policy.tokenizer
    pipe = Pipeline(arith_tools.stages(), engine=ServerText(tiny_policy), tokenizer=tok,
                    tools=arith_tools.tools(), seed=3,
                    sampling={"max_tokens": 96, "max_response_tokens": 512})
    result = await pipe.run_batch(arith_tools.rows(12, seed=HELDOUT_SEED), n=2)
    assert result.stats.by_status == {"completed": 24}, [s.error for s in result.samples]
    assert result.stats.tool_turns_max >= 1 and result.stats.tool_calls >= 12
    assert result.stats.token_integrity == {}
    assert all(integrity.MARKS in item.artifacts for item in result.items)  # checks ran


async def test_tiny_policy_through_the_proxy_with_the_openai_sdk_has_no_mismatch(tiny_policy):
    from scenarios.train_tiny_policy import HELDOUT_SEED

    tok = tiny_policy.tokenizer
    rows = arith_tools.rows(8, seed=HELDOUT_SEED)
    turns: list[int] = []

    async with ProxyServer(tiny_policy, tok, model_name="tiny") as proxy:
        pipe = Pipeline([RemoteAgent(functools.partial(sdk_agent, turns=turns), proxy=proxy)],
                        engine=tiny_policy,
                        tokenizer=tok, seed=3, sample_timeout_s=120,
                        sampling={"max_tokens": 96, "max_response_tokens": 512})
        result = await pipe.run_batch(rows, n=2)
    assert result.stats.by_status == {"completed": 16}, [s.error for s in result.samples]
    assert max(turns) >= 2  # multi-turn: tool results went back through the proxy
    assert result.stats.token_integrity == {}


def test_check_helpers_report_what_differs_and_where():
    assert integrity.decode_mismatch("abc", "abc") is None
    assert integrity.decode_mismatch("abcd", "abc", prefix=True) is None
    assert re.search(r"at character 2", integrity.decode_mismatch("abX", "abc") or "")
    assert integrity.logprobs_mismatch([1, 2], [0.1]) == "1 logprobs for 2 sampled tokens"


async def test_proxy_record_lists_the_failure_and_the_agent_view_hides_it():
    from pipeline.proxy._records import agent_view

    async with ProxyServer(engine(ShortLogprobsEngine), TOK, model_name="m") as proxy:
        session = proxy.create_session()
        client = openai.AsyncOpenAI(base_url=proxy.session_url(session),
                                    api_key=session.api_key, max_retries=0)
        messages = [{"role": "user", "content": "BAD: what is 2 + 2?"}]
        first = await client.chat.completions.create(model="m", messages=messages,
                                                     tools=TOOLS)
        call = first.choices[0].message
        second = await client.chat.completions.create(
            model="m", tools=TOOLS, logprobs=True,
            messages=[*messages, call.model_dump(exclude_none=True),
                      {"role": "tool", "content": "4", "tool_call_id": call.tool_calls[0].id}])
        await client.close()
        record = proxy.record(session.id)
    # the agent got its answer (the request did not fail), logprobs aligned with its tokens
    assert second.choices[0].message.content == "Answer: 4"
    assert len(second.choices[0].logprobs.content) == len(TOK.encode("Answer: 4")) + 1
    assert [(f["reason"], f["turn"]) for f in record.token_integrity] == [("logprobs", 1)]
    assert "9 logprobs for 10 sampled tokens" in record.token_integrity[0]["detail"]
    seg = record.segments[-1]
    assert len(seg.logprobs) == len(seg.response_ids)
    assert "token_integrity" not in agent_view(record)
