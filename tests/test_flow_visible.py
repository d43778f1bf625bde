"""Adaptive concurrency where the engine tells its load, and flow control's state where a
person looks: the progress line, the metrics and a real SIGUSR1 dump of a child process. The
servers are real aiohttp servers on 127.0.0.1 answering as vLLM does (``/health``,
``/metrics``, token-id ``/v1/completions``); one of two is not there at first (down), then
comes up (re-admitted)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _fake_vllm import FakeVllm, completion
from aiohttp import web
from structlog.testing import capture_logs

from pipeline import (
    AdaptiveConcurrency,
    ConfigError,
    Pipeline,
    PipelineConfig,
    SamplingParams,
    SimulatedEngine,
)
from pipeline.diagnostics import DUMP_DIR_ENV
from pipeline.engines import OpenAIEngine
from pipeline.observability import ProgressHeartbeat, batch_metrics
from pipeline.stages import BuildPrompt, Generate
from pipeline.testing import ByteTokenizer

METRICS = ("vllm:num_requests_running 3\nvllm:num_requests_waiting 40\n"
           "vllm:kv_cache_usage_perc 0.97\nvllm:num_preemptions_total 0\n")



class Server(FakeVllm):
    """vLLM's ``/health``, ``/metrics`` (a full KV cache) and ``/v1/completions`` (three
    tokens after ``delay_s``) on a port chosen now, started later."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(self.delay_s)
        return completion(body, [5, 6, 2])

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)


def capacity_engine() -> SimulatedEngine:
    return SimulatedEngine(max_running=16, token_time_s=0.002, kv_capacity_tokens=2048)


async def test_adaptive_where_the_engine_tells_its_load_fixed_otherwise():
    rows = [{"prompt": "q"}] * 300
    sampling = SamplingParams(max_tokens=24)
    # The engine tells its load: the limit follows it.
    engine = capacity_engine()
    pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                    max_concurrency=8, progress_log_s=None, sampling=sampling,
                    adaptive_concurrency=AdaptiveConcurrency())
    result = await pipe.run_batch(rows)
    await engine.aclose()
    assert result.stats.by_status == {"completed": 300}
    state = pipe.flow_state()
    assert state is not None and state["changes"] > 0 and state["limit"] > 8, state
    assert state["decision"] != "fixed" and state["last_change"], state
    # False, and for now None (the default): the limit the user set, whatever the engine.
    for setting in (False, None):
        engine = capacity_engine()
        fixed = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                         max_concurrency=8, progress_log_s=None, sampling=sampling,
                         adaptive_concurrency=setting)
        result = await fixed.run_batch(rows)
        await engine.aclose()
        assert result.stats.by_status == {"completed": 300}
        assert fixed.flow_state() == {"limit": 8, "in_use": 0, "decision": "fixed"}
    # An engine without load signals keeps the limit, adaptive or not.
    latency = Pipeline([BuildPrompt(), Generate()], engine=SimulatedEngine(latency_s=0.001),
                       tokenizer=ByteTokenizer(), max_concurrency=3, progress_log_s=None,
                       adaptive_concurrency=AdaptiveConcurrency())
    await latency.run_batch(rows[:20])
    state = latency.flow_state()
    assert state is not None and state["limit"] == 3 and state["decision"] == "fixed"
    assert state["changes"] == 0


@pytest.mark.parametrize("value", [True, "yes", 3])
def test_a_nonsense_adaptive_setting_is_a_config_error_naming_the_field(value):
    with pytest.raises(ConfigError) as caught:
        PipelineConfig(adaptive_concurrency=value)
    assert caught.value.field == "adaptive_concurrency"
    assert "False (a fixed max_concurrency)" in str(caught.value)  # the settings
    with pytest.raises(ConfigError) as caught:
        PipelineConfig.from_dict({"adaptive_concurrency": {"kv_hi": 0.9}})
    assert caught.value.field == "adaptive_concurrency"
    assert "'adaptive_concurrency.kv_hi': Extra inputs are not permitted" in str(caught.value)


