"""Engine efficiency: generated tokens/s through the raw engine vs through the pipeline.

Run::

    python benchmarks/engine_efficiency.py --engine vllm          # in-process vLLM (CPU here)
    python benchmarks/engine_efficiency.py --engine transformers  # torch + transformers
    python benchmarks/engine_efficiency.py --engine transformers --device cuda \\
        --config qwen2-0.5b --prompts 256 --output-len 256       # on a GPU, random weights
    python benchmarks/engine_efficiency.py --engine vllm --device cuda --config qwen2-0.5b \\
        --prompts 256 1024 --output-len 256 --repeats 5 --kv-cache-gib 16   # one record each

Same prompts, fixed output lengths (eos ignored), the same per-sample seeds on both sides:

- raw: the prompts are rendered and tokenized beforehand, outside its timer, then every
  request goes to ``engine.generate`` at once (``asyncio.gather``). The pipeline renders and
  tokenizes inside its timer, so each record also gives ``raw_prompt_build_s`` (rendering
  and batch-tokenizing every prompt, the cheapest way a caller can, timed alone) and the
  pipeline's ratio against raw with that time added (``ratio_vs_raw_with_prompts_median``);
- pipeline: ``Pipeline([BuildPrompt(), Generate(), Judge("exact_match")])`` on the same rows,
  every sample in flight at once (``max_concurrency`` = number of prompts, fixed:
  ``adaptive_concurrency=False``).

Runs alternate raw / pipeline after a warm-up of each; per pair we report both throughputs and
their ratio, and the median over pairs. The pipeline process's CPU time per sample
(``time.process_time``) and its time in garbage collection are reported for both sides: with
vLLM the model runs in the engine-core process, so this is the frontend's cost (vLLM's output
processing plus the pipeline's); with the transformers engine the model runs in a thread of
this process and is included.
``--config qwen2-0.5b`` builds a Qwen2 model of that shape with random weights (no download);
the tokenizer is the tiny model's, built locally (for vLLM, saved once under ``.cache/``).
Several ``--prompts`` counts share one engine start and give one record each
(``<name>_<prompts>.json``).

``--max-num-seqs`` and ``--cudagraph-max`` (vLLM's ``max_cudagraph_capture_size``: decode batches
larger than it run without CUDA graphs; vLLM's default is min(2 x max_num_seqs, 512) on
H100/H200) test why 4,096 prompts ran at half the tokens/s of 1,024 on two H200s (see
``docs/vllm_gpu.md``). ``--no-engine-stats`` starts the engine without scheduler
statistics: a custom stat logger makes vLLM also keep its Prometheus histograms in the
frontend, a record per generated token. ``--slice-s`` is a what-if for diagnosis only: it
sets the runner's loop-slice budget (``pipeline._runner.slice.SLICE_S``, 0.005 s), which
throttles how fast samples reach their stages while vLLM's output handling fills the loop.

``--gc edge`` (the default) measures the process as a rollout application runs it: the
collector tuned with :func:`pipeline.diagnostics.rollout_gc`, entered once the engine has
started so that vLLM's and torch's start-up objects are frozen out of every collection (what
``vllm serve`` does for its own frontend). ``--gc library`` leaves CPython's defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import write_result

from pipeline import Pipeline, SamplingParams
from pipeline._runner import slice as SLICE
from pipeline._text.render import encode_text, plain_fast_backend, render, render_prompt
from pipeline.diagnostics import rollout_gc
from pipeline.models.tiny import ensure_tiny_model
from pipeline.stages import BuildPrompt, Generate
from pipeline.stages._judge import Judge

ROOT = Path(__file__).resolve().parents[1]

CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's shape (random weights): 494M parameters.
    "qwen2-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                   "max_position_embeddings": 32768, "tie_word_embeddings": True,
                   "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}


def rows(count: int) -> list[dict[str, Any]]:
    """Arithmetic chat prompts of varied lengths, with a ground truth for the judge."""
    out = []
    for i in range(count):
        a, b = 3 + 7 * i % 89, 11 + 13 * i % 97
        context = " ".join(f"Step {k}: keep the numbers in mind." for k in range(i % 5))
        out.append({"messages": [{"role": "system", "content": "You are a careful solver."},
                                 {"role": "user", "content": f"{context} What is {a} + {b}?"}],
                    "ground_truth": str(a + b)})
    return out


def random_model_dir(name: str, root: Path) -> Path:
    """A model directory for ``CONFIGS[name]`` (N(0, 0.02) bfloat16 weights, the tiny model's
    tokenizer), built on the CPU on first use under ``root/.cache``; vLLM loads from disk."""
    target = root / ".cache" / f"random-{name}"
    if (target / "model.safetensors").exists():
        return target
    import shutil

    import torch

    hf: Any = importlib.import_module("transformers")
    tokenizer = hf.AutoTokenizer.from_pretrained(str(ensure_tiny_model(
        root / ".cache" / "tiny-qwen2")))
    config = hf.Qwen2Config(**CONFIGS[name], eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = hf.Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    staging = target.with_name(target.name + ".build")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    return target


async def build_engine(args: argparse.Namespace, model_dir: Path) -> tuple[Any, Any]:
    hf: Any = importlib.import_module("transformers")
    if args.engine == "vllm":
        from pipeline.engines.vllm import VLLMEngine

        if args.config:
            model_dir = random_model_dir(args.config, ROOT)
        tokenizer = hf.AutoTokenizer.from_pretrained(str(model_dir))
        extra: dict[str, Any] = {}
        if args.data_parallel > 1:
            extra["data_parallel_size"] = args.data_parallel
        if args.cudagraph_max is not None:
            extra["compilation_config"] = {"max_cudagraph_capture_size": args.cudagraph_max}
        engine = await VLLMEngine.start(model_dir, ignore_eos=True, seed=0,
                                        cache_root=ROOT / ".cache" / "vllm",
                                        enforce_eager=args.eager, max_model_len=2048,
                                        kv_cache_gib=args.kv_cache_gib,
                                        request_seeds=not args.unseeded,
                                        max_num_seqs=args.max_num_seqs,
                                        engine_stats=not args.no_engine_stats,
                                        engine_kwargs=extra or None)
        return engine, tokenizer
    tokenizer = hf.AutoTokenizer.from_pretrained(str(model_dir))
    import torch

    from pipeline.engines.transformers import TransformersEngine

    if args.config:
        config = hf.Qwen2Config(**CONFIGS[args.config], eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
        torch.manual_seed(0)
        dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
        with torch.device(args.device):
            model = hf.Qwen2ForCausalLM(config).to(dtype)
        for param in model.parameters():
            param.data.normal_(0.0, 0.02)
    else:
        model = hf.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model = model.to(args.device)
    engine = TransformersEngine(model.eval(), tokenizer, eos_token_ids=[],
                                max_batch_size=max(args.prompts), max_model_len=2048)
    return engine, tokenizer


class GCPauses:
    """Time the collector ran and how many full collections it made, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.full += info["generation"] == 2

    @contextlib.contextmanager
    def installed(self) -> Any:
        gc.callbacks.append(self)
        try:
            yield self
        finally:
            gc.callbacks.remove(self)


