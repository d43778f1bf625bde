"""Asynchronous RL (issue 37): the AsyncRollout driver on the simulated engine (capacity mode,
named as simulated: staleness, tools, cancellation, shutdown), per-token versions through
collate / verl / XTuner, and a partial rollout on the real tiny model through the transformers
engine whose logprobs match the old weights' forward pass before the update and the new
weights' after it."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from pipeline import (
    AgentRolloutItem,
    AsyncRollout,
    ConfigError,
    Context,
    Pipeline,
    SamplingParams,
    Status,
    artifacts,
)
from pipeline.batch import collate, to_verl_batch, to_xtuner
from pipeline.engines import SimulatedEngine
from pipeline.stages import BuildPrompt, Generate
from pipeline.testing import ByteTokenizer

pytest_plugins = ["_model_fixtures"]

EOS = ByteTokenizer().eos_token_id
TOOL_TOKENS = [40, 41, 42]


def reply(length: int):
    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        return [*([65] * (length - 1)), EOS]
    return respond


def engine(length: int = 20) -> SimulatedEngine:
    return SimulatedEngine(max_running=8, token_time_s=0.001, responder=reply(length),
                           eos_token_id=EOS)


class Hold:
    """After generation, samples of rows marked ``hold`` wait for :attr:`release` (a
    straggler finishing late, its tokens already sampled)."""

    name = "hold"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.cleanups = 0

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        if item.data.extra.get("hold"):
            await self.release.wait()
        item.artifacts[artifacts.REWARD] = 1.0

    async def cleanup(self, item: AgentRolloutItem, ctx: Context) -> None:
        self.cleanups += 1


def rows(count: int, hold: tuple[int, ...] = ()) -> list[dict]:
    return [{"prompt": f"q{i}", "extra": {"hold": i in hold}} for i in range(count)]


def pipeline_for(eng: Any, *stages: Any) -> Pipeline:
    return Pipeline([BuildPrompt(), Generate(), *stages], engine=eng, tokenizer=ByteTokenizer(),
                    sampling=SamplingParams(max_tokens=64, seed=1))


def lag_of(group: Any, version: int) -> int:
    return version - min(v for s in group.samples for v in s.token_versions if v >= 0)


async def test_eta_0_is_the_synchronous_loop():
    hold = Hold()
    hold.release.set()
    pipe = pipeline_for(engine(), hold)
    async with AsyncRollout(pipe, rows(6), n=2, batch_groups=2, max_inflight=6,
                            max_staleness=0) as rollout:
        for step in range(3):
            batch = await rollout.next_batch()
            assert len(batch) == 2
            # nothing of the next batch started before this update: every token is current
            assert {v for g in batch for s in g.samples for v in s.token_versions} == {step}
            assert rollout.report.groups_started == 2 * (step + 1)
            assert rollout.inflight_groups == 0
            await rollout.update_weights()
        assert await rollout.next_batch() == []
    report = rollout.report
    assert report.delivered == {0: 6} and report.set_aside == {} and report.interrupted == {}


@pytest.mark.parametrize("eta", [1, 2])
async def test_a_straggler_past_eta_is_set_aside_and_one_within_it_is_delivered(eta):
    """Row 0 samples its tokens under version 0 and finishes after two updates: lag 2."""
    hold = Hold()
    pipe = pipeline_for(engine(), hold)
    rollout = AsyncRollout(pipe, rows(8, hold=(0,)), n=1, batch_groups=1, max_inflight=4,
                           max_staleness=eta)
    delivered: list[tuple[int, Any]] = []
    async with rollout:
        for _ in range(2):
            # admission: never more groups than (updates + eta + 1) * batch_groups
            assert rollout.report.groups_started <= (rollout.report.updates + eta + 1)
            batch = await rollout.next_batch()
            delivered += [(rollout.version, g) for g in batch]
            await rollout.update_weights()
        hold.release.set()
        while True:
            batch = await rollout.next_batch()
            if not batch:
                break
            delivered += [(rollout.version, g) for g in batch]
            await rollout.update_weights()
    report = rollout.report
    assert all(lag_of(g, version) <= eta for version, g in delivered)
    straggler = [lag_of(g, version) for version, g in delivered if g.items[0].data.extra["hold"]]
    if eta == 1:
        assert not straggler and report.set_aside == {2: 1}
        assert report.set_aside_groups[0].items[0].data.extra["hold"]
    else:
        assert straggler == [2] and report.set_aside == {}
    assert sum(report.delivered.values()) + sum(report.set_aside.values()) == 8
    assert report.groups_started == 8 and report.undelivered == 0


async def test_an_update_while_a_sample_is_in_tools_versions_each_turn_by_its_weights():
    in_tool = asyncio.Event()
    leave_tool = asyncio.Event()

    class Tool:
        name = "tool"

        async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
            art = item.artifacts
            art[artifacts.RESPONSE_IDS].extend(TOOL_TOKENS)
            art[artifacts.RESPONSE_MASK].extend([0] * len(TOOL_TOKENS))
            art[artifacts.LOGPROBS].extend([0.0] * len(TOOL_TOKENS))
            in_tool.set()
            await leave_tool.wait()

    eng = engine(length=5)
    pipe = pipeline_for(eng, Tool(), Generate())
    async with AsyncRollout(pipe, rows(1), n=1, batch_groups=1, max_staleness=1) as rollout:
        await asyncio.wait_for(in_tool.wait(), 10)
        assert await asyncio.wait_for(rollout.update_weights(), 10) == 1  # nothing waits
        leave_tool.set()
        [group] = await rollout.next_batch()
    sample = group.samples[0]
    assert sample.status is Status.COMPLETED
    assert sample.token_versions == [0] * 5 + [-1] * 3 + [1] * 5
    assert (sample.policy_version, sample.max_policy_version) == (0, 1)
    assert rollout.report.interrupted == {1: 1} and rollout.report.delivered == {1: 1}
    tensors = collate([sample], pad_token_id=0, max_prompt_len=64, max_response_len=16,
                      return_tensors="np")
    assert tensors["rollout_token_versions"][0].tolist() == (
        [0] * 5 + [-1] * 3 + [1] * 5 + [-1] * 3)
    verl = to_verl_batch([sample], pad_token_id=0, max_prompt_len=64, max_response_len=16,
                         use_verl=False)
    assert verl["batch"]["rollout_token_versions"][0, :13].tolist() == sample.token_versions
    nt = verl["non_tensor_batch"]
    assert (nt["min_global_steps"][0], nt["max_global_steps"][0]) == (0, 1)
    [record] = to_xtuner([sample])
    assert record["env"]["agent"]["extra_info"]["token_versions"] == sample.token_versions
    assert record["uid"]["version"] == 0


class ToolTokens:
    """Appends a tool's output tokens (mask 0), as CallTools does, and ends there."""

    name = "tool_tokens"

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        art = item.artifacts
        art[artifacts.RESPONSE_IDS].extend(TOOL_TOKENS)
        art[artifacts.RESPONSE_MASK].extend([0] * len(TOOL_TOKENS))
        art[artifacts.LOGPROBS].extend([0.0] * len(TOOL_TOKENS))


