"""Issue 33, item 7b and 7c, over real HTTP on 127.0.0.1 with the simulated engine and the
byte-level tokenizer.

7b: a request value the proxy must validate never reaches the model through ``str()``: every
text part whose text is null or not a string, in Responses and chat bodies alike, is a 400
naming the field's path, and the engine is not called.

7c: a ``ProxyServer`` pairs its engine with its tokenizer through the same check as a
``Pipeline`` (``check_resources``): a ``SimulatedEngine`` built without ``eos_token_id``
stops on the tokenizer's eos, one with another eos is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pipeline import ConfigError
from pipeline.proxy import ProxyServer
from pipeline.testing import ByteTokenizer, SimulatedEngine

TOK = ByteTokenizer()


class CountingEngine(SimulatedEngine):
    """The simulated engine, keeping every prompt it was sent."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str, **kw: Any) -> Any:
        self.prompts.append(list(prompt_ids))
        return await super().generate(prompt_ids, sampling, request_id, **kw)


def ok(prompt_ids: list[int], rng: Any) -> list[int]:
    return [*TOK.encode("ok"), TOK.eos_token_id]


@pytest.fixture
async def served() -> AsyncIterator[tuple[ProxyServer, CountingEngine, aiohttp.ClientSession]]:
    engine = CountingEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0, responder=ok,
                            eos_token_id=TOK.eos_token_id)
    async with ProxyServer(engine, TOK) as proxy, aiohttp.ClientSession() as http:
        yield proxy, engine, http


async def post(proxy: ProxyServer, http: aiohttp.ClientSession, route: str,
               body: dict[str, Any]) -> tuple[int, Any]:
    session = proxy.create_session()
    async with http.post(f"{proxy.session_url(session)}/{route}", json=body,
                         headers={"Authorization": f"Bearer {session.api_key}"}) as r:
        return r.status, await r.json()


def part(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, **fields}


BAD_TEXTS = [None, 5, ["a"], {"t": "a"}, True]
RESPONSES_CASES: list[tuple[str, list[Any], str]] = [
    # (name, input, the path the 400 names)
    *[(f"input_text={v!r}", [{"role": "user", "content": [part("input_text", text=v)]}],
       "input.0.content.0.text") for v in BAD_TEXTS],
    ("input_text missing", [{"role": "user", "content": [part("input_text")]}],
     "input.0.content.0.text"),
    ("second part", [{"role": "user", "content": [part("input_text", text="a"),
                                                  part("input_text", text=None)]}],
     "input.0.content.1.text"),
    ("output_text", [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [part("output_text", text=None)]}],
     "input.1.content.0.text"),
    ("refusal", [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": [part("refusal", refusal=None)]}],
     "input.1.content.0.refusal"),
    ("typed message", [{"type": "message", "role": "user",
                        "content": [part("input_text", text=None)]}],
     "input.0.content.0.text"),
    ("function_call_output parts", [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [part("input_text", text=None)]}], "input.2.output.0.text"),
    ("function_call_output null", [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": None}], "input.2.output"),
    ("function_call call_id", [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": 7, "name": "add", "arguments": "{}"}],
     "input.1.call_id"),
]


@pytest.mark.parametrize("case", RESPONSES_CASES, ids=[c[0] for c in RESPONSES_CASES])
async def test_item7_responses_null_text_is_a_400_naming_the_path(served, case):
    proxy, engine, http = served
    _, items, path = case
    status, body = await post(proxy, http, "responses", {"model": "m", "input": items})
    assert status == 400, body
    assert body["error"]["param"] == path and path in body["error"]["message"], body
    assert engine.prompts == []  # nothing reached the model, "None" least of all


CHAT_CASES: list[tuple[str, list[Any], str]] = [
    *[(f"text={v!r}", [{"role": "user", "content": [part("text", text=v)]}],
       "messages.0.content.0.text") for v in BAD_TEXTS],
    ("text missing", [{"role": "user", "content": [part("text")]}], "messages.0.content.0.text"),
    ("system part", [{"role": "system", "content": "s"},
                     {"role": "user", "content": [part("text", text="a"),
                                                  part("text", text=None)]}],
     "messages.1.content.1.text"),
    ("tool part", [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function",
                        "function": {"name": "add", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "c1",
                    "content": [part("text", text=None)]}], "messages.2.content.0.text"),
    ("tool call id", [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": 7, "type": "function",
                           "function": {"name": "add", "arguments": "{}"}}]}],
     "messages.1.tool_calls.0.id"),
    ("content number", [{"role": "user", "content": 5}], "messages.0.content"),
]


@pytest.mark.parametrize("case", CHAT_CASES, ids=[c[0] for c in CHAT_CASES])
async def test_item7_chat_null_text_is_a_400_naming_the_path(served, case):
    proxy, engine, http = served
    _, messages, path = case
    status, body = await post(proxy, http, "chat/completions",
                              {"model": "m", "messages": messages})
    assert status == 400, body
    assert body["error"]["param"] == path and path in body["error"]["message"], body
    assert engine.prompts == []