class Timeline:
    """An engine wrapper recording when each request was submitted and when it returned
    (seconds from the last :meth:`reset`): a side that submits late finishes late."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.submitted: list[float] = []
        self.returned: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompt_ids: Any, sampling: SamplingParams,
                       request_id: str) -> Any:
        self.submitted.append(time.perf_counter() - self.start)
        try:
            return await self.engine.generate(prompt_ids, sampling, request_id)
        finally:
            self.returned.append(time.perf_counter() - self.start)

    def spans(self) -> dict[str, float]:
        return {"last_submit_s": max(self.submitted), "first_return_s": min(self.returned),
                "last_return_s": max(self.returned)}


async def run_raw(engine: Any, prompts: list[list[int]], sampling: list[SamplingParams],
                  tag: str) -> dict[str, float]:
    engine.reset()
    with GCPauses().installed() as pauses:
        cpu, start = time.process_time(), time.perf_counter()
        gens = await asyncio.gather(*(engine.generate(p, s, f"{tag}-{i}")
                                      for i, (p, s) in enumerate(zip(prompts, sampling,
                                                                     strict=True))))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(g.token_ids) for g in gens)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "cpu_s_per_sample": cpu / len(prompts), "gc_s": pauses.seconds,
            "gc_full": pauses.full, **engine.spans()}


async def run_pipeline(pipeline: Pipeline, timeline: Timeline,
                       data: list[dict[str, Any]]) -> dict[str, float]:
    timeline.reset()
    with GCPauses().installed() as pauses:
        cpu, start = time.process_time(), time.perf_counter()
        result = await pipeline.run_batch(data, n=1)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    bad = [s.error for s in result.samples if s.status.value != "completed"]
    if bad:
        raise SystemExit(f"pipeline samples failed: {bad[:3]}")
    tokens = sum(len(s.response_ids) for s in result.samples)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "cpu_s_per_sample": cpu / len(data), "gc_s": pauses.seconds,
            "gc_full": pauses.full, **timeline.spans()}


async def measure(engine: Any, tokenizer: Any, args: argparse.Namespace,
                  count: int) -> dict[str, Any]:
    """Warm-up of each side, then ``args.repeats`` raw / pipeline pairs on ``count`` prompts."""
    data = rows(count)
    build = BuildPrompt(offload=not args.inline_prompt)
    engine = Timeline(engine)
    pipeline = Pipeline([build, Generate(), Judge("exact_match")], engine=engine,
                        tokenizer=tokenizer, max_concurrency=count,
                        # every sample in flight at once, as the raw side: a fixed limit
                        # (the default controller would steer it by the engine's load)
                        adaptive_concurrency=False,
                        sample_timeout_s=3600, seed=1,
                        sampling={"max_tokens": args.output_len, "temperature": 1.0})
    items = pipeline.make_items(data, n=1)
    sampling = [item.sampling for item in items]  # the pipeline's own per-sample seeds
    prompts = [render_prompt(tokenizer, row["messages"], None)[1] for row in data]
    build_s = statistics.median(prompt_build_s(tokenizer, data) for _ in range(3))
    pairs = []
    await run_raw(engine, prompts, sampling, f"warm-raw{count}")
    await run_pipeline(pipeline, engine, data)
    for rep in range(args.repeats):
        raw = await run_raw(engine, prompts, sampling, f"raw{count}-{rep}")
        piped = await run_pipeline(pipeline, engine, data)
        pairs.append({"raw": raw, "pipeline": piped,
                      "ratio": piped["tokens_per_s"] / raw["tokens_per_s"],
                      "ratio_vs_raw_with_prompts": piped["tokens_per_s"] * (
                          raw["wall_s"] + build_s) / raw["tokens"]})
        print(f"{count} prompts, pair {rep}: raw {raw['tokens_per_s']:.0f} tok/s, pipeline "
              f"{piped['tokens_per_s']:.0f} tok/s, ratio {pairs[-1]['ratio']:.3f}, CPU ms/sample "
              f"{1000 * raw['cpu_s_per_sample']:.2f} -> {1000 * piped['cpu_s_per_sample']:.2f}, "
              f"GC s {raw['gc_s']:.3f} -> {piped['gc_s']:.3f}, last submit s "
              f"{raw['last_submit_s']:.3f} -> {piped['last_submit_s']:.3f}, first/last return s "
              f"{raw['first_return_s']:.2f}/{raw['last_return_s']:.2f} -> "
              f"{piped['first_return_s']:.2f}/{piped['last_return_s']:.2f}, ratio with raw's "
              f"prompt building ({build_s:.3f} s) {pairs[-1]['ratio_vs_raw_with_prompts']:.3f}",
              flush=True)

    def median(side: str, key: str) -> float:
        return statistics.median(p[side][key] for p in pairs)

    raw_cpu = 1000 * median("raw", "cpu_s_per_sample")
    pipe_cpu = 1000 * median("pipeline", "cpu_s_per_sample")
    return {
        "engine": args.engine, "device": args.device, "model": args.config or "tiny-qwen2",
        "prompts": count, "output_len": args.output_len, "pairs_count": len(pairs),
        "build_prompt_offload": not args.inline_prompt,
        "request_seeds": not args.unseeded, "gc": args.gc,
        "data_parallel": args.data_parallel,
        "raw_tokens_per_s": round(median("raw", "tokens_per_s"), 1),
        "pipeline_tokens_per_s": round(median("pipeline", "tokens_per_s"), 1),
        "ratio_median": round(statistics.median(p["ratio"] for p in pairs), 4),
        "ratio_min": round(min(p["ratio"] for p in pairs), 4),
        "raw_prompt_build_s": round(build_s, 4),
        "ratio_vs_raw_with_prompts_median": round(statistics.median(
            p["ratio_vs_raw_with_prompts"] for p in pairs), 4),
        "max_num_seqs_asked": args.max_num_seqs, "cudagraph_max_asked": args.cudagraph_max,
        "engine_stats": not args.no_engine_stats,
        "slice_s": SLICE.SLICE_S,
        "raw_cpu_ms_per_sample": round(raw_cpu, 3),
        "pipeline_cpu_ms_per_sample": round(pipe_cpu, 3),
        "extra_frontend_cpu_ms_per_sample": round(pipe_cpu - raw_cpu, 3),
        "raw_gc_s": round(median("raw", "gc_s"), 4),
        "pipeline_gc_s": round(median("pipeline", "gc_s"), 4),
        "pairs": pairs,
    }


def prompt_build_s(tokenizer: Any, data: list[dict[str, Any]]) -> float:
    """Seconds to render every prompt and tokenize them in one batch (the raw side does it
    before its timer starts; the pipeline inside its run)."""
    start = time.perf_counter()
    texts = [render(tokenizer, row["messages"], None, add_generation_prompt=True)
             for row in data]
    backend = plain_fast_backend(tokenizer, encoding=True)
    if backend is None:
        for text in texts:
            encode_text(tokenizer, text)
    else:
        backend.encode_batch(texts, add_special_tokens=False)
    return time.perf_counter() - start


async def main(args: argparse.Namespace,
               done: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One record per prompt count, all on one engine start; ``done`` gets each record as
    soon as it is measured (a run cut short keeps the finished ones)."""
    model_dir = ensure_tiny_model(ROOT / ".cache" / "tiny-qwen2")
    started = time.perf_counter()
    engine, tokenizer = await build_engine(args, model_dir)
    start_s = time.perf_counter() - started
    records = []
    try:
        # Entered once the engine has started (see the module doc), left before it closes.
        with rollout_gc(args.gc == "edge"):
            for count in args.prompts:
                record = await measure(engine, tokenizer, args, count)
                record["engine_start_s"] = round(start_s, 1)
                record["accelerator"] = _accelerator(args.device)
                record["commit"] = commit()
                record.update(_engine_facts(engine))
                records.append(record)
                if done is not None:
                    done(record)
    finally:
        await engine.aclose()
    return records


