"""Anthropic's Messages API (``/v1/messages``, issue 40 item 3).

Fast part, over real HTTP on 127.0.0.1 with the simulated engine (named as such) and the
byte-level tokenizer, the official ``anthropic`` SDK as the client: every Messages field has a
rule and a row in the proxy guide; a Messages tool loop (created and streamed) records the same
segment, token for token, as the same conversation over chat; the stream is the event sequence
the SDK accumulates; refusals and bad bodies are final or 4xx errors in Anthropic's shape and
reach no engine; constraints reach an engine that declares them; keys work as ``x-api-key``;
fuzzed bodies never get a 5xx.

Slow part (marked ``slow``, still in CI), on the tiny model: an ``anthropic`` SDK tool loop
(``messages.create`` and ``messages.stream``) as the agent program of ``RemoteAgent`` under the
network audit, every answer < 500 and the sample token-exact against the engine's own request
log (``_proxy_fixtures.run_client``).
"""

from __future__ import annotations

import http.client as httpclient
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from _proxy_scripted import TOK, CountingEngine, ThreadedProxy, json_values
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.proxy import FINAL_ANSWER, SEGMENTS, Constraints, ProxyServer
from pipeline.proxy._policy_messages import MESSAGES_EXTENSION_FIELDS, MESSAGES_FIELDS

anthropic = pytest.importorskip("anthropic")  # the dev extra

pytest_plugins = ["_model_fixtures"]
GUIDE = Path(__file__).parents[1] / "docs" / "guides" / "proxy.md"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOLS = [{"name": "add", "description": "Add.", "input_schema": SCHEMA,
          "cache_control": {"type": "ephemeral"}}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": SCHEMA,
                                                "description": "Add."}}]
BILLING = "x-anthropic-billing-header"  # Claude Code's first system block: a hash per request


def client(proxy: ProxyServer, session: Any) -> Any:
    """The official SDK on a session (its base URL has no ``/v1``; the key goes as
    ``x-api-key``)."""
    return anthropic.AsyncAnthropic(base_url=proxy.session_url(session).removesuffix("/v1"),
                                    api_key=session.api_key, max_retries=0)


# ----- the field policy -------------------------------------------------------------------


def test_every_messages_field_has_a_rule_and_a_row_in_the_guide():
    from anthropic.types.message_create_params import MessageCreateParamsBase

    fields = MessageCreateParamsBase.__required_keys__ | MessageCreateParamsBase.__optional_keys__
    assert fields == set(MESSAGES_FIELDS) - MESSAGES_EXTENSION_FIELDS, sorted(
        fields ^ set(MESSAGES_FIELDS))
    text = GUIDE.read_text()
    section = text[text.index("### Messages"):]
    section = section[:section.index("\n## ")]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert set(MESSAGES_FIELDS) <= named, sorted(set(MESSAGES_FIELDS) - named)
    for rule in MESSAGES_FIELDS.values():
        assert rule.policy == "supported" or rule.note


# ----- a Messages tool loop records what a chat tool loop records -------------------------


async def converse_messages(proxy: ProxyServer, session: Any, *, stream: bool) -> list[Any]:
    async with client(proxy, session) as sdk:
        return await _converse(sdk, stream=stream)


async def _converse(sdk: Any, *, stream: bool) -> list[Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": "please call add", "cache_control": {"type": "ephemeral"}}]}]
    replies = []
    for turn in range(3):
        request = {"model": "m", "max_tokens": 400, "messages": messages, "tools": TOOLS,
                   "system": [{"type": "text", "text": f"{BILLING}: cch={turn};"},
                              {"type": "text", "text": "be brief"}]}
        if stream:
            async with sdk.messages.stream(**request) as events:
                kinds = [event.type async for event in events]
                reply = await events.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert "message_delta" in kinds and "content_block_stop" in kinds
        else:
            reply = await sdk.messages.create(**request)
        replies.append(reply)
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        calls = [b for b in reply.content if b.type == "tool_use"]
        results = [{"type": "tool_result", "tool_use_id": c.id, "content": "1"} for c in calls]
        if turn == 0:
            messages.append({"role": "user", "content": results})
        else:
            messages.append({"role": "user", "content": "thanks"})
    return replies


async def converse_chat(proxy: ProxyServer, session: Any) -> None:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=proxy.session_url(session), api_key=session.api_key,
                           max_retries=0) as sdk:
        await _converse_chat(sdk)


async def _converse_chat(sdk: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "please call add"}]
    for turn in range(3):
        reply = await sdk.chat.completions.create(model="m", messages=messages,  # type: ignore
                                                  tools=CHAT_TOOLS, max_tokens=400)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if turn == 0:
            messages += [{"role": "tool", "tool_call_id": c.id, "content": "1"}
                         for c in message.tool_calls or ()]
        else:
            messages.append({"role": "user", "content": "thanks"})


