"""The Responses API (``/v1/responses``) and the field policy of both APIs.

Fast part, over real HTTP on 127.0.0.1 with the simulated engine (named as such) and the
byte-level tokenizer: every field of both APIs has a rule and a row in the proxy guide
(docs/guides/proxy.md), refusals are final and reach no engine, an engine that declares a
constraint gets it, Responses turns record the same tokens as chat turns,
``previous_response_id`` stays inside its session, strict tools, fuzzed bodies never get a 5xx.

Slow part (marked ``slow``, still in CI), on the tiny model: openai-agents on its defaults
(``OpenAIResponsesModel``) and the official SDK's ``responses.create``/``responses.stream`` as
real agent programs of ``RemoteAgent`` under the network audit; every answer < 500 and each
sample token-exact against the engine's own request log (``_proxy_fixtures.run_client``).
"""

from __future__ import annotations

import asyncio
import http.client as httpclient
import importlib.util
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _add_task import SYSTEM, TOOLS
from _proxy_scripted import CALL, TOK, CountingEngine, ThreadedProxy, json_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.proxy import FINAL_ANSWER, SEGMENTS, Constraints, ProxyServer
from pipeline.proxy._policy import CHAT_FIELDS, EXTENSION_FIELDS, RESPONSES_FIELDS

