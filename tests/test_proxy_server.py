"""The proxy over real HTTP on 127.0.0.1: OpenAI bodies and SSE framing, the sessions API,
auth and isolation, limits, expiry, aborts, 200 concurrent sessions, and fuzzed requests.
The engine is the simulated one (named as such); the tokenizer is the byte-level one."""

from __future__ import annotations

import asyncio
import http.client as httpclient
import json
import re
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import ConfigError, EngineError
from pipeline.proxy import ProxyServer
from pipeline.testing import ByteTokenizer, SimulatedEngine

TOK = ByteTokenizer()
ADMIN = "admin-key-0123456789"
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


def echo_responder(prompt_ids: list[int], rng: Any) -> list[int]:
    """Replies ``ack <the last user message>``; a tool call when it contains 'call'."""
    text = TOK.decode(prompt_ids)
    users = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.DOTALL)
    last = users[-1] if users else ""
    reply = CALL if "call" in last and "<|im_start|>tool" not in text[-200:] else f"ack {last}"
    return [*TOK.encode(reply), TOK.eos_token_id]


def make_engine(**kwargs: Any) -> SimulatedEngine:
    options = {"latency_s": 0.002, "latency_sigma": 0.0, "tail_prob": 0.0,
               "responder": echo_responder, "eos_token_id": TOK.eos_token_id, **kwargs}
    return SimulatedEngine(**options)


@pytest.fixture
async def proxy() -> AsyncIterator[ProxyServer]:
    async with ProxyServer(make_engine(), TOK, api_key=ADMIN) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=300)) as client:
        yield client


def auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


async def create(http: aiohttp.ClientSession, proxy: ProxyServer,
                 key: str | None = ADMIN, **body: Any) -> dict[str, Any]:
    async with http.post(f"{proxy.url}/sessions", json=body, headers=auth(key)) as r:
        assert r.status == 201, await r.text()
        return dict(await r.json())


async def chat(http: aiohttp.ClientSession, base_url: str, key: str | None,
               messages: list[dict[str, Any]], **body: Any) -> tuple[int, Any]:
    async with http.post(f"{base_url}/chat/completions", headers=auth(key),
                         json={"model": "m", "messages": messages, **body}) as r:
        if body.get("stream") and r.status == 200:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return r.status, await r.read()
        assert r.headers["Content-Type"].startswith("application/json")
        return r.status, await r.json()