async def test_a_messages_tool_loop_records_the_chat_loops_tokens():
    """Created and streamed through the SDK, a Messages conversation is the chat one token for
    token (one segment, every turn merged), with Anthropic's blocks and stop reasons; the
    billing header (a new hash per request) and ``cache_control`` are listed, not rendered."""
    engine = CountingEngine()
    async with ProxyServer(engine, TOK) as proxy:
        sessions = [proxy.create_session() for _ in range(3)]
        await converse_chat(proxy, sessions[0])
        created = await converse_messages(proxy, sessions[1], stream=False)
        streamed = await converse_messages(proxy, sessions[2], stream=True)
        records = [proxy.record(s.id) for s in sessions]
    for replies in (created, streamed):
        first, second, third = replies
        assert first.stop_reason == "tool_use" and [b.type for b in first.content] == [
            "tool_use"]
        assert (first.content[0].name, first.content[0].input) == ("add", {"a": 1})
        assert second.stop_reason == "end_turn" and second.content[0].text == "ack please call add"
        assert third.content[0].text == "ack thanks"
        assert second.usage.cache_read_input_tokens > 0  # the recorded prefix, reused
    assert [b.model_dump() for r in created for b in r.content] == [
        b.model_dump() for r in streamed for b in r.content]
    (reference,) = records[0].segments
    assert len(reference.turns) == 3 and reference.tool_turns == 1
    for record in records[1:]:
        (segment,) = record.segments
        assert (segment.prompt_ids, segment.response_ids, segment.response_mask) == (
            reference.prompt_ids, reference.response_ids, reference.response_mask)
        assert [t.merged for t in record.turns] == [False, True, True]
        assert {t.request["api"] for t in record.turns} == {"messages"}
        assert [t.ignored_fields for t in record.turns] == [
            ["cache_control", "system.x-anthropic-billing-header"]] * 3
    assert "billing" not in TOK.decode(records[1].segments[0].prompt_ids)


async def test_stop_sequences_and_max_tokens_give_anthropics_stop_reasons():
    engine = CountingEngine()
    async with ProxyServer(engine, TOK) as proxy:
        hello = [{"role": "user", "content": "hello there"}]
        async with client(proxy, proxy.create_session()) as sdk:
            cut = await sdk.messages.create(model="m", max_tokens=50, messages=hello,
                                            stop_sequences=["there"])
            short = await sdk.messages.create(model="m", max_tokens=3, messages=hello)
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == (
        "stop_sequence", "there", "ack hello ")
    assert (short.stop_reason, short.usage.output_tokens) == ("max_tokens", 3)


# ----- refusals, errors, keys ------------------------------------------------------------

