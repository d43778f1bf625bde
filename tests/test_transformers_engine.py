"""TransformersEngine on the real tiny model: batching, logprobs, stops, limits, abort."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
from _model_fixtures import ForcedText, rescore, torch

from pipeline import EngineError, FinishReason, SamplingParams
from pipeline.engines.transformers import TransformersEngine

pytest_plugins = ["_model_fixtures"]


def prompts(tokenizer, count):
    """Prompts of different lengths (so batching needs real left padding)."""
    return [tokenizer.encode(f"Ben has {i} apples. " * (1 + i % 4) + "How many?")
            for i in range(count)]


def processed_logprobs(raw, sampling: SamplingParams):
    """Independent re-implementation of temperature -> top-k -> top-p on one row."""
    logits = raw.clone() / sampling.temperature
    if sampling.top_k > 0:
        kth = logits.topk(sampling.top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if sampling.top_p < 1.0:
        probs = torch.softmax(logits, -1)
        order = probs.argsort(descending=True)
        mass = 0.0
        keep = torch.zeros_like(probs, dtype=torch.bool)
        for token in order.tolist():
            keep[token] = True
            mass += probs[token].item()
            if mass >= sampling.top_p:
                break
        logits[~keep] = float("-inf")
    return torch.log_softmax(logits, -1)


async def test_concurrent_requests_share_one_forward_loop_and_logprobs_match_a_rescore(
        make_engine, tiny_tokenizer, reference_model):
    engine = make_engine(max_batch_size=8)
    batch = prompts(tiny_tokenizer, 12)
    sampling = [SamplingParams(max_tokens=12 + i, seed=i) for i in range(len(batch))]
    gens = await asyncio.gather(*(engine.generate(p, s, f"r{i}")
                                  for i, (p, s) in enumerate(zip(batch, sampling, strict=True))))
    assert engine.counters.max_batch_rows == 8  # more than one request per forward step
    assert engine.counters.prefill_calls >= 2  # the last four joined a running batch
    for prompt, params, gen in zip(batch, sampling, gens, strict=True):
        assert gen.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if gen.finish_reason is FinishReason.LENGTH:
            assert len(gen.token_ids) == params.max_tokens and gen.raw_finish_reason == "max_tokens"
        else:
            assert gen.token_ids[-1] in engine.eos_token_ids
        ref = rescore(reference_model, prompt + gen.token_ids, len(prompt))
        expected = ref[torch.arange(len(gen.token_ids)), torch.tensor(gen.token_ids)]
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)
    assert engine.inflight_requests == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=20, max_tokens=16, seed=1),
    SamplingParams(temperature=1.3, top_p=0.8, max_tokens=16, seed=2),
    SamplingParams(temperature=0.5, top_k=50, top_p=0.9, max_tokens=16, seed=3),
])
async def test_logprobs_are_of_the_processed_distribution(params, make_engine, tiny_tokenizer,
                                                          reference_model):
    engine = make_engine()
    prompt = prompts(tiny_tokenizer, 3)[2]
    gen = await engine.generate(prompt, params, "p")
    raw = rescore(reference_model, prompt + gen.token_ids, len(prompt))
    for j, (token, logprob) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
        processed = processed_logprobs(raw[j], params)
        assert math.isfinite(processed[token].item()), "token sampled outside top-k/top-p"
        assert logprob == pytest.approx(processed[token].item(), abs=1e-4)


async def test_greedy_is_argmax_and_same_seed_reproduces_inside_a_batch(make_engine,
                                                                        tiny_tokenizer):
    engine = make_engine()
    batch = prompts(tiny_tokenizer, 6)
    alone = await engine.generate(batch[0], SamplingParams(max_tokens=20, seed=11), "alone")
    crowd = await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=20, seed=11 + i),
                                                   f"c{i}") for i, p in enumerate(batch)))
    assert crowd[0].token_ids == alone.token_ids
    other = await engine.generate(batch[0], SamplingParams(max_tokens=20, seed=12), "other")
    assert other.token_ids != alone.token_ids
    greedy = await engine.generate(batch[1], SamplingParams(temperature=0, max_tokens=5), "g")
    with torch.no_grad():
        ids = list(batch[1])
        for token in greedy.token_ids:
            logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
            assert token == int(logits.argmax())
            ids.append(token)


async def test_stop_token_ids_and_eos_end_generation(make_engine, tiny_tokenizer):
    text = tiny_tokenizer.encode(" alpha beta gamma")
    stop = text[2]
    forced = ForcedText([text], tiny_tokenizer.eos_token_id)
    engine = make_engine(processor_factory=lambda rid, prompt: forced)
    prompt = prompts(tiny_tokenizer, 1)[0]
    by_stop_id = await engine.generate(prompt, SamplingParams(stop_token_ids=(stop,)), "s")
    assert by_stop_id.token_ids == text[:3]
    assert (by_stop_id.finish_reason, by_stop_id.raw_finish_reason) == (FinishReason.STOP,
                                                                        "stop_token")
    by_eos = await engine.generate(prompt, SamplingParams(), "e")
    assert by_eos.token_ids == [*text, tiny_tokenizer.eos_token_id]
    assert by_eos.raw_finish_reason == "eos"
    assert all(lp == 0.0 for lp in by_eos.logprobs)  # one allowed token: probability 1


async def test_context_limit_is_a_length_finish_never_a_crash(make_engine, tiny_tokenizer):
    engine = make_engine(max_model_len=64)
    long_prompt = tiny_tokenizer.encode("number " * 80)[:70]
    full = await engine.generate(long_prompt, SamplingParams(max_tokens=5), "full")
    assert (full.token_ids, full.finish_reason, full.raw_finish_reason) == (
        [], FinishReason.LENGTH, "context")
    near = await engine.generate(long_prompt[:60], SamplingParams(max_tokens=50, seed=0), "near")
    assert len(near.token_ids) <= 4
    if near.finish_reason is FinishReason.LENGTH:
        assert len(near.token_ids) == 4 and near.raw_finish_reason == "context"


async def test_abort_and_cancel_leave_the_batch_at_the_next_step(make_engine, tiny_tokenizer,
                                                                 reference_model):
    engine = make_engine(eos_token_ids=())  # never stops early: only abort ends them
    batch = prompts(tiny_tokenizer, 3)
    long = SamplingParams(max_tokens=900, seed=5)
    aborted = asyncio.create_task(engine.generate(batch[0], long, "to-abort"))
    cancelled = asyncio.create_task(engine.generate(batch[1], long, "to-cancel"))
    normal = asyncio.create_task(engine.generate(batch[2], SamplingParams(max_tokens=30), "n"))
    for _ in range(1000):  # bounded wait until the three are being decoded
        if engine.counters.decode_steps >= 5:
            break
        await asyncio.sleep(0.005)
    await engine.abort("to-abort")
    cancelled.cancel()
    gen = await aborted
    assert gen.finish_reason is FinishReason.ABORT and 0 < len(gen.token_ids) < 900
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    done = await normal
    ref = rescore(reference_model, batch[2] + done.token_ids, len(batch[2]))
    expected = ref[torch.arange(len(done.token_ids)), torch.tensor(done.token_ids)]
    assert torch.allclose(torch.tensor(done.logprobs), expected, atol=1e-4)
    for _ in range(200):
        if engine.inflight_requests == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.inflight_requests == 0
    again = await engine.generate(batch[1], SamplingParams(max_tokens=3), "to-cancel")
    assert len(again.token_ids) == 3  # the id is free again: the cancelled request is gone


async def test_model_runs_on_the_worker_thread_never_the_event_loop(make_engine,
                                                                    tiny_tokenizer):
    engine = make_engine()
    threads: set[int] = set()
    handle = engine.model.register_forward_pre_hook(
        lambda module, args: threads.add(threading.get_ident()))
    try:
        await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=4), f"t{i}")
                               for i, p in enumerate(prompts(tiny_tokenizer, 3))))
        worker = await engine.call_in_worker(lambda model: threading.get_ident())
    finally:
        handle.remove()
    assert threads == {worker} and worker != threading.get_ident()


async def test_bad_requests_fail_alone_and_the_engine_keeps_serving(make_engine, tiny_tokenizer):
    nothing = ForcedText([], stop_token=-1)  # allows no token at all
    engine = make_engine(processor_factory=lambda rid, p: nothing if rid == "empty" else None)
    prompt = prompts(tiny_tokenizer, 1)[0]
    with pytest.raises(EngineError, match="outside"):
        await engine.generate([10**6], SamplingParams(), "oov")
    with pytest.raises(EngineError, match="empty prompt"):
        await engine.generate([], SamplingParams(), "none")
    with pytest.raises(EngineError, match="allowed no token"):
        await engine.generate(prompt, SamplingParams(max_tokens=4), "empty")
    ok = await engine.generate(prompt, SamplingParams(max_tokens=4), "ok")
    assert len(ok.token_ids) == 4
    await engine.aclose()
    with pytest.raises(EngineError, match="closed"):
        await engine.generate(prompt, SamplingParams(), "late")


def test_from_pretrained_loads_model_and_tokenizer(tiny_model_dir, tmp_path):
    engine = TransformersEngine.from_pretrained(tiny_model_dir, max_batch_size=4)
    try:
        assert engine.max_model_len == 4096
        assert engine.tokenizer.eos_token_id in engine.eos_token_ids
        assert engine.device.type == "cpu"
    finally:
        asyncio.run(engine.aclose())
    with pytest.raises(EngineError, match="cannot load"):
        TransformersEngine.from_pretrained(tmp_path)
