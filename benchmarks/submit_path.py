"""Submission path: how long the pipeline takes to hand thousands of prompts to an engine.

Run::

    python benchmarks/submit_path.py                        # 4,096 prompts, both tokenizers
    python benchmarks/submit_path.py --profile pipeline     # + cProfile of one pipeline run

The in-process vLLM frontend runs on the same event loop as the pipeline: once the first
requests are in, vLLM's output handler processes every engine step's outputs there, in chunks
(128 outputs, then ``await asyncio.sleep(0)``). On two H200s at 4,096 prompts that frontend was
busy for the whole run (its CPU time equalled the wall time, ``docs/vllm_gpu.md``). This
benchmark reproduces that on the CPU without vLLM: a SIMULATED engine (fixed latency, no
model) and a SIMULATED frontend load, a task that holds the loop ``--chunk-ms`` per loop
iteration from the first submission on, as the output handler does while outputs are queued.
``--chunk-ms 0`` leaves the loop to the pipeline alone.

Sides, each on the same 4,096 rows of ``engine_efficiency.py`` (same shape as the GPU run):

- ``raw``: the prompts rendered and tokenized before the timer, then every request at once
  (what ``engine_efficiency.py``'s raw side does);
- ``raw+prompts``: the same, with rendering and tokenizing inside the timer (one batch
  encode, the cheapest honest way a caller can do it): the fair comparison;
- ``pipeline``: ``Pipeline([BuildPrompt(), Generate(), Judge("exact_match")])``, every sample
  admitted at once (``adaptive_concurrency=False``), as in ``engine_efficiency.py``.

``--slice-s`` is a what-if for diagnosis: the runner's loop-slice budget
(``pipeline._runner.slice.SLICE_S``, 0.005 s; see that module). Until 2026-11-27 its clock
counted every callback of a loop iteration, the simulated (or vLLM's real) output handling
included, and let one or two parked samples go per iteration (15.7 s to submit 4,096
prompts here, ``submit_path_4096_load.json``); it now counts the samples' own time
(``submit_path_4096_load_ownslice.json``).

Figures per side (median over ``--repeats``): the time of the last submission, CPU per
sample (``time.process_time``, the whole process), and the event loop's lag (a probe that
sleeps 1 ms and records how late it wakes) until the last submission.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import write_result
from engine_efficiency import Timeline, rows

from pipeline import Pipeline
from pipeline._runner import slice as SLICE
from pipeline._text.render import plain_fast_backend, render
from pipeline.engines import SimulatedEngine
from pipeline.families import family_tokenizer
from pipeline.models.tiny import ensure_tiny_model
from pipeline.stages import BuildPrompt, Generate
from pipeline.stages._judge import Judge

ROOT = Path(__file__).resolve().parents[1]


class FrontendLoad:
    """SIMULATED vLLM output handler: from :meth:`start` on, holds the loop ``chunk_s`` per
    iteration (a busy wait, then ``sleep(0)``), until :meth:`stop`."""

    def __init__(self, chunk_s: float) -> None:
        self.chunk_s = chunk_s
        self.busy_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and self.chunk_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            end = time.perf_counter() + self.chunk_s
            while time.perf_counter() < end:
                pass
            self.busy_s += self.chunk_s
            await asyncio.sleep(0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None


class Submissions(Timeline):
    """The benchmark's timeline, starting the simulated frontend load at the first request
    and noting when the last of ``expected`` requests went in."""

    def __init__(self, engine: Any, load: FrontendLoad, expected: int) -> None:
        super().__init__(engine)
        self.load, self.expected = load, expected
        self.all_in = asyncio.Event()

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str) -> Any:
        self.load.start()
        if len(self.submitted) + 1 >= self.expected:
            self.all_in.set()
        return await super().generate(prompt_ids, sampling, request_id)


async def lag_probe(stop: asyncio.Event, lags: list[float]) -> None:
    """How late a 1 ms sleep wakes, until ``stop`` is set."""
    while not stop.is_set():
        began = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - began - 0.001)


async def one_run(side: str, tokenizer: Any, data: list[dict[str, Any]],
                  args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    load = FrontendLoad(args.chunk_ms / 1000)
    engine = SimulatedEngine(latency_s=args.latency_s, latency_sigma=0.0, tail_prob=0.0,
                             eos_token_id=tokenizer.eos_token_id, seed=0)
    timeline = Submissions(engine, load, len(data))
    build = BuildPrompt(offload=not args.inline_prompt)
    pipeline = Pipeline([build, Generate(), Judge("exact_match")], engine=timeline,
                        tokenizer=tokenizer, max_concurrency=len(data),
                        adaptive_concurrency=False, sample_timeout_s=3600, seed=1,
                        sampling={"max_tokens": args.output_len, "temperature": 1.0})
    items = pipeline.make_items(data, n=1)
    sampling = [item.sampling for item in items]
    lags: list[float] = []
    probe_stop = asyncio.Event()
    probe = asyncio.create_task(lag_probe(probe_stop, lags))
    await asyncio.sleep(0.01)
    timeline.reset()
    cpu = time.process_time()
    try:
        if side == "pipeline":
            run: asyncio.Future[Any] = asyncio.ensure_future(pipeline.run_batch(data, n=1))
        else:
            ids = prompts if side == "raw" else encode_all(tokenizer, data)
            run = asyncio.ensure_future(asyncio.gather(*(
                timeline.generate(p, s, f"{side}-{i}")
                for i, (p, s) in enumerate(zip(ids, sampling, strict=True)))))
        await timeline.all_in.wait()
        last_submit = time.perf_counter() - timeline.start
        cpu_submit = time.process_time() - cpu
        probe_stop.set()
        await run
    finally:
        probe_stop.set()
        await probe
        await load.stop()
    lags_ms = sorted(1000 * x for x in lags) or [0.0]
    return {"last_submit_s": last_submit,
            "cpu_us_per_sample_to_last_submit": 1e6 * cpu_submit / len(data),
            "lag_p50_ms": lags_ms[len(lags_ms) // 2], "lag_max_ms": lags_ms[-1],
            "load_busy_s": load.busy_s}


def encode_all(tokenizer: Any, data: list[dict[str, Any]]) -> list[list[int]]:
    """Render every prompt and tokenize them in one batch (the raw+prompts side)."""
    texts = [render(tokenizer, row["messages"], None, add_generation_prompt=True)
             for row in data]
    backend = plain_fast_backend(tokenizer, encoding=True)
    return [list(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]


def build_prompt_costs(tokenizer: Any, data: list[dict[str, Any]]) -> dict[str, float]:
    """CPU per sample of BuildPrompt's two parts, one after the other on this thread."""
    texts: list[str] = []
    began = time.process_time()
    for row in data:
        texts.append(render(tokenizer, row["messages"], None, add_generation_prompt=True))
    rendered = time.process_time()
    backend = plain_fast_backend(tokenizer, encoding=True)
    for text in texts:
        backend.encode(text, add_special_tokens=False)
    encoded = time.process_time()
    wall = time.perf_counter()
    ids = backend.encode_batch(texts, add_special_tokens=False)
    wall = time.perf_counter() - wall
    return {"render_us": 1e6 * (rendered - began) / len(data),
            "encode_one_by_one_us": 1e6 * (encoded - rendered) / len(data),
            "encode_batch_wall_us": 1e6 * wall / len(data),
            "prompt_tokens_mean": statistics.fmean(len(e.ids) for e in ids)}


