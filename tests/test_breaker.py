"""The circuit breaker (``max_consecutive_engine_errors``) against a real aiohttp server on
127.0.0.1 that answers every completion with HTTP 500, through the real ``OpenAIEngine``."""

from __future__ import annotations

import pytest
from _ports import free_port
from aiohttp import web

from pipeline import EngineCircuitOpen, Pipeline, SimulatedEngine
from pipeline.engines import OpenAIEngine
from pipeline.stages import BuildPrompt, Generate
from pipeline.testing import ByteTokenizer

ROWS = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(50)]



class Broken:
    """A server whose every completion fails with 500; counts the requests it got."""

    def __init__(self) -> None:
        self.hits = 0
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.Response(status=500, text="CUDA error: an illegal memory access")

    async def __aenter__(self) -> Broken:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_the_breaker_trips_on_a_server_that_always_500s():
    async with Broken() as server:
        engine = OpenAIEngine(server.url, model="m", max_retries=0)
        try:
            pipe = Pipeline([BuildPrompt(), Generate()], engine=engine,
                            tokenizer=ByteTokenizer(), max_concurrency=4,
                            max_consecutive_engine_errors=5, progress_log_s=None)
            with pytest.raises(EngineCircuitOpen) as err:
                await pipe.run_batch(ROWS, n=4)
        finally:
            await engine.aclose()
    exc = err.value
    assert exc.engine == f"OpenAIEngine at {server.url}"
    assert exc.count == 5 and len(exc.last_errors) == 5
    assert "500" in exc.last_errors[-1] and "illegal memory access" in exc.last_errors[-1]
    assert str(exc).startswith(f"circuit breaker open: 5 samples in a row failed on engine "
                               f"errors from OpenAIEngine at {server.url}")
    # The breaker stopped admitting: the server saw the run of errors and the samples
    # already admitted with them, not all 200.
    assert server.hits <= 5 + 4
    # Nothing is lost: every sample is in the result, each with a status and an error.
    result = exc.result
    assert len(result.samples) == 200
    assert result.stats.by_status == {"failed": 200}
    refused = [it for it in result.items if it.error.startswith("not run: circuit breaker")]
    assert len(refused) == 200 - server.hits
    assert all(s.masked and s.finish_reason.value == "error" for s in result.samples)


async def test_errors_that_are_not_in_a_row_do_not_trip_it_and_off_by_default():
    # Every other request fails: completions keep closing the run of errors.
    engine = SimulatedEngine(latency_s=0.001, latency_sigma=0, tail_prob=0, error_rate=0.5,
                             seed=1)
    pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                    max_concurrency=1, max_consecutive_engine_errors=12,
                    progress_log_s=None)
    result = await pipe.run_batch(ROWS, n=2)
    assert result.stats.by_status["completed"] > 20 and result.stats.by_status["failed"] > 20
    assert pipe.flow_state()["breaker"] == {"open": False,
                                            "errors_in_a_row": pipe.flow_state()["breaker"][
                                                "errors_in_a_row"], "limit": 12}
    always = SimulatedEngine(latency_s=0.001, latency_sigma=0, tail_prob=0, error_rate=1.0)
    off = Pipeline([BuildPrompt(), Generate()], engine=always, tokenizer=ByteTokenizer(),
                   progress_log_s=None)
    result = await off.run_batch(ROWS)
    assert result.stats.by_status == {"failed": 50}  # no breaker: each fails on its own


async def test_a_new_batch_tries_the_engine_again():
    engine = SimulatedEngine(latency_s=0.001, latency_sigma=0, tail_prob=0, error_rate=1.0)
    pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                    max_concurrency=2, max_consecutive_engine_errors=3, progress_log_s=None)
    with pytest.raises(EngineCircuitOpen) as err:
        await pipe.run_batch(ROWS)
    assert err.value.engine == "SimulatedEngine"
    engine.error_rate = 0.0  # the engine came back
    result = await pipe.run_batch(ROWS[:5])
    assert result.stats.by_status == {"completed": 5}