async def test_openai_bodies_and_the_sessions_api(proxy, http):
    created = await create(http, proxy, metadata={"run": "a"})
    assert created["base_url"] == f"{proxy.url}/sessions/{created['id']}/v1"
    key, url = created["api_key"], created["base_url"]
    messages = [{"role": "user", "content": "please call"}]
    status, body = await chat(http, url, key, messages, tools=TOOLS)
    assert status == 200 and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "add", "arguments": '{"a": 1, "b": 2}'}
    usage = body["usage"]
    assert usage["completion_tokens"] == len(TOK.encode(CALL)) + 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    messages += [choice["message"], {"role": "tool", "tool_call_id": "call_0_0",
                                     "content": "3"}]
    status, body = await chat(http, url, key, messages, tools=TOOLS, logprobs=True)
    assert body["choices"][0]["message"]["content"] == "ack please call"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    pieces = body["choices"][0]["logprobs"]["content"]
    assert "".join(p["token"] for p in pieces) == "ack please call<|im_end|>"
    async with http.get(f"{url}/models", headers=auth(key)) as r:
        assert (await r.json())["data"][0]["id"] == "pipeline-proxy"
    async with http.get(f"{proxy.url}/sessions/{created['id']}", headers=auth(key)) as r:
        light = await r.json()  # the agent's own key: no token payloads
    assert [t["prompt_len"] for t in light["turns"]] == [t["prompt_len"] for t in (
        proxy.record(created["id"]).model_dump()["turns"])]
    assert not {"prompt_ids", "response_ids", "logprobs"} & set(light["turns"][0])
    assert not {"prompt_ids", "response_ids", "response_mask"} & set(light["segments"][0])
    async with http.get(f"{proxy.url}/sessions/{created['id']}", headers=auth(ADMIN)) as r:
        compact = await r.json()  # the server's key: segment tokens, turn lengths
    assert compact["segments"][0]["response_ids"] and compact["turns"][1]["prompt_ids"] is None
    async with http.get(f"{proxy.url}/sessions/{created['id']}?turn_tokens=true",
                        headers=auth(ADMIN)) as r:
        record = await r.json()
    assert record["metadata"] == {"run": "a"} and record["state"] == "active"
    assert [t["merged"] for t in record["turns"]] == [False, True]
    assert record["turns"][1]["prompt_ids"] == record["turns"][0]["prompt_ids"] + (
        record["segments"][0]["response_ids"][:len(record["turns"][1]["prompt_ids"])
                                              - len(record["turns"][0]["prompt_ids"])])
    assert set(record["turns"][0]["timings"]) == {"received_at", "queued_s", "render_s",
                                                   "engine_s", "total_s"}
    async with http.post(f"{proxy.url}/sessions/{created['id']}/complete",
                         headers=auth(key)) as r:
        assert r.status == 200 and (await r.json())["state"] == "completed"
    status, body = await chat(http, url, key, messages)
    assert status == 404 and body["error"]["code"] == "session_completed"
    async with http.delete(f"{proxy.url}/sessions/{created['id']}", headers=auth(ADMIN)) as r:
        assert (await r.json()) == {"id": created["id"], "deleted": True}
    async with http.get(f"{proxy.url}/sessions/{created['id']}", headers=auth(ADMIN)) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    async with http.get(f"{proxy.url}/sessions/{created['id']}", headers=auth(key)) as r:
        assert r.status == 401  # the key died with its session
    async with http.post(f"{proxy.url}/sessions/mine-1", headers=auth(ADMIN)) as r:
        assert r.status == 201 and (await r.json())["id"] == "mine-1"
    async with http.post(f"{proxy.url}/sessions/mine-1", headers=auth(ADMIN)) as r:
        assert r.status == 409
    async with http.get(f"{proxy.url}/health", headers=auth(ADMIN)) as r:
        assert (await r.json()) == {"status": "ok", "sessions": 1}