async def test_a_sample_ending_on_tool_tokens_keeps_its_versions_aligned():
    """Tokens after the last model turn get NOT_SAMPLED (-1); the sample is not failed for a
    short version list (a sample cut short in its tool call ends the same way)."""
    pipe = pipeline_for(engine(length=5), ToolTokens())
    result = await pipe.run_batch(rows(1), n=1)
    sample = result.samples[0]
    assert sample.status is Status.COMPLETED, sample.error
    assert sample.token_versions == [0] * 5 + [-1] * 3
    await pipe.resources.engine.aclose()


async def test_cancelling_an_update_resumes_the_engine_and_the_stream_goes_on():
    eng = engine()
    pipe = pipeline_for(eng)
    loading = asyncio.Event()

    async def load_forever() -> int:
        loading.set()
        await asyncio.sleep(3600)
        return 99

    async with AsyncRollout(pipe, rows(4), n=1, batch_groups=2, max_staleness=1) as rollout:
        update = asyncio.create_task(rollout.update_weights(load=load_forever))
        await asyncio.wait_for(loading.wait(), 10)
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        assert rollout.version == 0 and rollout.report.updates == 0
        batch = await asyncio.wait_for(rollout.next_batch(), 10)  # not left paused
        assert len(batch) == 2 and all(s.status is Status.COMPLETED
                                       for g in batch for s in g.samples)
    assert len(rollout.report.update_stall_s) == 1