def commit() -> str | None:
    """The project commit measured (``PIPELINE_COMMIT`` where no git history travels)."""
    if os.environ.get("PIPELINE_COMMIT"):
        return os.environ["PIPELINE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _engine_facts(engine: Any) -> dict[str, Any]:
    """vLLM's version and the batch limits it chose (other engines: nothing)."""
    config = getattr(getattr(engine, "llm", None), "vllm_config", None)
    if config is None:
        return {}
    import vllm

    return {"vllm_version": vllm.__version__,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "max_cudagraph_capture_size": getattr(config.compilation_config,
                                                  "max_cudagraph_capture_size", None),
            "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "kv_cache_memory_bytes": getattr(config.cache_config, "kv_cache_memory_bytes",
                                             None)}


def _accelerator(device: str) -> str | None:
    if device == "cpu":
        return None
    import torch

    return str(torch.cuda.get_device_name(0))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    parser.add_argument("--device", default="cpu", help="transformers engine: cpu or cuda")
    parser.add_argument("--config", choices=sorted(CONFIGS), default=None,
                        help="random-weight model of this shape (default: the tiny model)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[64],
                        help="prompt counts (one record each, one engine start)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="vLLM: skip torch.compile")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="vLLM: KV cache size (default: vLLM's own on a GPU, 1 on CPU)")
    parser.add_argument("--data-parallel", type=int, default=1,
                        help="vLLM: data_parallel_size (one engine replica per GPU)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="vLLM: batch limit in sequences (default: vllm serve's)")
    parser.add_argument("--cudagraph-max", type=int, default=None,
                        help="vLLM: compilation_config max_cudagraph_capture_size")
    parser.add_argument("--no-engine-stats", action="store_true",
                        help="vLLM: engine_stats=False (no scheduler statistics, and none of "
                             "vLLM's per-token Prometheus records in the frontend)")
    parser.add_argument("--slice-s", type=float, default=None,
                        help="what-if, diagnosis only: the runner's loop-slice budget "
                             "(pipeline._runner.slice.SLICE_S)")
    parser.add_argument("--unseeded", action="store_true",
                        help="vLLM: request_seeds=False (no per-request seeds)")
    parser.add_argument("--gc", choices=("edge", "library"), default="edge",
                        help="collector as a rollout application tunes it, or CPython's "
                             "defaults (see the module doc)")
    parser.add_argument("--inline-prompt", action="store_true",
                        help="BuildPrompt(offload=False): render on the event loop")
    parser.add_argument("--name", default=None,
                        help="results file name (default engine_efficiency_<engine>_<device>)")
    parser.add_argument("--out-dir", default=None, help="write the JSON here instead")
    return parser.parse_args(argv)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    arguments = parse()
    if arguments.slice_s is not None:
        SLICE.SLICE_S = arguments.slice_s
    base = arguments.name or f"engine_efficiency_{arguments.engine}_{arguments.device}"
    if arguments.out_dir:  # another results folder; the recorded command leaves it out
        import _common

        _common.RESULTS = Path(arguments.out_dir)
        at = sys.argv.index("--out-dir")
        del sys.argv[at:at + 2]

    def write(figures: dict[str, Any]) -> None:
        name = base if len(arguments.prompts) == 1 else f"{base}_{figures['prompts']}"
        path = write_result(name, figures)
        print({k: v for k, v in figures.items() if k != "pairs"}, flush=True)
        print(f"written to {path}", file=sys.stderr)

    asyncio.run(main(arguments, write))