async def test_the_progress_line_and_metrics_show_the_controller_and_each_server():
    up, late = await Server(delay_s=0.05).start(), Server()  # late: not listening yet
    engine = OpenAIEngine([up.url, late.url], model="m", backoff_s=0.01,
                          health_interval_s=0.05)
    pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                    max_concurrency=16, progress_log_s=None,
                    adaptive_concurrency=AdaptiveConcurrency())
    lines: list[dict] = []
    try:
        with capture_logs() as logs:
            async with ProgressHeartbeat(pipe, interval_s=0.05):
                batch = asyncio.ensure_future(pipe.run_batch([{"prompt": "q"}] * 400))
                for _ in range(400):  # bounded: 20 s
                    await asyncio.sleep(0.05)
                    state = pipe.flow_state() or {}
                    if (state.get("servers", {}).get(f"127.0.0.1:{late.port}", {})
                            .get("state") == "down" and state.get("engine_running")):
                        break
                lines += [e for e in logs if e["event"] == "batch_heartbeat"]
                await late.start()  # back: the watch re-admits it
                for _ in range(400):
                    await asyncio.sleep(0.05)
                    if engine.health.is_healthy(late.url):
                        break
                await asyncio.sleep(0.15)  # a heartbeat or two after
                result = await batch
            lines += [e for e in logs if e["event"] == "batch_heartbeat"]
    finally:
        await engine.aclose()
        await up.stop()
        await late.stop()
    assert result.stats.by_status == {"completed": 400}
    shown = [line["concurrency"] for line in lines]
    down = [c for c in shown
            if c.get("servers", {}).get(f"127.0.0.1:{late.port}", {}).get("state") == "down"]
    assert down, shown
    line = down[-1]
    # The controller's bounds and state, the engine's figures (from /metrics)...
    assert line["min"] == 4 and line["max"] == 8192 and line["limit"] >= 4
    assert line["kv_usage"] == 0.97 and line["engine_running"] == 3
    assert line["engine_waiting"] == 40 and "in_use" in line and line["decision"]
    # ... and each server, by host:port, the dead one with its error.
    assert line["servers"][f"127.0.0.1:{up.port}"]["state"] == "up"
    assert "failed" in line["servers"][f"127.0.0.1:{late.port}"]["error"]
    assert any(c.get("servers", {}).get(f"127.0.0.1:{late.port}", {}).get("state")
               == "re-admitted" for c in shown), shown
    # A full KV cache with a queue longer than running: the limit came down, and says why.
    state = pipe.flow_state()
    assert state is not None and "engine queue" in state["last_change"], state
    metrics = batch_metrics(result, flow=state)
    assert metrics[f"rollout/flow/servers/127.0.0.1:{late.port}/healthy"] == 1.0
    assert metrics[f"rollout/flow/servers/127.0.0.1:{late.port}/downs"] >= 1.0
    assert metrics["rollout/flow/engine_waiting"] == 80.0  # both servers up: summed


CHILD = textwrap.dedent('''
    import asyncio, os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from test_flow_visible import Server
    from pipeline import AdaptiveConcurrency, Pipeline, asyncio_run
    from pipeline.engines import OpenAIEngine
    from pipeline.stages import BuildPrompt, Generate
    from pipeline.testing import ByteTokenizer

    async def main():
        up, dead = await Server(delay_s=3600).start(), Server()  # dead: never listens
        engine = OpenAIEngine([up.url, dead.url], model="m", backoff_s=0.01,
                              health_interval_s=0.05)
        pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                        max_concurrency=6, progress_log_s=None,
                        adaptive_concurrency=AdaptiveConcurrency())
        batch = asyncio.create_task(pipe.run_batch([{"prompt": "q"}] * 50))
        for _ in range(600):  # bounded: 30 s
            await asyncio.sleep(0.05)
            state = pipe.flow_state() or {}
            servers = state.get("servers", {})
            if (state.get("engine_running") and servers.get(f"127.0.0.1:{dead.port}", {})
                    .get("state") == "down"):
                break
        Path(os.environ["FLOW_READY"]).write_text(f"{up.port} {dead.port}")
        await asyncio.sleep(60)
        batch.cancel()

    asyncio_run(main())
''')


def test_a_usr1_dump_shows_the_controller_and_each_server(tmp_path: Path):
    ready = tmp_path / "ready"
    env = {**os.environ, DUMP_DIR_ENV: str(tmp_path), "FLOW_READY": str(ready)}
    with open(tmp_path / "child.log", "wb") as log:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(Path(__file__).parent)],
                                 stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.poll() is None, (tmp_path / "child.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "child.log").read_text()
            time.sleep(0.05)
        up, dead = ready.read_text().split()
        os.kill(child.pid, signal.SIGUSR1)
        directory = tmp_path / str(child.pid)
        while not list(directory.glob("tasks-*.json")):  # the .json comes after the .txt
            assert time.monotonic() < deadline, (tmp_path / "child.log").read_text()
            time.sleep(0.05)
        [path] = directory.glob("tasks-*.txt")
        text = path.read_text()
    finally:
        child.kill()
        child.wait(timeout=10)
    [line] = [line for line in text.splitlines() if line.startswith("flow control:")]
    for field in ("limit=", "min=4", "max=8192", "in_use=", "decision=", "kv_usage=0.97",
                  "engine_running=3", "engine_waiting=40", "last_change="):
        assert field in line, line
    assert f"  server 127.0.0.1:{up}: up" in text, text
    assert f"  server 127.0.0.1:{dead}: down (last error:" in text, text