def tokenizers(names: list[str]) -> dict[str, Any]:
    hf: Any = importlib.import_module("transformers")
    out = {}
    for name in names:
        if name == "tiny":  # what engine_efficiency.py gives vLLM, --config included
            out[name] = hf.AutoTokenizer.from_pretrained(str(ensure_tiny_model(
                ROOT / ".cache" / "tiny-qwen2")))
        else:
            out[name] = family_tokenizer(name)
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    data = rows(args.prompts)
    if args.slice_s is not None:
        SLICE.SLICE_S = args.slice_s
    figures: dict[str, Any] = {"prompts": args.prompts, "chunk_ms": args.chunk_ms,
                               "slice_s": SLICE.SLICE_S,
                               "build_prompt_offload": not args.inline_prompt,
                               "latency_s": args.latency_s, "repeats": args.repeats,
                               "engine": "SIMULATED (fixed latency, no model)",
                               "frontend_load": "SIMULATED output handler" if args.chunk_ms
                               else "none", "tokenizers": {}}
    for name, tokenizer in tokenizers(args.tokenizers).items():
        prompts = encode_all(tokenizer, data)
        record: dict[str, Any] = {"build_prompt": build_prompt_costs(tokenizer, data)}
        for side in args.sides:
            await one_run(side, tokenizer, data, args, prompts)  # warm-up
            runs = [await one_run(side, tokenizer, data, args, prompts)
                    for _ in range(args.repeats)]
            record[side] = {key: round(statistics.median(r[key] for r in runs), 4)
                            for key in runs[0]}
            record[side]["last_submit_s_all"] = [round(r["last_submit_s"], 3) for r in runs]
            print(f"{name} {side}: {record[side]}", flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await one_run(args.profile, tokenizer, data, args, prompts)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
        figures["tokenizers"][name] = record
    return figures


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--chunk-ms", type=float, default=2.0,
                        help="simulated output handler: loop time held per iteration (0: off)")
    parser.add_argument("--latency-s", type=float, default=3.0,
                        help="simulated engine: every request's latency")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizers", nargs="+", default=["tiny", "qwen2.5"])
    parser.add_argument("--sides", nargs="+", default=["raw", "raw+prompts", "pipeline"],
                        choices=["raw", "raw+prompts", "pipeline"])
    parser.add_argument("--inline-prompt", action="store_true",
                        help="BuildPrompt(offload=False): tokenize on the event loop")
    parser.add_argument("--slice-s", type=float, default=None,
                        help="what-if: the runner's loop-slice budget (default: the runner's)")
    parser.add_argument("--profile", choices=["raw", "raw+prompts", "pipeline"], default=None)
    parser.add_argument("--name", default="submit_path")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    result = asyncio.run(main(arguments))
    print(f"written to {write_result(arguments.name, result)}", file=sys.stderr)