def parse_sse(raw: bytes) -> list[Any]:
    """Strict SSE framing: events end with a blank line, each one 'data: ' line."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    out: list[Any] = []
    for event in events:
        assert event.startswith("data: ") and "\n" not in event
        payload = event[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def test_streamed_replies_are_well_framed_and_match_the_plain_ones(proxy, http):
    created = await create(http, proxy)
    key, url = created["api_key"], created["base_url"]
    messages = [{"role": "user", "content": "please call"}]
    status, raw = await chat(http, url, key, messages, tools=TOOLS, stream=True,
                             stream_options={"include_usage": True})
    events = parse_sse(raw)
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    calls = [d["tool_calls"][0] for c in chunks for d in [c["choices"][0]["delta"] if
                                                          c["choices"] else {}]
             if "tool_calls" in d]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "add")]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 70
    reply = {"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0]["id"], "type": "function", "function": calls[0]["function"]}]}
    messages += [reply, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "3"}]
    status, raw = await chat(http, url, key, messages, tools=TOOLS, stream=True)
    chunks = parse_sse(raw)[:-1]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == (
        "ack please call")
    assert all("usage" not in c for c in chunks)
    record = proxy.record(created["id"])
    assert [t.merged for t in record.turns] == [False, True] and record.num_splits == 0


async def test_keys_open_only_their_own_session(proxy, http):
    a, b = await create(http, proxy), await create(http, proxy)
    sid_a, sid_b = a["id"], b["id"]
    hello = [{"role": "user", "content": "hello from a"}]
    for key in (None, "wrong", b["api_key"]):
        status, body = await chat(http, a["base_url"], key, hello)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        for method, path in (("GET", ""), ("POST", "/complete"), ("DELETE", "")):
            async with http.request(method, f"{proxy.url}/sessions/{sid_a}{path}",
                                    headers=auth(key)) as r:
                assert r.status == 401
    # the top-level route finds the session by its key, and only that one
    status, body = await chat(http, f"{proxy.url}/v1", a["api_key"], hello)
    assert status == 200
    status, _ = await chat(http, f"{proxy.url}/v1", "sk-proxy-guess", hello)
    assert status == 401
    assert len(proxy.record(sid_a).turns) == 1 and proxy.record(sid_b).turns == []
    # server routes need the server's key; the admin key opens every session
    for path in ("/health", "/v1/models"):
        async with http.get(f"{proxy.url}{path}") as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    async with http.get(f"{proxy.url}/v1/models", headers=auth(b["api_key"])) as r:
        assert r.status == 200
    async with http.post(f"{proxy.url}/sessions", headers=auth(a["api_key"])) as r:
        assert r.status == 401
    status, _ = await chat(http, b["base_url"], ADMIN, [{"role": "user", "content": "x"}])
    assert status == 200 and len(proxy.record(sid_b).turns) == 1
    assert proxy.record(sid_a).turns[0].messages == hello


async def test_without_a_server_key_sessions_still_need_their_own(http):
    async with ProxyServer(make_engine(), TOK) as open_proxy:
        created = await create(http, open_proxy, key=None)
        async with http.get(f"{open_proxy.url}/health") as r:
            assert r.status == 200
        status, _ = await chat(http, created["base_url"], None,
                               [{"role": "user", "content": "x"}])
        assert status == 401
        async with http.get(f"{open_proxy.url}/sessions/{created['id']}") as r:
            assert r.status == 401
    with pytest.raises(ConfigError, match="api_key"):
        ProxyServer(make_engine(), TOK, api_key="short")
    with pytest.raises(ConfigError, match="max_sesions"):
        ProxyServer(make_engine(), TOK, max_sesions=3)


async def test_two_hundred_concurrent_sessions_stay_isolated(http):
    async with ProxyServer(make_engine(latency_s=0.005, latency_sigma=0.5), TOK,
                           api_key=ADMIN) as proxy:
        async def agent(i: int) -> tuple[str, list[str]]:
            created = await create(http, proxy, metadata={"agent": i})
            messages: list[dict[str, Any]] = []
            replies = []
            for turn in range(3):
                messages.append({"role": "user", "content": f"agent {i} turn {turn}"})
                status, body = await chat(http, created["base_url"], created["api_key"],
                                          messages, stream=turn == 1)
                assert status == 200
                if turn == 1:
                    text = "".join(c["choices"][0]["delta"].get("content") or ""
                                   for c in parse_sse(body)[:-1] if c["choices"])
                else:
                    text = body["choices"][0]["message"]["content"]
                replies.append(text)
                messages.append({"role": "assistant", "content": text})
            return created["id"], replies

        results = await asyncio.gather(*(agent(i) for i in range(200)))
        assert len(proxy.sessions) == 200
        for i, (sid, replies) in enumerate(results):
            assert replies == [f"ack agent {i} turn {t}" for t in range(3)]
            record = proxy.record(sid)
            assert record.metadata == {"agent": i} and record.num_splits == 0
            assert [t.merged for t in record.turns] == [False, True, True]
            seg = record.segments[0]
            text = TOK.decode(seg.prompt_ids + seg.response_ids)
            assert set(re.findall(r"agent (\d+) turn", text)) == {str(i)}
        assert proxy.engine.calls == 600


async def test_limits_answer_4xx_with_openai_error_bodies(http):
    engine = make_engine()
    async with ProxyServer(engine, TOK, api_key=ADMIN, max_sessions=2, max_turns=2,
                           max_body_bytes=4096) as proxy:
        a = await create(http, proxy)
        await create(http, proxy)
        async with http.post(f"{proxy.url}/sessions", headers=auth(ADMIN)) as r:
            assert r.status == 429 and (await r.json())["error"]["code"] == "too_many_sessions"
        hello = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            assert (await chat(http, a["base_url"], a["api_key"], hello))[0] == 200
        async with http.post(f"{a['base_url']}/chat/completions", headers=auth(a["api_key"]),
                             json={"model": "m", "messages": hello}) as r:
            # final: a status no supported client retries, and the SDK's no-retry header
            assert (r.status, r.headers["x-should-retry"]) == (404, "false")
            assert (await r.json())["error"]["code"] == "too_many_turns"
        assert proxy.sessions.get(a["id"]).ended == "max_turns"
        status, body = await chat(http, a["base_url"], a["api_key"],
                                  [{"role": "user", "content": "x" * 8000}])
        assert status == 413 and body["error"]["type"] == "invalid_request_error"
        cases = [("POST", "/sessions/" + "x" * 200, b"", 400),
                 ("POST", "/sessions", b'{"sampling": {"temperature": -1}}', 400),
                 ("POST", "/sessions", b"[1, 2", 400),
                 ("GET", "/nowhere", b"", 404), ("PUT", "/health", b"", 405)]
        for method, path, data, expected in cases:
            async with http.request(method, proxy.url + path, data=data,
                                    headers=auth(ADMIN)) as r:
                assert r.status == expected, path
                assert set((await r.json())["error"]) == {"message", "type", "param", "code"}
        for body_bytes in (b"{", b"[]", b'{"messages": []}', b'{"messages": [{"role": 1}]}',
                           b'{"messages": [{"role": "user"}], "n": 3}'):
            async with http.post(f"{proxy.url}/v1/chat/completions", data=body_bytes,
                                 headers=auth(a["api_key"])) as r:
                assert r.status in (400, 404), body_bytes


async def test_unexpected_errors_are_500s_without_internals(http):
    class Broken:
        async def generate(self, prompt_ids, sampling, request_id):
            raise RuntimeError("secret internal detail")

        async def abort(self, request_id):
            pass

        async def aclose(self):
            pass

    class Failing(Broken):
        async def generate(self, prompt_ids, sampling, request_id):
            raise EngineError("model fell over")

    for engine, status, code in ((Broken(), 500, "internal_error"),
                                 (Failing(), 502, "engine_error")):
        async with ProxyServer(engine, TOK) as proxy:
            session = proxy.create_session()
            got, body = await chat(http, proxy.session_url(session), session.api_key,
                                   [{"role": "user", "content": "x"}])
            assert (got, body["error"]["code"]) == (status, code)
            assert "secret" not in json.dumps(body) and "Traceback" not in json.dumps(body)


async def test_idle_sessions_expire_and_deleting_aborts_engine_requests(http):
    engine = make_engine(hang_rate=1.0)
    async with ProxyServer(engine, TOK, api_key=ADMIN, idle_timeout_s=0.5) as proxy:
        busy = proxy.create_session()
        request = asyncio.create_task(chat(http, proxy.session_url(busy), busy.api_key,
                                           [{"role": "user", "content": "hang"}]))
        for _ in range(100):
            if busy.busy:
                break
            await asyncio.sleep(0.01)
        idle = proxy.create_session()
        for _ in range(300):
            if proxy.sessions.find(idle.id) is None:
                break
            await asyncio.sleep(0.02)
        assert proxy.sessions.find(idle.id) is None and proxy.sessions.expired_count == 1
        assert proxy.sessions.find(busy.id) is not None  # in flight: never expires
        await proxy.delete_session(busy.id)
        status, body = await request
        assert status == 503 and body["error"]["code"] == "engine_aborted"
        assert list(engine.aborted) == [f"{busy.id}-1"] and engine.in_flight == {}


async def test_a_client_that_goes_away_aborts_its_engine_request():
    engine = make_engine(hang_rate=1.0)
    async with ProxyServer(engine, TOK) as proxy:
        session = proxy.create_session()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as client:
            with pytest.raises(asyncio.TimeoutError):
                await chat(client, proxy.session_url(session), session.api_key,
                           [{"role": "user", "content": "hang"}])
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.02)
        assert list(engine.aborted) == [f"{session.id}-1"] and engine.in_flight == {}
        assert session.history.segments == [] and not session.busy


# ----- fuzzing: a server in a thread, hammered synchronously by hypothesis ---------------


class ThreadedProxy:
    """A ProxyServer on its own event loop in a thread (hypothesis tests are synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.proxy: ProxyServer | None = None
        self.session: Any = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.proxy = ProxyServer(make_engine(latency_s=0.0), TOK, api_key=ADMIN,
                                 max_body_bytes=65536)
        self.loop.run_until_complete(self.proxy.start())
        self.session = self.proxy.create_session()
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.proxy.aclose())
        self.loop.close()

    def __enter__(self) -> ThreadedProxy:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def threaded() -> Iterator[ThreadedProxy]:
    with ThreadedProxy() as server:
        yield server


scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40)
           | st.floats(allow_nan=False) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=6)
plain_messages = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "developer", "tool"]),
    "content": st.text(max_size=24) | st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2)})
assistant_messages = st.fixed_dictionaries(
    {"role": st.just("assistant"), "content": st.none() | st.text(max_size=24)},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({
        "id": st.text(max_size=6), "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": st.text(max_size=8),
                                           "arguments": st.text(max_size=16) | json_values})}),
        max_size=2)})
odd_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "bot"]) | json_values},
    optional={"content": json_values, "tool_calls": json_values, "name": json_values})
OPTIONS = {
    "temperature": st.floats(-1, 3) | json_values, "top_p": st.floats(-1, 2) | json_values,
    "max_tokens": st.integers(-2, 300) | json_values, "seed": st.integers() | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | json_values,
    "stream": st.booleans() | json_values, "n": st.integers(0, 3),
    "tools": st.just(TOOLS) | json_values, "logprobs": st.booleans() | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required", "any"]) | json_values,
    "stream_options": st.just({"include_usage": True}) | json_values,
    "max_completion_tokens": st.integers(-2, 300) | json_values,
    "top_logprobs": st.integers(-1, 3)}
near_valid = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(
        st.one_of(plain_messages, plain_messages, assistant_messages, odd_messages),
        min_size=1, max_size=5)},
    optional=OPTIONS)