async def test_closing_mid_stream_ends_every_sample_and_leaves_nothing_running():
    hold = Hold()  # never released: the held samples are cut short by the close
    pipe = pipeline_for(engine(length=200), hold)
    before = set(asyncio.all_tasks())
    rollout = AsyncRollout(pipe, rows(10, hold=(0, 1)), n=2, batch_groups=2, max_inflight=4)
    async with rollout:
        await asyncio.sleep(0.05)
        assert rollout.inflight_groups == 4
    await asyncio.sleep(0)
    assert set(asyncio.all_tasks()) - before == set()
    report = rollout.report
    assert report.undelivered == report.groups_started == 4
    assert sum(report.by_status.values()) == 8 and report.by_status.get("aborted", 0) > 0
    assert eng_idle(pipe)
    with pytest.raises(ConfigError):
        await rollout.next_batch()


def eng_idle(pipe: Pipeline) -> bool:
    load = pipe.resources.engine.load()
    return load.running == 0 and load.waiting == 0


async def test_bad_settings_name_their_field():
    pipe = pipeline_for(engine())
    with pytest.raises(ConfigError) as err:
        AsyncRollout(pipe, rows(1), batch_groups=1, max_staleness=-1)
    assert err.value.field == "max_staleness"
    no_sync = Pipeline([BuildPrompt(), Generate()], engine=NoSync(), tokenizer=ByteTokenizer())
    with pytest.raises(ConfigError) as err:
        AsyncRollout(no_sync, rows(1), batch_groups=1)
    assert err.value.field == "engine"


class NoSync:
    """An engine without weight sync hooks."""

    async def generate(self, prompt_ids, sampling, request_id):
        raise AssertionError("not called")

    async def abort(self, request_id):
        return None

    async def aclose(self):
        return None


async def test_openai_engine_update_with_a_kept_request_preempts_it_on_the_server():
    """A request kept across an update (pause keep) holds the old weights' KV on the server:
    the update asks vLLM's dev endpoint to preempt running requests (they prefill again)."""
    from aiohttp import web

    from pipeline.engines import OpenAIEngine

    calls: list[str] = []
    release = asyncio.Event()

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        await release.wait()
        return web.json_response({"choices": [{
            "token_ids": [5, 6], "prompt_token_ids": body["prompt"], "finish_reason": "length",
            "stop_reason": None, "logprobs": {"token_logprobs": [-0.5, -0.5]}}]})

    async def control(request: web.Request) -> web.Response:
        calls.append(request.path_qs)
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    for path in ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache",
                 "/update_weight_version"):
        app.router.add_post(path, control)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    engine = OpenAIEngine(f"http://127.0.0.1:{port}", model="tiny")
    try:
        kept = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_tokens=2), "k-0-0"))
        for _ in range(1000):
            if engine._gate.in_flight:
                break
            await asyncio.sleep(0.005)
        await engine.pause("keep")
        assert await engine.update_weights(path="/ckpt") == 1
        await engine.resume()
        release.set()
        gen = await asyncio.wait_for(kept, 10)
    finally:
        await engine.aclose()
        await runner.cleanup()
    assert "/reset_prefix_cache?reset_running_requests=true" in calls
    assert calls.index("/reset_prefix_cache?reset_running_requests=true") < calls.index(
        "/resume")
    assert gen.policy_version == 0 and gen.token_ids == [5, 6]  # admitted under version 0


# ----- the real tiny model: a partial rollout's logprobs, token by token ---------------------

TOLERANCE = 1e-4  # tests/test_transformers_engine.py's rescore tolerance (float32)