MESSAGE = [{"role": "user", "content": "hi"}]
REFUSED = [  # (extra fields, the field the error names)
    ({"tools": TOOLS, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "add"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     "tool_choice"),
    ({"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "output_config"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"top_k": 5}, "top_k"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"container": "c1"}, "container"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),  # an OpenAI field: unknown here
]
ACCEPTED = {"metadata": {"user_id": "u"}, "service_tier": "auto",
            "thinking": {"type": "disabled"}, "cache_control": {"type": "ephemeral"},
            "tool_choice": {"type": "auto"}, "temperature": 0.5, "speed": "standard",
            "output_config": {"effort": "low"}}


async def test_refusals_and_bad_bodies_are_errors_in_anthropics_shape():
    engine = CountingEngine()
    async with ProxyServer(engine, TOK, api_key="server-key") as proxy:
        session = proxy.create_session()
        async with client(proxy, session) as sdk:
            await _refusals(sdk)
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="wrong",
                                            max_retries=0) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as caught:
                await wrong.messages.create(model="m", max_tokens=8, messages=MESSAGE)
        assert caught.value.body["error"]["type"] == "authentication_error"
        assert engine.requests == 0 and session.turns == []
        # the session's key as x-api-key opens the top-level route too; hints are listed
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key=session.api_key,
                                            max_retries=0) as top:
            reply = await top.messages.create(model="m", max_tokens=8, messages=MESSAGE,
                                              tools=TOOLS, extra_body=ACCEPTED)
        assert reply.content[0].text.startswith("ack")
        (turn,) = proxy.record(session.id).turns
        assert sorted(turn.ignored_fields) == ["cache_control", "metadata",
                                               "output_config.effort", "service_tier", "speed",
                                               "thinking"]
    assert engine.constraints == [None]


async def _refusals(sdk: Any) -> None:
    for extra, param in REFUSED:
        with pytest.raises(anthropic.NotFoundError) as caught:  # final: not retried
            await sdk.messages.create(model="m", max_tokens=8, messages=MESSAGE,
                                      extra_body=extra)
        error = caught.value
        assert error.response.headers["x-should-retry"] == "false"
        assert error.body["type"] == "error", error.body
        assert error.body["error"]["type"] == "invalid_request_error"
        assert repr(param) in error.body["error"]["message"] or error.body["error"][
            "message"].startswith(param), error.body
    bad = [({"messages": MESSAGE}, "max_tokens"),  # required
           ({"max_tokens": 8, "messages": [{"role": "user", "content": [
               {"type": "document", "source": {}}]}]}, "messages.0.content.0"),
           ({"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]},
            "messages.0.role"),
           ({"max_tokens": 8, "messages": MESSAGE, "temperature": 1.5}, "temperature"),
           ({"max_tokens": 8, "messages": MESSAGE, "stop_sequences": list("abcde")},
            "stop_sequences"),
           ({"max_tokens": 8, "messages": [{"role": "user", "content": [
               {"type": "tool_result", "tool_use_id": 3}]}]},
            "messages.0.content.0.tool_use_id")]
    for body, param in bad:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await sdk.post("/v1/messages", cast_to=object, body={"model": "m", **body})
        assert caught.value.body["error"]["type"] == "invalid_request_error"
        assert caught.value.body["error"]["message"].startswith(param), caught.value.body


async def test_strict_fields_refuses_cache_control_on_blocks():
    async with ProxyServer(CountingEngine(), TOK, strict_fields=True) as proxy:
        async with client(proxy, proxy.create_session()) as sdk:
            with pytest.raises(anthropic.NotFoundError) as caught:
                await sdk.messages.create(model="m", max_tokens=8, messages=[
                    {"role": "user", "content": [{"type": "text", "text": "hi",
                                                  "cache_control": {"type": "ephemeral"}}]}])
        assert caught.value.body["error"]["message"].startswith("cache_control")


async def test_an_engine_that_declares_the_constraints_gets_them():
    engine = CountingEngine(enforces=("tool_choice_function", "single_tool_call",
                                      "json_schema"))
    async with ProxyServer(engine, TOK) as proxy, client(proxy,
                                                         proxy.create_session()) as sdk:
        await sdk.messages.create(model="m", max_tokens=8, messages=MESSAGE, tools=TOOLS,
                                  tool_choice={"type": "tool", "name": "add",
                                               "disable_parallel_tool_use": True})
        await sdk.messages.create(model="m", max_tokens=8, messages=MESSAGE, extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    named, schema = engine.constraints
    assert named is not None and named.features == {"tool_choice_function", "single_tool_call"}
    assert named.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert named.tools == CHAT_TOOLS
    assert schema == Constraints(frozenset({"json_schema"}), response_format={
        "type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA,
                                               "strict": True}})


# ----- fuzzed bodies -------------------------------------------------------------------------


blocks = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8) | json_values},
                          optional={"cache_control": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(max_size=6) | json_values,
                           "name": st.text(max_size=6) | json_values,
                           "input": st.just({"a": 1}) | json_values}),
    st.fixed_dictionaries({"type": st.just("tool_result"),
                           "tool_use_id": st.text(max_size=6) | json_values},
                          optional={"content": st.text(max_size=8) | json_values,
                                    "is_error": json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "redacted_thinking"])
                           | json_values}, optional={"thinking": json_values}),
    json_values)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | json_values},
    optional={"content": st.text(max_size=12) | st.lists(blocks, max_size=3) | json_values}),
    max_size=4)
OPTIONS = {
    "system": st.text(max_size=12) | st.lists(blocks, max_size=2) | json_values,
    "tools": st.just(TOOLS) | st.lists(st.fixed_dictionaries(
        {"name": json_values}, optional={"type": json_values, "input_schema": json_values}),
        max_size=2) | json_values,
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}])
    | json_values,
    "stop_sequences": st.lists(st.text(max_size=3), max_size=5) | json_values,
    "stream": st.booleans() | json_values, "temperature": st.floats(-1, 2) | json_values,
    **{name: json_values for name in ("metadata", "thinking", "output_config", "cache_control",
                                      "top_k", "service_tier", "speed")}}
bodies = st.one_of(
    st.fixed_dictionaries({"messages": messages, "max_tokens": st.integers(-2, 40)
                           | json_values}, optional=OPTIONS),
    json_values)


def test_fuzzed_bodies_get_4xx_in_anthropics_shape_or_a_reply():
    """Hypothesis bodies near the Messages subset: never a 5xx; an error is Anthropic's
    shape; a 200 is a whole message (or its event stream)."""
    with ThreadedProxy() as threaded:
        fuzz(threaded)