async def test_item7_a_recorded_reply_sent_back_with_null_text_is_a_400(served):
    """The history path: a reply the proxy recorded, sent back with its text part null (or
    the model literally said "None"), is validated, not matched by its str() and reused."""
    proxy, engine, http = served
    session = proxy.create_session()
    url = f"{proxy.session_url(session)}/chat/completions"
    headers = {"Authorization": f"Bearer {session.api_key}"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    async with http.post(url, json={"messages": messages}, headers=headers) as r:
        reply = (await r.json())["choices"][0]["message"]
    sent = len(engine.prompts)
    messages += [{"role": "assistant", "content": [part("text", text=None)]},
                 {"role": "user", "content": "again"}]
    async with http.post(url, json={"messages": messages}, headers=headers) as r:
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "messages.1.content.0.text", body
    assert len(engine.prompts) == sent and reply["content"] == "ok"


async def test_item7_values_that_are_valid_still_reach_the_model_as_sent(served):
    """The fix refuses nothing valid: text parts of both APIs render their text."""
    proxy, engine, http = served
    status, _ = await post(proxy, http, "responses", {"input": [
        {"role": "user", "content": [part("input_text", text="ab"),
                                     part("input_text", text="cd")]}]})
    status2, _ = await post(proxy, http, "chat/completions", {"messages": [
        {"role": "user", "content": [part("text", text="ab"), part("text", text="cd")]}]})
    assert status == status2 == 200
    first, second = (TOK.decode(p) for p in engine.prompts)
    assert "abcd" in first and first == second and "None" not in first


# ----- 7c: the engine's eos is paired with the tokenizer's ------------------------------------


async def test_item7_proxy_simulated_engine_without_eos_stops_on_the_tokenizers():
    """A 6-token reply that ends on the tokenizer's eos ends ``stop`` after 6 tokens, not
    ``length`` at ``max_tokens``."""
    def six(prompt_ids: list[int], rng: Any) -> list[int]:
        return [*TOK.encode("hello"), TOK.eos_token_id]

    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0, responder=six)
    async with ProxyServer(engine, TOK) as proxy, aiohttp.ClientSession() as http:
        status, body = await post(proxy, http, "chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["message"]["content"] == "hello"
    assert engine.eos_token_id == TOK.eos_token_id


def test_item7_proxy_refuses_a_simulated_engine_with_another_eos():
    engine = SimulatedEngine(eos_token_id=TOK.eos_token_id + 1)
    with pytest.raises(ConfigError, match="eos"):
        ProxyServer(engine, TOK)


def test_item7_proxy_refuses_what_a_pipeline_refuses():
    """The same resource check as a Pipeline: a class, a name or a non-engine is refused at
    construction with the Pipeline's sentence."""
    with pytest.raises(ConfigError, match="is a class"):
        ProxyServer(SimulatedEngine, TOK)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="is a name, not an engine"):
        ProxyServer("vllm", TOK)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a tokenizer"):
        ProxyServer(SimulatedEngine(), object())  # type: ignore[arg-type]


class Wrapper:
    """An engine wrapper that holds its engine in ``.engine`` (as recorders do)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str) -> Any:
        return await self.engine.generate(prompt_ids, sampling, request_id)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def aclose(self) -> None:
        await self.engine.aclose()


def test_item7_a_wrapped_simulated_engine_is_paired_too():
    inner = SimulatedEngine()
    ProxyServer(Wrapper(Wrapper(inner)), TOK)
    assert inner.eos_token_id == TOK.eos_token_id
    with pytest.raises(ConfigError, match="eos"):
        ProxyServer(Wrapper(SimulatedEngine(eos_token_id=TOK.eos_token_id + 1)), TOK)


class EnforcingEngine(CountingEngine):
    """Declares every constraint, so a named tool_choice reaches the engine if let through."""

    enforces = ("tool_choice_function",)


@pytest.mark.parametrize(("route", "choice"), [
    ("chat/completions", {"type": "function", "function": {"name": None}}),
    ("chat/completions", {"type": "function", "function": {"name": 5}}),
    ("chat/completions", {"type": "function"}),
    ("responses", {"type": "function", "name": None}),
    ("responses", {"type": "function"}),
])
async def test_item7_a_named_tool_choice_without_a_string_name_is_a_400(route, choice):
    """The same class: a null name reached the engine's constraint as None."""
    engine = EnforcingEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0, responder=ok,
                             eos_token_id=TOK.eos_token_id)
    tools = ([{"type": "function", "function": {"name": "add"}}] if route.startswith("chat")
             else [{"type": "function", "name": "add"}])
    body = {"tools": tools, "tool_choice": choice, **(
        {"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat")
        else {"input": "hi"})}
    async with ProxyServer(engine, TOK) as proxy, aiohttp.ClientSession() as http:
        status, answer = await post(proxy, http, route, body)
    assert status == 400 and answer["error"]["param"].startswith("tool_choice"), answer
    assert engine.prompts == []