async def test_transformers_partial_rollout_logprobs_follow_the_weights_of_each_token(
        tiny_model_dir: Path, tiny_tokenizer: Any, reference_model: Any):
    torch = pytest.importorskip("torch")
    from _model_fixtures import rescore

    from pipeline.engines import WeightSyncedEngine
    from pipeline.engines.transformers import TransformersEngine

    inner = await asyncio.to_thread(TransformersEngine.from_pretrained, tiny_model_dir,
                                    max_model_len=1024)
    synced = WeightSyncedEngine(inner)
    generator = torch.Generator().manual_seed(5)
    new_weights = {name: value + 0.05 * torch.randn(value.shape, generator=generator)
                   for name, value in reference_model.state_dict().items()}
    trainer = type(reference_model).from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trainer.load_state_dict(new_weights)
    ids = list(tiny_tokenizer.encode("Tell me about the weather."))
    no_eos = SamplingParams(max_tokens=48, seed=3, stop_token_ids=())
    inner.eos_token_ids = frozenset()  # a fixed length: the update must fall inside it
    try:
        request = asyncio.create_task(synced.generate(ids, no_eos, "partial"))
        for _ in range(10000):
            if inner.counters.generated_tokens >= 8:
                break
            await asyncio.sleep(0.001)
        await synced.pause("keep")
        assert await synced.update_weights(state_dict=new_weights) == 1
        await synced.resume()
        gen = await asyncio.wait_for(request, 60)
    finally:
        await synced.aclose()
    split = gen.token_versions.count(0)
    assert gen.token_versions == [0] * split + [1] * (48 - split) and 8 <= split < 48
    got = torch.tensor(gen.logprobs)
    tokens = torch.tensor(gen.token_ids)[:, None]
    old = rescore(reference_model, ids + gen.token_ids, len(ids)).gather(1, tokens)[:, 0]
    new = rescore(trainer, ids + gen.token_ids, len(ids)).gather(1, tokens)[:, 0]
    assert torch.allclose(got[:split], old[:split], atol=TOLERANCE)
    assert torch.allclose(got[split:], new[split:], atol=TOLERANCE)
    # the update is large enough that the wrong weights miss by 10x the tolerance
    assert (got[:split] - new[:split]).abs().max() > 10 * TOLERANCE
    assert (got[split:] - old[split:]).abs().max() > 10 * TOLERANCE



async def test_the_driver_over_the_transformers_engine_pushes_real_weights(
        tiny_model_dir: Path, tiny_tokenizer: Any, reference_model: Any):
    torch = pytest.importorskip("torch")
    from pipeline.engines import WeightSyncedEngine
    from pipeline.engines.transformers import TransformersEngine

    inner = await asyncio.to_thread(TransformersEngine.from_pretrained, tiny_model_dir,
                                    max_model_len=1024)
    engine = WeightSyncedEngine(inner)
    pipe = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tiny_tokenizer,
                    sampling=SamplingParams(max_tokens=16, seed=2))
    questions = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}]}
                 for i in range(12)]
    state = {name: value + 0.01 for name, value in reference_model.state_dict().items()}
    try:
        async with AsyncRollout(pipe, questions, n=2, batch_groups=2, max_inflight=4,
                                max_staleness=1) as rollout:
            batches = []
            for _ in range(3):
                batches.append((rollout.version, await rollout.next_batch()))
                await rollout.update_weights(state_dict=state)
    finally:
        await engine.aclose()
    assert rollout.version == 3 and engine.policy_version == 3
    for version, groups in batches:
        assert len(groups) == 2
        for sample in (s for g in groups for s in g.samples):
            assert sample.status is Status.COMPLETED
            assert len(sample.token_versions) == len(sample.response_ids)
            assert version - sample.policy_version <= 1  # within max_staleness
    assert any(v >= 1 for _, groups in batches for g in groups for s in g.samples
               for v in s.token_versions)  # sampled by pushed weights
    with torch.no_grad():
        assert torch.equal(inner.model.model.embed_tokens.weight,
                           state["model.embed_tokens.weight"])
