"""Throughput of ``TransformersEngine`` (micro-batched) against Hugging Face ``generate``.

Run::

    python benchmarks/transformers_engine.py                  # tiny model on CPU
    python benchmarks/transformers_engine.py --quick          # a smoke run
    python benchmarks/transformers_engine.py --device cuda --model qwen2-0.5b --name NAME

Workload for each concurrency ``C``: ``max(8, 2 * C)`` prompts of random ids, lengths uniform
in [32, 256], each generating exactly ``--max-tokens`` tokens (eos is not a stop here, so the
work is fixed), at most ``C`` requests in flight. Figures per ``C``:

* engine: wall time, generated tokens/s, mean rows per decode step, and the event loop's lag
  while it ran (a 1 ms ticker's worst and 99th-percentile overshoot), which shows that model
  work stays off the loop;
* baseline: ``model.generate`` (sampling, left padding) on static batches of ``C`` prompts,
  the usual way to run an HF model without a serving engine.

``--model tiny`` is the local tiny Qwen2 (``pipeline.models.tiny``); ``qwen2-0.5b`` is a
Qwen2-0.5B-shaped model with random weights (no download), bfloat16 on CUDA. On CPU runs the
arith scenario end to end is timed too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

import torch
from _common import write_result

from pipeline import SamplingParams
from pipeline.engines.transformers import TransformersEngine

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                   "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "max_position_embeddings": 4096},
}


def load(model: str, device: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if model == "tiny":
        from pipeline.models.tiny import ensure_tiny_model

        path = ensure_tiny_model()
        return (AutoModelForCausalLM.from_pretrained(path).to(device).eval(),
                AutoTokenizer.from_pretrained(path))
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        net = Qwen2ForCausalLM(Qwen2Config(**PRESETS[model], tie_word_embeddings=True))
    return net.to(dtype).eval(), None


def make_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(32, 256))]
            for _ in range(count)]


async def run_engine(engine: TransformersEngine, prompts: list[list[int]], concurrency: int,
                     max_tokens: int) -> dict[str, Any]:
    slots = asyncio.Semaphore(concurrency)
    lags: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            start = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - start - 0.001)

    async def one(i: int, prompt: list[int]) -> int:
        async with slots:
            gen = await engine.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=i),
                                        f"b{concurrency}-{i}")
            return len(gen.token_ids)

    before = (engine.counters.decode_steps, engine.counters.decode_rows)
    ticker = asyncio.create_task(tick())
    start = time.perf_counter()
    try:
        tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        wall = time.perf_counter() - start
        stop.set()
        await ticker
    steps = engine.counters.decode_steps - before[0]
    rows = engine.counters.decode_rows - before[1]
    lags.sort()
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "mean_rows_per_step": rows / steps if steps else 0.0,
            "loop_lag_max_ms": 1000 * lags[-1] if lags else None,
            "loop_lag_p99_ms": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else None}


def run_hf_generate(model: Any, prompts: list[list[int]], batch: int, max_tokens: int,
                    pad: int) -> dict[str, Any]:
    device = next(model.parameters()).device
    tokens = 0
    start = time.perf_counter()
    for k in range(0, len(prompts), batch):
        group = prompts[k:k + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 do_sample=True, top_k=0, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, pad_token_id=pad)
        tokens += (out.shape[1] - width) * len(group)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


async def run_scenario(count: int, n: int) -> dict[str, Any]:
    from scenarios import arith_tools

    start = time.perf_counter()
    result = await arith_tools.run(count=count, n=n, seed=0)
    wall = time.perf_counter() - start
    stats = result.stats
    return {"samples": stats.num_samples, "wall_s_incl_load": wall,
            "batch_wall_s": stats.wall_time_s,
            "samples_per_s": stats.num_samples / stats.wall_time_s,
            "response_tokens": stats.response_tokens, "by_status": stats.by_status,
            "by_exit_reason": stats.by_exit_reason}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny", choices=["tiny", *PRESETS])
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--name", default="transformers_engine")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.max_tokens = "1,8", 16
    model, _ = load(args.model, args.device)
    vocab = int(model.config.vocab_size)
    engine = TransformersEngine(model, None, max_batch_size=256, max_model_len=4096,
                                eos_token_ids=())
    figures: dict[str, Any] = {
        "loadavg_1m_at_start": os.getloadavg()[0], "model": args.model, "device": args.device,
        "torch": torch.__version__, "params": sum(p.numel() for p in model.parameters()),
        "max_tokens": args.max_tokens, "runs": {}}
    if args.device.startswith("cuda"):
        figures["gpu"] = torch.cuda.get_device_name()
    levels = [int(x) for x in args.concurrency.split(",")]
    all_prompts = make_prompts(max(8, 2 * max(levels)), vocab, seed=0)
    await run_engine(engine, all_prompts[:4], 4, 4)  # warm-up
    run_hf_generate(model, all_prompts[:4], 4, 4, pad=0)
    for c in levels:
        prompts = all_prompts[:max(8, 2 * c)]
        eng = await run_engine(engine, prompts, c, args.max_tokens)
        hf = run_hf_generate(model, prompts, c, args.max_tokens, pad=0)
        figures["runs"][str(c)] = {"requests": len(prompts), "engine": eng, "hf_generate": hf,
                                   "engine_vs_hf": eng["tokens_per_s"] / hf["tokens_per_s"]}
        print(f"C={c:4d} engine {eng['tokens_per_s']:9.0f} tok/s "
              f"(rows/step {eng['mean_rows_per_step']:.1f}, loop lag max "
              f"{eng['loop_lag_max_ms']:.1f} ms)  hf.generate {hf['tokens_per_s']:9.0f} tok/s")
    await engine.aclose()
    if args.device == "cpu" and args.model == "tiny":
        figures["arith_scenario"] = await run_scenario(*((4, 2) if args.quick else (32, 4)))
        print("arith scenario:", statistics.fmean([figures["arith_scenario"]["samples_per_s"]]),
              "samples/s")
    print("wrote", write_result(args.name, figures))


if __name__ == "__main__":
    asyncio.run(main())
