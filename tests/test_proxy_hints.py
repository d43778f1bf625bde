"""Request hints the proxy cannot act on (issue 40, item 2): accepted and listed, or refused
with ``strict_fields``; ``reasoning_effort`` becomes the chat-template option where the
template reads it (gpt-oss's).

The official ``openai`` SDK against a real aiohttp proxy on 127.0.0.1, with the simulated
engine (named as such) and the byte-level tokenizer (its template has no options), and the
real gpt-oss tokenizer (the families extra) for the template option.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import aiohttp
import pytest

from pipeline import Pipeline
from pipeline.proxy import AgentEndpoint, ProxyServer, RemoteAgent
from pipeline.testing import ByteTokenizer, SimulatedEngine

openai = pytest.importorskip("openai")

TOK = ByteTokenizer()
USER = [{"role": "user", "content": "hi"}]
# Every hint of chat completions, as the SDK sends them (its own keyword arguments)
CHAT_HINTS: dict[str, Any] = {
    "metadata": {"run": "r1"}, "store": False, "user": "u1", "service_tier": "auto",
    "prompt_cache_key": "k", "safety_identifier": "s", "reasoning_effort": "low",
    "verbosity": "low"}
RESPONSES_HINTS: dict[str, Any] = {
    "metadata": {"run": "r1"}, "store": True, "user": "u1", "service_tier": "auto",
    "prompt_cache_key": "k", "safety_identifier": "s", "max_tool_calls": 2,
    "reasoning": {"effort": "low", "summary": "auto"}, "text": {"verbosity": "high"},
    "include": ["reasoning.encrypted_content"]}
RESPONSES_IGNORED = ["metadata", "store", "user", "service_tier", "prompt_cache_key",
                     "safety_identifier", "max_tool_calls", "reasoning.effort",
                     "reasoning.summary", "text.verbosity",
                     "include.reasoning.encrypted_content"]


def engine_for(tok: Any) -> SimulatedEngine:
    return SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0,
                           eos_token_id=tok.eos_token_id,
                           responder=lambda prompt, rng: [*tok.encode("ok"), tok.eos_token_id])


def client(proxy: ProxyServer, session: Any) -> Any:
    return openai.AsyncOpenAI(base_url=proxy.session_url(session), api_key=session.api_key,
                              max_retries=0)


async def test_hints_are_accepted_and_listed_per_turn_and_per_session():
    async with ProxyServer(engine_for(TOK), TOK) as proxy:
        session = proxy.create_session()
        sdk = client(proxy, session)
        async with sdk:
            await sdk.chat.completions.create(model="m", messages=USER, **CHAT_HINTS)
            await sdk.chat.completions.create(model="m", messages=USER, user="u1",
                                              stream=True, stream_options={
                                                  "include_usage": True,
                                                  "include_obfuscation": False})
            await sdk.responses.create(model="m", input="hi", **RESPONSES_HINTS)
            await sdk.chat.completions.create(model="m", messages=USER)
        record = proxy.record(session.id)
    assert [sorted(t.ignored_fields) for t in record.turns] == [
        sorted(CHAT_HINTS), ["stream_options.include_obfuscation", "user"],
        sorted(RESPONSES_IGNORED), []]
    assert record.ignored_fields["user"] == 3 and record.ignored_fields["metadata"] == 2
    assert record.ignored_fields["reasoning_effort"] == 1 == record.ignored_fields["verbosity"]
    assert set(record.ignored_fields) == {*CHAT_HINTS, *RESPONSES_IGNORED,
                                          "stream_options.include_obfuscation"}
    # the byte tokenizer's template has no options: the hints changed no prompt
    first, last = (record.segments[t.segment].prompt_ids for t in (record.turns[0],
                                                                   record.turns[-1]))
    assert first == last


async def test_the_sample_lists_the_hints_its_session_ignored():
    async def agent(endpoint: AgentEndpoint) -> str:
        sdk = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key,
                                 max_retries=0)
        async with sdk:
            await sdk.chat.completions.create(model=endpoint.model, messages=USER,
                                              metadata={"k": "v"}, reasoning_effort="high")
            reply = await sdk.chat.completions.create(model=endpoint.model, messages=USER,
                                                      verbosity="low")
        return reply.choices[0].message.content or ""

    engine = engine_for(TOK)
    async with ProxyServer(engine, TOK) as proxy:
        pipe = Pipeline([RemoteAgent(agent, proxy=proxy)], engine=engine, tokenizer=TOK)
        result = await pipe.run_batch([{"messages": USER}])
    (sample,) = result.samples
    assert sample.extra_fields["ignored_fields"] == ["metadata", "reasoning_effort",
                                                     "verbosity"]
    # and the batch statistics count the samples per hint
    assert result.stats.ignored_fields == {"metadata": 1, "reasoning_effort": 1,
                                           "verbosity": 1}


async def test_strict_fields_refuses_every_ignored_hint_finally():
    engine = engine_for(TOK)
    async with ProxyServer(engine, TOK, strict_fields=True) as proxy:
        session = proxy.create_session()
        cases = [("chat/completions", {"messages": USER, name: value}, name)
                 for name, value in CHAT_HINTS.items()]
        cases += [("responses", {"input": "hi", name: value}, path)
                  for name, value in RESPONSES_HINTS.items()
                  for path in [next(p for p in RESPONSES_IGNORED if p.split(".")[0] == name)]]
        async with aiohttp.ClientSession() as http:
            for route, body, param in cases:
                async with http.post(f"{proxy.session_url(session)}/{route}",
                                     json={"model": "m", **body},
                                     headers={"Authorization": f"Bearer {session.api_key}"}
                                     ) as r:
                    answer = await r.json()
                    assert (r.status, r.headers.get("x-should-retry")) == (404, "false"), body
                assert answer["error"]["code"] == "unsupported_parameter", answer
                assert answer["error"]["param"] == param, answer
                assert "strict_fields" in answer["error"]["message"]
            # nulls are not hints: served under strict_fields too
            async with http.post(f"{proxy.session_url(session)}/chat/completions",
                                 json={"model": "m", "messages": USER, "user": None,
                                       "reasoning_effort": None, "metadata": None},
                                 headers={"Authorization": f"Bearer {session.api_key}"}) as r:
                assert r.status == 200, await r.text()
        assert len(session.turns) == 1


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("chat/completions", {"reasoning_effort": 5}, "reasoning_effort"),
    ("chat/completions", {"reasoning_effort": "max"}, "reasoning_effort"),
    ("chat/completions", {"verbosity": "loud"}, "verbosity"),
    ("responses", {"reasoning": "low"}, "reasoning"),
    ("responses", {"reasoning": {"effort": "max"}}, "reasoning"),
    ("responses", {"text": {"verbosity": 3}}, "text"),
])
async def test_bad_hint_values_are_400s_naming_the_field(route, extra, param):
    async with ProxyServer(engine_for(TOK), TOK) as proxy:
        session = proxy.create_session()
        base = {"messages": USER} if route.startswith("chat") else {"input": "hi"}
        async with aiohttp.ClientSession() as http, http.post(
                f"{proxy.session_url(session)}/{route}", json={"model": "m", **base, **extra},
                headers={"Authorization": f"Bearer {session.api_key}"}) as r:
            answer = await r.json()
        assert r.status == 400, answer
        assert answer["error"]["param"] == param and param in answer["error"]["message"]
        assert session.turns == []


@pytest.mark.skipif(importlib.util.find_spec("quicktok") is None,
                    reason="needs the families extra (gpt-oss's vocabulary)")
async def test_reasoning_effort_becomes_the_template_option_where_the_template_reads_it(
        family_tokenizers):
    tok = family_tokenizers["gpt-oss"]
    async with ProxyServer(engine_for(tok), tok, strict_fields=True) as proxy:
        assert proxy.template_hints == {"reasoning_effort"}
        session = proxy.create_session()
        sdk = client(proxy, session)
        async with sdk:
            await sdk.chat.completions.create(model="m", messages=USER, reasoning_effort="low")
            await sdk.responses.create(model="m", input="hi", reasoning={"effort": "high"})
            # the agent's own chat_template_kwargs win over the hint
            await sdk.chat.completions.create(
                model="m", messages=USER, reasoning_effort="low",
                extra_body={"chat_template_kwargs": {"reasoning_effort": "medium"}})
            with pytest.raises(openai.NotFoundError) as refused:  # strict: summary ignored
                await sdk.responses.create(model="m", input="hi",
                                           reasoning={"effort": "low", "summary": "auto"})
        record = proxy.record(session.id)
    assert refused.value.body["param"] == "reasoning.summary"
    prompts = [tok.decode(proxy_prompt) for proxy_prompt in (
        record.segments[t.segment].prompt_ids for t in record.turns)]
    assert ["Reasoning: low" in prompts[0], "Reasoning: high" in prompts[1],
            "Reasoning: medium" in prompts[2]] == [True, True, True]
    assert all(t.ignored_fields == [] for t in record.turns) and record.ignored_fields == {}
    # another effort is another template option: a new segment, not a merge
    assert [t.split_reason for t in record.turns][1:] == ["tools_changed", "tools_changed"]
