"""Who may read and write what on every proxy route (issue 33, item 7a), over real HTTP on
127.0.0.1 with the simulated engine and the byte-level tokenizer.

The expectations below are written out by hand, per route and per key, independently of the
server's own table (``pipeline.proxy._access.ROUTE_ACCESS``): a route the server serves
without a row here, or a row here for a route it does not serve, fails
``test_item7_every_route_has_a_rule``.

Keys: ``admin`` the server's ``api_key`` (without one configured, just a wrong key), ``own``
the key of the session the route is for (session A), ``other`` another live session's key
(session B), ``wrong`` a key that opens nothing, ``none`` no Authorization header.
Outcomes: ``full`` served with token payloads, ``agent`` served without any token payload,
``401`` refused (and nothing changed).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from pipeline.proxy import ProxyServer
from pipeline.proxy._access import ROUTE_ACCESS
from pipeline.testing import ByteTokenizer, SimulatedEngine

TOK = ByteTokenizer()
ADMIN = "admin-key-0123456789"
KEYS = ("admin", "own", "other", "wrong", "none")
TOKEN_KEYS = {"token_ids", "logprobs", "prompt_ids", "response_ids", "response_mask",
              "raw_prompt"}

# route name -> (method, path, body); {sid} is session A
ROUTES: dict[str, tuple[str, str, Any]] = {
    "health": ("GET", "/health", None),
    "models": ("GET", "/v1/models", None),
    "chat": ("POST", "/v1/chat/completions",
             {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("POST", "/v1/responses", {"model": "m", "input": "hi"}),
    "messages": ("POST", "/v1/messages", {"model": "m", "max_tokens": 8,
                                          "messages": [{"role": "user", "content": "hi"}]}),
    "create": ("POST", "/sessions", {}),
    "create_named": ("POST", "/sessions/chosen-1", {}),
    "session_get": ("GET", "/sessions/{sid}", None),
    "session_complete": ("POST", "/sessions/{sid}/complete", None),
    "session_delete": ("DELETE", "/sessions/{sid}", None),
    "session_models": ("GET", "/sessions/{sid}/v1/models", None),
    "session_chat": ("POST", "/sessions/{sid}/v1/chat/completions",
                     {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    "session_responses": ("POST", "/sessions/{sid}/v1/responses",
                          {"model": "m", "input": "hi"}),
    "session_messages": ("POST", "/sessions/{sid}/v1/messages",
                         {"model": "m", "max_tokens": 8,
                          "messages": [{"role": "user", "content": "hi"}]}),
}

F, A, D = "full", "agent", "401"
# with a server api_key: admin, own, other, wrong, none
WITH_SERVER_KEY: dict[str, tuple[str, ...]] = {
    "health": (F, D, D, D, D),
    "models": (F, F, F, D, D),  # any live session's key lists the model
    "chat": (D, F, F, D, D),  # the session is the key's: B's key chats in B
    "responses": (D, F, F, D, D),
    "messages": (D, F, F, D, D),
    "create": (F, D, D, D, D),
    "create_named": (F, D, D, D, D),
    "session_get": (F, A, D, D, D),
    "session_complete": (F, A, D, D, D),
    "session_delete": (F, F, D, D, D),
    "session_models": (F, F, D, D, D),
    "session_chat": (F, F, D, D, D),
    "session_responses": (F, F, D, D, D),
    "session_messages": (F, F, D, D, D),
}
# without one (the "admin" key is then a wrong key): server routes are open, sessions are not
WITHOUT_SERVER_KEY: dict[str, tuple[str, ...]] = {
    "health": (F, F, F, F, F),
    "models": (F, F, F, F, F),
    "chat": (D, F, F, D, D),
    "responses": (D, F, F, D, D),
    "messages": (D, F, F, D, D),
    "create": (F, F, F, F, F),
    "create_named": (F, F, F, F, F),
    "session_get": (D, A, D, D, D),
    "session_complete": (D, A, D, D, D),
    "session_delete": (D, F, D, D, D),
    "session_models": (D, F, D, D, D),
    "session_chat": (D, F, D, D, D),
    "session_responses": (D, F, D, D, D),
    "session_messages": (D, F, D, D, D),
}


def responder(prompt_ids: list[int], rng: Any) -> list[int]:
    return [*TOK.encode("ok"), TOK.eos_token_id]


@dataclass
class Setup:
    proxy: ProxyServer
    http: aiohttp.ClientSession
    a: Any
    b: Any


@pytest.fixture(params=["server_key", "no_server_key"])
async def setup(request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0,
                             responder=responder, eos_token_id=TOK.eos_token_id)
    options = {"api_key": ADMIN} if request.param == "server_key" else {}
    async with ProxyServer(engine, TOK, **options) as proxy, aiohttp.ClientSession() as http:
        a = proxy.create_session(metadata={"ground_truth": "42"})
        b = proxy.create_session()
        async with http.post(f"{proxy.session_url(a)}/chat/completions",
                             json=ROUTES["chat"][2], headers=_auth(a.api_key)) as r:
            assert r.status == 200, await r.text()  # A has recorded tokens to leak
        yield Setup(proxy, http, a, b)


def _auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def _token_keys(value: Any, path: str = "") -> list[str]:
    """Paths of every token payload in a JSON value (recursively)."""
    found: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if k in TOKEN_KEYS and v is not None:
                found.append(f"{path}.{k}")
            found += _token_keys(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _token_keys(v, f"{path}.{i}")
    return found


def test_item7_every_route_has_a_rule():
    """The server's routes, its access table and this file's expectations name the same
    routes: a new route needs a rule (and a row here) before it is served."""
    engine = SimulatedEngine(eos_token_id=TOK.eos_token_id)
    served = {r.name for r in ProxyServer(engine, TOK).app.router.routes()}
    assert None not in served
    assert served == set(ROUTE_ACCESS) == set(ROUTES) == set(WITH_SERVER_KEY) == set(
        WITHOUT_SERVER_KEY)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_item7_route_and_key_access(setup: Setup, route: str, key: str) -> None:
    proxy, http, a, b = setup.proxy, setup.http, setup.a, setup.b
    keyed = proxy.config.api_key is not None
    table = WITH_SERVER_KEY if keyed else WITHOUT_SERVER_KEY
    expected = table[route][KEYS.index(key)]
    token = {"admin": ADMIN, "own": a.api_key, "other": b.api_key,
             "wrong": "sk-proxy-not-a-key-0123456789", "none": None}[key]
    method, path, body = ROUTES[route]
    sessions_before = len(proxy.sessions)
    turns_before = {s.id: len(s.turns) for s in (a, b)}
    async with http.request(method, proxy.url + path.format(sid=a.id), json=body,
                            headers=_auth(token)) as r:
        status, answer = r.status, await r.json()
    if expected == D:
        assert status == 401, (route, key, status, answer)
        assert answer["error"]["type"] == "authentication_error"
        # nothing was written: no session made or removed, no turn, A still active
        assert len(proxy.sessions) == sessions_before
        assert {s.id: len(s.turns) for s in (a, b)} == turns_before
        assert proxy.sessions.find(a.id) is a and a.state == "active"
        return
    assert status in (200, 201), (route, key, status, answer)
    leaks = _token_keys(answer)
    if route in ("session_get", "session_complete"):
        assert answer["id"] == a.id
        if expected == A:
            assert leaks == [], f"{key} key read token payloads: {leaks[:5]}"
            assert answer["segments"] and answer["segments"][0]["messages"]
        else:
            assert ".segments.0.response_ids" in leaks
            assert ".segments.0.messages.1.token_ids" in leaks
    elif expected == A:  # pragma: no cover - only record routes have an agent view
        raise AssertionError(route)
    if route in ("chat", "responses"):  # the top-level routes act on the key's own session
        target = b if key == "other" else a
        assert len(target.turns) == turns_before[target.id] + 1
    if route == "session_delete":
        assert proxy.sessions.find(a.id) is None


async def test_item7_agent_key_cannot_read_token_payloads(setup: Setup) -> None:
    """The agent's own key reads its record without any token payload: not in segments, not
    in the segments' messages (the reported leak), not in turns, not with ?turn_tokens=true,
    and not in the record ``complete`` answers with. The server's key gets them."""
    proxy, http, a = setup.proxy, setup.http, setup.a
    base = f"{proxy.url}/sessions/{a.id}"
    for method, url in (("GET", base), ("GET", base + "?turn_tokens=true"),
                        ("POST", base + "/complete")):
        async with http.request(method, url, headers=_auth(a.api_key)) as r:
            assert r.status == 200
            record = await r.json()
        assert _token_keys(record) == [], (url, _token_keys(record)[:5])
        assert "metadata" not in record  # the trainer's (here the answer): not the agent's
        # what an agent may read is still there: the conversation's text and the turn facts
        assert [m["content"] for m in record["segments"][0]["messages"]] == ["hi", "ok"]
        assert record["turns"][0]["prompt_len"] > 0
    if proxy.config.api_key is not None:
        async with http.get(base + "?turn_tokens=true", headers=_auth(ADMIN)) as r:
            full = await r.json()
        assert full["segments"][0]["messages"][1]["token_ids"] == [*TOK.encode("ok"),
                                                                   TOK.eos_token_id]
        assert full["turns"][0]["prompt_ids"]
        assert full["metadata"] == {"ground_truth": "42"}


async def test_item7_strangers_cannot_tell_which_sessions_exist(setup: Setup) -> None:
    """A key that does not open a session gets the same 401 whether the id exists or not."""
    proxy, http, a, b = setup.proxy, setup.http, setup.a, setup.b
    for key in (None, "sk-proxy-not-a-key-0123456789", b.api_key):
        answers = []
        for sid in (a.id, "sess_never_made"):
            async with http.get(f"{proxy.url}/sessions/{sid}", headers=_auth(key)) as r:
                answers.append((r.status, (await r.json())["error"]["code"]))
        assert answers[0] == answers[1] == (401, "invalid_api_key")