bodies = st.one_of(
    near_valid.map(lambda v: json.dumps(v).encode()),
    near_valid.map(lambda v: json.dumps(v).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=48),
)


def test_fuzzed_requests_get_4xx_or_a_reply_and_the_server_stays_up(threaded):
    """One server per test (no state shared with other tests), hammered by hypothesis, then
    asked for its health."""
    fuzz(threaded)
    assert health(threaded) == 200


def health(threaded: ThreadedProxy) -> int:
    port = int(threaded.proxy.url.rsplit(":", 1)[1])
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health", headers={"Authorization": f"Bearer {ADMIN}"})
        response = conn.getresponse()
        assert json.loads(response.read())["status"] == "ok"
        return response.status
    finally:
        conn.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(body=bodies, target=st.sampled_from(["session", "top", "create"]),
       key=st.sampled_from(["session", "admin", "none", "garbage"]))
def fuzz(threaded: ThreadedProxy, body: bytes, target: str, key: str) -> None:
    proxy = threaded.proxy
    session = threaded.session
    assert proxy is not None
    path = {"session": f"/sessions/{session.id}/v1/chat/completions",
            "top": "/v1/chat/completions", "create": "/sessions"}[target]
    token = {"session": session.api_key, "admin": ADMIN, "none": None,
             "garbage": "\u00e9\u00e9"}[key]
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    port = int(proxy.url.rsplit(":", 1)[1])
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={
            k: v.encode("utf-8").decode("latin-1") for k, v in headers.items()})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    assert response.status < 500, data[:300]
    if response.status >= 400:
        error = json.loads(data)["error"]
        assert isinstance(error["message"], str) and error["type"]


async def test_replies_are_capped_and_stalled_bodies_time_out(http):
    async with ProxyServer(make_engine(), TOK, max_tokens=5, read_timeout_s=0.3) as proxy:
        session = proxy.create_session()
        status, body = await chat(http, proxy.session_url(session), session.api_key,
                                  [{"role": "user", "content": "x"}], max_tokens=2_000_000)
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        assert session.turns[0].sampling["max_tokens"] == 5
        # a client that announces a body and never sends it is answered 408, not waited for
        reader, writer = await asyncio.open_connection("127.0.0.1",
                                                       int(proxy.url.rsplit(":", 1)[1]))
        writer.write(f"POST /sessions/{session.id}/v1/chat/completions HTTP/1.1\r\n"
                     f"Host: x\r\nAuthorization: Bearer {session.api_key}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
                     .encode())
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        assert status_line.split()[1] == b"408"
        writer.close()
    assert ProxyServer(make_engine(), TOK).config.max_tokens == 16384  # capped by default


async def test_a_busy_fixed_port_is_retried_and_the_url_reported(http):
    from pipeline._net import bind_socket

    holder = bind_socket("127.0.0.1", 0)
    port = holder.getsockname()[1]
    proxy = ProxyServer(make_engine(), TOK, port=port)
    starting = asyncio.create_task(proxy.start())
    await asyncio.sleep(0.3)
    assert not starting.done()  # still retrying the busy port
    holder.close()
    try:
        assert await starting == proxy.url == f"http://127.0.0.1:{port}"
        async with http.get(f"{proxy.url}/health") as r:
            assert r.status == 200
    finally:
        await proxy.aclose()