@settings(max_examples=200, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=bodies)
def fuzz(threaded: ThreadedProxy, body: Any) -> None:
    conn = httpclient.HTTPConnection("127.0.0.1", threaded.port, timeout=10)
    try:
        conn.request("POST", f"/sessions/{threaded.session.id}/v1/messages",
                     body=json.dumps(body), headers={"Content-Type": "application/json",
                                                     "x-api-key": threaded.session.api_key})
        response = conn.getresponse()
        data = response.read().decode()
    finally:
        conn.close()
    assert response.status < 500, data[:300]
    if response.status >= 400:
        answer = json.loads(data)
        assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}
    elif data.startswith("event:"):
        assert data.rstrip().endswith('data: {"type":"message_stop"}'), data[-200:]
    else:
        assert json.loads(data)["type"] == "message"


# ----- the anthropic SDK as a real agent program, on the tiny model ------------------------


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--stream"]], ids=["create", "stream"])
async def test_anthropic_sdk_tool_loop_is_token_exact(flags, make_engine, tiny_tokenizer,
                                                      tmp_path):
    from _add_task import SYSTEM
    from _add_task import TOOLS as ADD_TOOLS
    from _proxy_fixtures import CLIENTS_DIR, RecordingEngine, Script, Served, run_client

    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    served = Served(engine, tok)
    row = {"messages": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "What is 12 plus 30, plus 8?"}],
           "tools": ADD_TOOLS}
    async with served.proxy:
        result, sent = await run_client(
            served, engine, tok, [sys.executable, str(CLIENTS_DIR / "anthropic_agent.py"),
                                  *flags], row, tmp_path)
    (item,) = result.items
    (segment,) = item.artifacts[SEGMENTS]  # three turns, one token sequence
    assert segment.reason == "start" and len(segment.turns) == 3 == len(sent[0])
    assert segment.tool_turns == 2
    assert item.artifacts[FINAL_ANSWER] in ("Answer: 50", "Answer: 51")
    assert result.samples[0].extra_fields["ignored_fields"] == ["cache_control"]


class ClaudeScript:
    """The shared script, its calls to ``add`` renamed as Claude Code names the SDK's MCP tool
    (``mcp__calc__add``)."""

    def __init__(self, tokenizer: Any) -> None:
        from _proxy_fixtures import Script

        self.script = Script(tokenizer)

    def __call__(self, request_id: str, prompt_ids: list[int]) -> Any:
        from _model_fixtures import ForcedText

        tok = self.script.tokenizer
        texts = [t.replace('"name": "add"', '"name": "mcp__calc__add"')
                 for t in self.script.texts(prompt_ids)]
        return ForcedText([tok.encode(t) for t in texts], tok.eos_token_id)


def strace_connects(path: Path) -> list[str]:
    """The internet-family ``connect`` calls strace recorded (Unix sockets left out)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [line for line in lines if "connect(" in line and "AF_UNIX" not in line]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace audits the Claude Code CLI")
async def test_claude_code_through_claude_agent_sdk_is_token_exact(make_engine, tiny_tokenizer,
                                                                   tmp_path):
    """Claude Code (the CLI ``claude-agent-sdk`` bundles) runs a tool loop against the proxy:
    its requests (inline system messages, ``cache_control``, ``context_management``,
    adaptive ``thinking``, its billing header) are served, the sample is token-exact, and the
    CLI connected to nothing but 127.0.0.1."""
    pytest.importorskip("claude_agent_sdk")
    from _add_task import SYSTEM
    from _add_task import TOOLS as ADD_TOOLS
    from _proxy_fixtures import CLIENTS_DIR, RecordingEngine, Served, run_client

    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=ClaudeScript(tok)))
    served = Served(engine, tok)
    row = {"messages": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "What is 12 plus 30, plus 8?"}],
           "tools": ADD_TOOLS}
    async with served.proxy:
        result, sent = await run_client(
            served, engine, tok, [sys.executable, str(CLIENTS_DIR / "claude_agent.py")], row,
            tmp_path)
    # the CLI's connects (strace's, turned into audit records by the agent program) were
    # checked by run_client with the Python ones: here, that there were some
    assert strace_connects(tmp_path / "net.jsonl.strace")
    (item,) = result.items
    segments = item.artifacts[SEGMENTS]
    assert [len(s.turns) for s in segments] == [3] and len(sent[0]) == 3
    assert segments[0].tool_turns == 2
    assert item.artifacts[FINAL_ANSWER] in ("Answer: 50", "Answer: 51")
    assert {"cache_control", "context_management", "system.x-anthropic-billing-header",
            "thinking"} <= set(result.samples[0].extra_fields["ignored_fields"])