pytest_plugins = ["_model_fixtures"]
# The proxy guide, with a table row per request field (moved there from the README).
GUIDE = Path(__file__).parents[1] / "docs" / "guides" / "proxy.md"
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]
RESP_TOOLS = [{"type": "function", "name": "add",
               "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def post(http: aiohttp.ClientSession, url: str, key: str,
               body: dict[str, Any]) -> tuple[int, Any, Any]:
    async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.headers["Content-Type"].startswith("text/event-stream"):
            return r.status, r.headers, await r.text()
        return r.status, r.headers, await r.json()


def sse_events(text: str) -> list[dict[str, Any]]:
    """Parse ``event:``/``data:`` frames, checking the event name matches the data's type."""
    events = []
    for frame in text.strip().split("\n\n"):
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


# ----- the field policy -------------------------------------------------------------------


def test_every_request_field_of_both_apis_has_a_rule_and_a_row_in_the_guide():
    pytest.importorskip("openai")
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase
    from openai.types.responses.response_create_params import ResponseCreateParamsBase

    for params, rules in ((CompletionCreateParamsBase, CHAT_FIELDS),
                          (ResponseCreateParamsBase, RESPONSES_FIELDS)):
        fields = params.__required_keys__ | params.__optional_keys__ | {"stream"}
        assert fields == set(rules) - EXTENSION_FIELDS, sorted(fields ^ set(rules))
    text = GUIDE.read_text()
    section = text[text.index("## Every request field has a policy"):]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    missing = (set(CHAT_FIELDS) | set(RESPONSES_FIELDS)) - named
    assert not missing, sorted(missing)
    for rule in (*CHAT_FIELDS.values(), *RESPONSES_FIELDS.values()):
        assert rule.policy in ("supported", "no effect", "enforced", "refused")
        assert rule.policy == "supported" or rule.note


CHAT_REFUSED = [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    ({"tools": CHAT_TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": CHAT_TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
     "tool_choice"),
    ({"functions": [{"name": "add", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"top_k": 5}, "top_k"),  # not an OpenAI field: refused, not ignored
    ({"n": 2}, "n"),
]
RESPONSES_REFUSED = [
    ({"text": {"format": {"type": "json_object"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text"),
    ({"tools": RESP_TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tools": RESP_TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": RESP_TOOLS, "tool_choice": {"type": "function", "name": "add"}}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"background": True}, "background"),
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
]
ACCEPTED = {  # defaults and no-effect values: served
    "chat": {"parallel_tool_calls": True, "tool_choice": "auto", "response_format":
             {"type": "text"}, "user": "u", "metadata": {"k": "v"}, "store": False,
             "presence_penalty": 0, "frequency_penalty": None, "n": 1, "modalities": ["text"],
             "stream_options": None, "service_tier": "auto", "prompt_cache_key": "k",
             "reasoning_effort": "high", "verbosity": "low"},  # hints: accepted, listed
    "responses": {"parallel_tool_calls": True, "tool_choice": "auto", "store": False,
                  "text": {"format": {"type": "text"}}, "truncation": "disabled",
                  "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "high"},
                  "user": "u", "metadata": {"k": "v"}, "max_tool_calls": 3,
                  "safety_identifier": "s"},
}


async def test_refused_fields_are_final_and_reach_no_engine(http):
    engine = CountingEngine()
    async with ProxyServer(engine, TOK) as proxy:
        session = proxy.create_session()
        base = proxy.session_url(session)
        cases = [(f"{base}/chat/completions",
                  {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra},
                  param) for extra, param in CHAT_REFUSED]
        cases += [(f"{base}/responses", {"model": "m", "input": "hi", **extra}, param)
                  for extra, param in RESPONSES_REFUSED]
        for url, body, param in cases:
            status, headers, answer = await post(http, url, session.api_key, body)
            assert (status, headers.get("x-should-retry")) == (404, "false"), (body, answer)
            assert answer["error"]["code"] == "unsupported_parameter", answer
            assert answer["error"]["param"] == param, answer
        assert engine.requests == 0 and session.turns == []
        for url, body in ((f"{base}/chat/completions", {"model": "m", "messages": [
                {"role": "user", "content": "hi"}], "tools": CHAT_TOOLS, **ACCEPTED["chat"]}),
                          (f"{base}/responses", {"model": "m", "input": "hi",
                                                 "tools": RESP_TOOLS,
                                                 **ACCEPTED["responses"]})):
            status, _, answer = await post(http, url, session.api_key, body)
            assert status == 200, answer
        assert engine.requests == 2 and engine.constraints == [None, None]


async def test_an_engine_that_declares_a_constraint_gets_it(http):
    engine = CountingEngine(enforces=("json_schema", "tool_choice_required", "not_a_feature"))
    schema = {"type": "object", "properties": {"total": {"type": "integer"}}}
    async with ProxyServer(engine, TOK) as proxy:
        assert proxy.enforces == {"json_schema", "tool_choice_required"}
        session = proxy.create_session()
        base, key = proxy.session_url(session), session.api_key
        status, _, _ = await post(http, f"{base}/chat/completions", key, {
            "messages": [{"role": "user", "content": "hi"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "t", "schema": schema}}})
        assert status == 200
        status, _, _ = await post(http, f"{base}/responses", key, {
            "input": "hi", "tools": RESP_TOOLS, "tool_choice": "required",
            "text": {"format": {"type": "json_schema", "name": "t", "schema": schema}}})
        assert status == 200
        status, _, answer = await post(http, f"{base}/chat/completions", key, {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"}})  # not declared: still refused
        assert status == 404 and answer["error"]["param"] == "response_format"
    chat, responses = engine.constraints
    assert chat == Constraints(frozenset({"json_schema"}), response_format={
        "type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert responses is not None and responses.features == {"json_schema",
                                                            "tool_choice_required"}
    assert responses.response_format == chat.response_format
    assert responses.tool_choice == "required"
    assert responses.tools == [{"type": "function", "function": {
        "name": "add", "parameters": RESP_TOOLS[0]["parameters"]}}]


# ----- Responses turns record what chat turns record ---------------------------------------


async def converse_chat(http: aiohttp.ClientSession, base: str, key: str) -> list[str]:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "please call add"}]
    texts = []
    for _ in range(2):
        status, _, body = await post(http, f"{base}/chat/completions", key,
                                     {"messages": messages, "tools": CHAT_TOOLS})
        assert status == 200, body
        message = body["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or ():
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "1"})
        texts.append(message["content"])
    messages.append({"role": "user", "content": "thanks"})
    status, _, body = await post(http, f"{base}/chat/completions", key,
                                 {"messages": messages, "tools": CHAT_TOOLS})
    texts.append(body["choices"][0]["message"]["content"])
    return texts


async def converse_responses(http: aiohttp.ClientSession, base: str, key: str, *, chain: bool,
                             stream: bool) -> tuple[list[str], list[dict[str, Any]]]:
    items: list[dict[str, Any]] = [{"role": "user", "content": "please call add"}]
    new, previous, texts, finals = list(items), None, [], []
    for turn in range(3):
        body: dict[str, Any] = {"instructions": "be brief", "tools": RESP_TOOLS,
                                "stream": stream}
        body.update({"input": new, "previous_response_id": previous} if chain
                    else {"input": items})
        status, _, answer = await post(http, f"{base}/responses", key, body)
        assert status == 200, answer
        if stream:
            events = sse_events(answer)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            assert events[0]["type"] == "response.created"
            assert events[-1]["type"] == "response.completed"
            answer = events[-1]["response"]
            deltas = "".join(e.get("delta", "") for e in events
                             if e["type"] == "response.output_text.delta")
            assert deltas == "".join(p["text"] for i in answer["output"]
                                     if i["type"] == "message" for p in i["content"])
        finals.append(answer)
        assert answer["status"] == "completed" and answer["usage"]["output_tokens"] > 0
        calls = [i for i in answer["output"] if i["type"] == "function_call"]
        results = [{"type": "function_call_output", "call_id": c["call_id"], "output": "1"}
                   for c in calls]
        texts.append(next((p["text"] for i in answer["output"] if i["type"] == "message"
                           for p in i["content"]), None))
        items += answer["output"] + results
        new, previous = results, answer["id"]
        if turn == 1:
            thanks = {"role": "user", "content": "thanks"}
            items.append(thanks)
            new = [*results, thanks]
    return texts, finals


async def test_responses_turns_record_the_same_tokens_as_chat_turns(http):
    engine = CountingEngine()
    async with ProxyServer(engine, TOK) as proxy:
        sessions = [proxy.create_session() for _ in range(4)]
        urls = [(proxy.session_url(s), s.api_key) for s in sessions]
        chat_texts = await converse_chat(http, *urls[0])
        runs = [await converse_responses(http, *urls[i], chain=chain, stream=stream)
                for i, (chain, stream) in enumerate([(False, False), (True, False),
                                                     (True, True)], start=1)]
        records = [proxy.record(s.id) for s in sessions]
    assert chat_texts == [None, "ack please call add", "ack thanks"]
    for texts, finals in runs:
        assert texts == chat_texts
        assert finals[0]["output"][0]["type"] == "function_call"
        assert finals[0]["output"][0]["name"] == "add"
    reference = records[0]
    (segment,) = reference.segments
    assert len(segment.turns) == 3 and segment.tool_turns == 1
    for record in records[1:]:
        (other,) = record.segments  # one segment: every turn merged, nothing re-tokenized
        assert (other.prompt_ids, other.response_ids, other.response_mask) == (
            segment.prompt_ids, segment.response_ids, segment.response_mask)
        assert [t.merged for t in record.turns] == [False, True, True]
        assert {t.request["api"] for t in record.turns} == {"responses"}
    chained = records[2].turns
    assert chained[1].request["previous_response_id"] == chained[0].request["response_id"]


async def test_previous_response_id_stays_in_its_session(http):
    engine = CountingEngine()
    async with ProxyServer(engine, TOK) as proxy:
        a, b = proxy.create_session(), proxy.create_session()
        status, _, first = await post(http, f"{proxy.session_url(a)}/responses", a.api_key,
                                      {"input": "hello", "instructions": "one"})
        assert status == 200
        for session, rid in ((b, first["id"]), (a, "resp_unknown")):
            status, headers, answer = await post(
                http, f"{proxy.session_url(session)}/responses", session.api_key,
                {"input": "more", "previous_response_id": rid})
            assert (status, headers["x-should-retry"]) == (404, "false")
            assert answer["error"]["code"] == "previous_response_not_found"
        # instructions are not carried over (OpenAI's rule): new ones start a conversation
        status, _, _ = await post(http, f"{proxy.url}/v1/responses", a.api_key, {
            "input": "more", "instructions": "two", "previous_response_id": first["id"]})
        assert status == 200
        record = proxy.record(a.id)
    assert [(s.reason, s.conversation) for s in record.segments] == [
        ("start", 0), ("conversation", 1)]
    assert [m["content"] for m in record.segments[1].messages[:3]] == [
        "two", "hello", "ack hello"]
    assert engine.requests == 2


async def test_logprobs_and_usage_of_a_response_are_the_recorded_ones(http):
    async with ProxyServer(CountingEngine(), TOK, offload_bytes=0) as proxy:  # all off-loop
        session = proxy.create_session()
        url, key = f"{proxy.session_url(session)}/responses", session.api_key
        status, _, answer = await post(http, url, key, {
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "h\u00e9"}]}],
            "include": ["message.output_text.logprobs"], "max_output_tokens": 3})
        record = proxy.record(session.id)
    assert status == 200
    (turn,) = record.turns
    (item,) = answer["output"]
    (part,) = item["content"]
    assert [p["logprob"] for p in part["logprobs"]] == turn.logprobs
    assert answer["usage"]["output_tokens"] == len(turn.response_ids) == 3
    assert answer["usage"]["input_tokens"] == turn.prompt_len
    # cut at max_output_tokens: incomplete, as OpenAI reports it
    assert answer["status"] == "incomplete" and item["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert bytes(b for p in part["logprobs"] for b in p["bytes"]).decode() == part["text"]


async def test_a_call_off_a_strict_tools_schema_comes_back_as_text(http):
    strict = [{"type": "function", "name": "add", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
        "additionalProperties": False}}]
    async with ProxyServer(CountingEngine(), TOK) as proxy:
        session = proxy.create_session()
        url, key = f"{proxy.session_url(session)}/responses", session.api_key
        status, _, answer = await post(http, url, key, {"input": "call", "tools": strict})
        assert status == 200
        (item,) = answer["output"]
        assert item["type"] == "message" and item["content"][0]["text"] == CALL
        loose = [{**strict[0], "strict": False}]
        status, _, answer = await post(http, url, key, {"input": "call", "tools": loose})
        assert [i["type"] for i in answer["output"]] == ["function_call"]
        record = proxy.record(session.id)
    errors = record.turns[0].reply.get("tool_call_errors")
    assert errors and "expected string" in next(iter(errors.values()))


# ----- real clients on the tiny model --------------------------------------------------------

CLIENTS = importlib.util.find_spec("openai") is not None and importlib.util.find_spec(
    "agents") is not None
ROW = {"messages": [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What is 12 plus 30, plus 8?"}], "tools": TOOLS}
needs_clients = pytest.mark.skipif(not CLIENTS, reason="the agent clients (dev extras) are "
                                   "not installed")


def keep_records(proxy: ProxyServer) -> list[Any]:
    """The record of each session, taken as ``RemoteAgent`` deletes it."""
    records: list[Any] = []
    delete = proxy.delete_session

    async def keep(session_id: str) -> None:
        records.append(proxy.record(session_id))
        await delete(session_id)

    proxy.delete_session = keep  # type: ignore[method-assign]
    return records


def check_chaining(records: list[Any], chain: bool) -> None:
    """Every turn came through the Responses API; chained turns named the previous one."""
    (record,) = records
    assert {t.request["api"] for t in record.turns} == {"responses"}
    previous = [t.request["previous_response_id"] for t in record.turns]
    ids = [t.request["response_id"] for t in record.turns]
    assert previous == ([None, *ids[:-1]] if chain else [None] * len(ids))


def check_adding_run(result: Any, turns: int = 3) -> None:
    (item,) = result.items
    (segment,) = item.artifacts[SEGMENTS]  # every turn merged into one token sequence
    assert segment.reason == "start" and len(segment.turns) == turns
    assert segment.tool_turns == turns - 1
    assert item.artifacts[FINAL_ANSWER] in ("Answer: 50", "Answer: 51")


@pytest.mark.parametrize("flags", [[], ["--stream", "--chain"]], ids=["plain", "stream-chain"])
@pytest.mark.slow
@needs_clients
async def test_openai_agents_on_its_default_responses_model(flags, make_engine, tiny_tokenizer,
                                                           tmp_path):
    from _proxy_fixtures import CLIENTS_DIR, RecordingEngine, Script, Served, run_client

    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    served = Served(engine, tok)
    records = keep_records(served.proxy)
    async with served.proxy:
        result, sent = await run_client(
            served, engine, tok, [sys.executable, str(CLIENTS_DIR / "agents_default.py"),
                                  *flags], ROW, tmp_path)
    check_adding_run(result)
    check_chaining(records, "--chain" in flags)
    assert len(sent[0]) == 3


@pytest.mark.slow
@needs_clients
async def test_openai_agents_default_model_with_a_sub_agent(make_engine, tiny_tokenizer,
                                                           tmp_path):
    from _proxy_fixtures import CLIENTS_DIR, RecordingEngine, Script, Served, run_client

    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    served = Served(engine, tok)
    row = {**ROW, "messages": [ROW["messages"][0],
                               {"role": "user", "content": "Use adder: what is 12 plus 30?"}]}
    async with served.proxy:
        result, sent = await run_client(
            served, engine, tok, [sys.executable, str(CLIENTS_DIR / "agents_default.py"),
                                  "--subagent", "--stream"], row, tmp_path)
    (item,) = result.items
    segments = item.artifacts[SEGMENTS]
    assert [(s.reason, s.conversation) for s in segments] == [("start", 0), ("conversation", 1)]
    assert [len(s.turns) for s in segments] == [2, 2] and len(sent[0]) == 4
    assert item.artifacts[FINAL_ANSWER] == "Answer: 42"


@pytest.mark.parametrize("flags", [[], ["--stream"], ["--chain"], ["--stream", "--chain"]],
                         ids=["create", "stream", "create-chain", "stream-chain"])
@pytest.mark.slow
@needs_clients
async def test_sdk_responses_create_and_stream(flags, make_engine, tiny_tokenizer, tmp_path):
    from _proxy_fixtures import CLIENTS_DIR, RecordingEngine, Script, Served, run_client

    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    served = Served(engine, tok)
    records = keep_records(served.proxy)
    async with served.proxy:
        result, sent = await run_client(
            served, engine, tok, [sys.executable, str(CLIENTS_DIR / "responses_agent.py"),
                                  *flags], ROW, tmp_path)
    check_adding_run(result)
    check_chaining(records, "--chain" in flags)
    assert len(sent[0]) == 3


@pytest.mark.slow
@needs_clients
async def test_structured_output_is_refused_at_once_by_real_clients(make_engine,
                                                                   tiny_tokenizer, tmp_path):
    """openai-agents' ``output_type`` (Responses ``text.format`` json_schema) and the SDK's
    ``chat.completions.parse`` (``response_format``): one request each, a final error, the
    client raises; the engine is never called."""
    from _proxy_fixtures import CLIENTS_DIR, RecordingEngine, Script, audit, audited_env

    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    proxy = ProxyServer(engine, tok, model_name="tiny")
    answers: list[tuple[str, int]] = []

    async def seen(request: Any, response: Any) -> None:
        answers.append((request.path.rsplit("/", 1)[-1], response.status))

    proxy.app.on_response_prepare.append(seen)
    log, home = tmp_path / "net.jsonl", tmp_path / "home"
    home.mkdir()
    async with proxy:
        for program, expect in (("agents_default.py", "responses"),
                                ("parse_probe.py", "completions")):
            session = proxy.create_session()
            env = {**os.environ, **audited_env(log, home),
                   "OPENAI_BASE_URL": proxy.session_url(session),
                   "OPENAI_API_KEY": session.api_key, "OPENAI_MODEL": "tiny"}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, str(CLIENTS_DIR / program), "--output-type",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env)
            _, err = await asyncio.wait_for(proc.communicate(json.dumps(ROW).encode()), 100)
            assert proc.returncode != 0 and b"Error code: 404" in err, err[-2000:]
            assert b"refused, not ignored" in err
            assert answers == [(expect, 404)], answers
            answers.clear()
    assert engine.log == {}
    audit(log)


# ----- fuzzed bodies -------------------------------------------------------------------------


parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(
    ["input_text", "output_text", "refusal", "input_image"]), "text": st.text(max_size=8)},
    optional={"refusal": json_values}), max_size=2)
items = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"])},
                          optional={"type": st.just("message"),
                                    "content": st.text(max_size=16) | parts | json_values}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=6),
                           "name": st.text(max_size=6) | json_values,
                           "arguments": st.text(max_size=12) | json_values}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": st.text(max_size=6) | json_values,
                           "output": st.text(max_size=8) | parts | json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference"]) | json_values}),
    json_values)
RESPONSE_OPTIONS = {
    "instructions": st.text(max_size=12) | json_values,
    "tools": st.just(RESP_TOOLS) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "web_search"]) | json_values},
        optional={"name": json_values, "strict": json_values, "parameters": json_values}),
        max_size=2) | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required", "any"]) | json_values,
    "parallel_tool_calls": json_values, "text": json_values, "include": json_values,
    "reasoning": json_values, "previous_response_id": st.text(max_size=8) | json_values,
    "stream": st.booleans() | json_values, "max_output_tokens": st.integers(-2, 50) | json_values,
    "temperature": st.floats(-1, 3) | json_values, "store": json_values,
    "metadata": json_values, "truncation": json_values, "top_k": json_values}
CHAT_OPTIONS = {name: json_values for name in (
    "response_format", "functions", "function_call", "parallel_tool_calls", "tool_choice",
    "presence_penalty", "logit_bias", "modalities", "stream_options", "reasoning_effort",
    "n", "user", "top_k")}
bodies = st.one_of(
    st.fixed_dictionaries({"input": st.text(max_size=12) | st.lists(items, max_size=4)},
                          optional=RESPONSE_OPTIONS).map(lambda v: ("responses", v)),
    st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}])},
                          optional=CHAT_OPTIONS).map(lambda v: ("chat/completions", v)),
    json_values.map(lambda v: ("responses", v)))


def test_fuzzed_bodies_get_4xx_or_a_reply():
    """Hypothesis bodies near the Responses subset, and chat bodies with every policy field at
    random values: never a 5xx; a 200 is a whole response (or its event stream)."""
    with ThreadedProxy() as threaded:
        fuzz(threaded)


@settings(max_examples=200, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=bodies)
def fuzz(threaded: ThreadedProxy, case: tuple[str, Any]) -> None:
    route, body = case
    conn = httpclient.HTTPConnection("127.0.0.1", threaded.port, timeout=10)
    try:
        conn.request("POST", f"/sessions/{threaded.session.id}/v1/{route}",
                     body=json.dumps(body), headers={
                         "Content-Type": "application/json",
                         "Authorization": f"Bearer {threaded.session.api_key}"})
        response = conn.getresponse()
        data = response.read().decode()
    finally:
        conn.close()
    assert response.status < 500, data[:300]
    if response.status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["code"]
    elif route == "responses":
        final = (json.loads(data) if not data.startswith("event:")
                 else sse_events(data)[-1]["response"])
        assert final["object"] == "response" and final["status"] in ("completed", "incomplete")
