"""What the pipeline costs on top of the engine calls it makes.

Run::

    python benchmarks/overhead.py            # full figures (about a minute)
    python benchmarks/overhead.py --quick    # smaller sizes, for a smoke run
    python benchmarks/overhead.py --parts trivial in_flight --name NAME   # part 3's goals only

Part 1, CPU per sample and per stage. Both sides run the same work on the same simulated
engine (zero latency, so the event loop is the bottleneck and CPU time is what we measure):
render the chat template, tokenize, one ``generate`` call, decode, score, and record keeping.
The hand-written baseline is an ``asyncio.gather`` over one coroutine per sample that does
those steps inline, with a semaphore for concurrency, a per-sample ``asyncio.timeout``, a
``try/except`` that turns errors into a status, and a dict per stage with start/end times —
what a careful hand-rolled agent loop does, minus everything else the pipeline offers.
Runs alternate (ABAB...) and the medians are reported.

Part 2, memory and wall time with 10,000 samples in flight at once on a 1 s simulated
latency: RSS growth while all are in flight and Python allocations (tracemalloc, separate
run) per in-flight sample; wall time against the 1 s floor.

Part 3, the hot-path goals, each beside its own baseline:
- five trivial stages (``await asyncio.sleep(0)`` and one artifact each) through
  ``run_batch`` against a bare ``asyncio.gather`` doing the same awaits with a semaphore, a
  per-sample timeout and try/except (CPU per sample, ABAB pairs, medians), with CPython's
  default collector settings and again with both sides under the edge settings;
- 10,000 samples in flight, one stage awaiting 1 s, and the template path (``BuildPrompt`` +
  ``Generate`` with the tiny Qwen2 tokenizer and chat template on a 1 s simulated engine):
  wall time with the collector as the library leaves it and as ``asyncio_run``/the CLI set it
  (medians of 3 runs), beside a bare ``asyncio.gather`` of the same 1 s awaits;
- event-loop lag (a 5 ms ticker) during a 4,000-sample judge-stage batch (math judger), both
  ways.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import time
import tracemalloc
from typing import Any

from _common import write_result

from pipeline import BuildPrompt, Generate, Pipeline, SimulatedEngine
from pipeline.testing import ByteTokenizer
from scenarios import arith

STAGES_PER_SAMPLE = 3


def engine(latency: float) -> SimulatedEngine:
    tok = ByteTokenizer()
    return SimulatedEngine(
        latency_s=latency,
        latency_sigma=0.0,
        tail_prob=0.0,
        responder=arith.responder(tok),
        eos_token_id=tok.eos_token_id,
    )


def make_pipeline(eng: SimulatedEngine, concurrency: int) -> Pipeline:
    return Pipeline(
        [BuildPrompt(offload=False), Generate(), arith.score_answer],
        engine=eng,
        tokenizer=ByteTokenizer(),
        max_concurrency=concurrency,
        sample_timeout_s=60,
        sampling={"max_tokens": 64},
        seed=1,
    )


async def baseline(
    rows: list[dict[str, Any]], eng: SimulatedEngine, concurrency: int
) -> list[dict[str, Any]]:
    """The hand-written equivalent (see module docstring)."""
    from pipeline import SamplingParams

    tok = ByteTokenizer()
    slots = asyncio.Semaphore(concurrency)
    sampling = SamplingParams(max_tokens=64, seed=1)

    async def one(i: int, row: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"records": []}
        async with slots:
            try:
                async with asyncio.timeout(60):
                    t0 = time.monotonic()
                    text = tok.apply_chat_template(row["messages"], add_generation_prompt=True)
                    ids = tok.encode(text)
                    out["records"].append(
                        {"name": "build_prompt", "start": t0, "end": time.monotonic()}
                    )
                    t0 = time.monotonic()
                    gen = await eng.generate(ids, sampling, f"b-{i}")
                    content = tok.decode(gen.token_ids, skip_special_tokens=True)
                    out.update(
                        prompt_ids=ids,
                        response_ids=gen.token_ids,
                        logprobs=gen.logprobs,
                        mask=[1] * len(gen.token_ids),
                    )
                    out["records"].append(
                        {"name": "generate", "start": t0, "end": time.monotonic()}
                    )
                    t0 = time.monotonic()
                    out["reward"] = float(f"<answer>{row['ground_truth']}</answer>" in content)
                    out["records"].append({"name": "score", "start": t0, "end": time.monotonic()})
                    out["status"] = "completed"
            except Exception as exc:
                out["status"], out["error"] = "failed", repr(exc)
        return out

    return await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))


def cpu_us_per_sample(run: Any, samples: int) -> float:
    gc.collect()
    start = time.process_time()
    run()
    return (time.process_time() - start) / samples * 1e6


def part_cpu(samples: int, pairs: int) -> dict[str, Any]:
    rows = arith.rows(samples, seed=0)
    pipe_us, base_us = [], []
    for _ in range(pairs):
        pipe = make_pipeline(engine(0.0), concurrency=256)
        results: list[Any] = []

        def run_pipeline(pipe: Pipeline = pipe, results: list[Any] = results) -> None:
            results.append(asyncio.run(pipe.run_batch(rows)))

        pipe_us.append(cpu_us_per_sample(run_pipeline, samples))
        assert results[0].stats.by_status == {"completed": samples}
        base_us.append(
            cpu_us_per_sample(lambda: asyncio.run(baseline(rows, engine(0.0), 256)), samples)
        )
    p, b = statistics.median(pipe_us), statistics.median(base_us)
    return {
        "samples_per_run": samples,
        "pairs": pairs,
        "pipeline_cpu_us_per_sample": round(p, 1),
        "baseline_cpu_us_per_sample": round(b, 1),
        "overhead_cpu_us_per_sample": round(p - b, 1),
        "overhead_cpu_us_per_stage": round((p - b) / STAGES_PER_SAMPLE, 1),
        "pipeline_runs_us": [round(x, 1) for x in pipe_us],
        "baseline_runs_us": [round(x, 1) for x in base_us],
    }


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * 4096 / 2**20


async def run_in_flight(samples: int, latency: float) -> dict[str, Any]:
    rows = arith.rows(samples, seed=1)
    pipe = make_pipeline(engine(latency), concurrency=samples)
    before = rss_mb()
    peak = {"rss": before, "inflight": 0}

    async def watch() -> None:
        while True:
            await asyncio.sleep(latency / 4)
            peak["rss"] = max(peak["rss"], rss_mb())
            peak["inflight"] = max(peak["inflight"], len(pipe.inflight()))

    watcher = asyncio.create_task(watch())
    start = time.monotonic()
    result = await pipe.run_batch(rows)
    wall = time.monotonic() - start
    watcher.cancel()
    assert result.stats.by_status == {"completed": samples}
    return {
        "wall_s": wall,
        "rss_growth_mb": peak["rss"] - before,
        "max_in_flight": peak["inflight"],
    }


def part_memory(samples: int, latency: float) -> dict[str, Any]:
    timed = asyncio.run(run_in_flight(samples, latency))
    tracemalloc.start()
    asyncio.run(run_in_flight(samples, latency))
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "samples_in_flight": samples,
        "max_in_flight_seen": timed["max_in_flight"],
        "latency_s": latency,
        "wall_s": round(timed["wall_s"], 3),
        "wall_over_floor_s": round(timed["wall_s"] - latency, 3),
        "rss_growth_mb": round(timed["rss_growth_mb"], 1),
        "rss_kb_per_sample": round(timed["rss_growth_mb"] * 1024 / samples, 2),
        "python_alloc_peak_mb": round(traced_peak / 2**20, 1),
        "python_alloc_kb_per_sample": round(traced_peak / 1024 / samples, 2),
    }


def trivial_stage(k: int) -> Any:
    async def stage(item: Any, ctx: Any) -> None:
        await asyncio.sleep(0)
        item.artifacts[f"k{k}"] = k

    stage.__name__ = f"trivial_{k}"
    return stage


async def bare_asyncio(samples: int, stages: int) -> list[Any]:
    """The issue's baseline: the same awaits, a semaphore, a per-sample timeout, try/except."""
    slots = asyncio.Semaphore(256)

    async def one(i: int) -> tuple[str, dict[int, tuple[float, float]]]:
        async with slots:
            records: dict[int, tuple[float, float]] = {}
            try:
                async with asyncio.timeout(60):
                    for k in range(stages):
                        t0 = time.monotonic()
                        await asyncio.sleep(0)
                        records[k] = (t0, time.monotonic())
                return "completed", records
            except Exception:
                return "failed", records

    return await asyncio.gather(*(one(i) for i in range(samples)))


def trivial_pairs(samples: int, pairs: int, stages: int, wrap: Any) -> dict[str, Any]:
    """ABAB pairs of the pipeline and the bare baseline, each run inside ``wrap``."""
    rows = [{"prompt": f"q{i}"} for i in range(samples)]
    pipe = Pipeline([trivial_stage(k) for k in range(stages)], tokenizer=ByteTokenizer(),
                    max_concurrency=256, sample_timeout_s=60)
    pipe_us, base_us = [], []
    for _ in range(pairs):
        pipe_us.append(wrap(lambda: cpu_us_per_sample(
            lambda: asyncio.run(pipe.run_batch(rows)), samples)))
        base_us.append(wrap(lambda: cpu_us_per_sample(
            lambda: asyncio.run(bare_asyncio(samples, stages)), samples)))
    p, b = statistics.median(pipe_us), statistics.median(base_us)
    return {"pipeline_cpu_us_per_sample": round(p, 1),
            "bare_asyncio_cpu_us_per_sample": round(b, 1),
            "ratio": round(p / b, 2),
            "pipeline_runs_us": [round(x, 1) for x in pipe_us],
            "baseline_runs_us": [round(x, 1) for x in base_us]}


def part_trivial(samples: int, pairs: int, stages: int = 5) -> dict[str, Any]:
    """The goal's figure with the collector as the library leaves it (a trainer's process),
    and, for reference, both sides under the edge settings of ``asyncio_run`` and the CLI."""
    return {"stages": stages, "samples_per_run": samples, "pairs": pairs, "goal_ratio": 3.0,
            **trivial_pairs(samples, pairs, stages, lambda fn: fn()),
            "edge_gc": trivial_pairs(samples, pairs, stages, under_edge_gc)}


async def await_one_second(item: Any, ctx: Any) -> None:
    await asyncio.sleep(1.0)


async def wall_in_flight(samples: int, template: bool) -> float:
    if template:
        from transformers import AutoTokenizer

        from pipeline import Generate, ensure_tiny_model

        tokenizer: Any = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
        stages: list[Any] = [BuildPrompt(), Generate()]
        eng: Any = SimulatedEngine(latency_s=1.0, latency_sigma=0.0, tail_prob=0.0)
    else:
        tokenizer, stages, eng = ByteTokenizer(), [await_one_second], None
    pipe = Pipeline(stages, engine=eng, tokenizer=tokenizer, max_concurrency=samples,
                    sample_timeout_s=120, sampling={"max_tokens": 16})
    rows = [{"prompt": f"What is {i} plus {i + 1}?"} for i in range(samples)]
    start = time.perf_counter()
    result = await pipe.run_batch(rows)
    wall = time.perf_counter() - start
    assert result.stats.by_status == {"completed": samples}, result.stats.by_status
    return wall


def under_edge_gc(fn: Any) -> Any:
    """Run ``fn`` with the collector set as ``asyncio_run`` and the CLI set it."""
    from pipeline._gc import rollout_gc

    with rollout_gc():
        return fn()


async def bare_in_flight(samples: int) -> float:
    """The floor of the one-stage figure: the same 1 s awaits in a bare ``asyncio.gather``
    with a per-sample timeout."""
    async def one() -> None:
        async with asyncio.timeout(120):
            await asyncio.sleep(1.0)

    start = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(samples)))
    return time.perf_counter() - start


def part_in_flight_goals(samples: int, repeats: int) -> dict[str, Any]:
    """Medians of ``repeats`` runs each (one run varies by about 0.05 s here)."""
    out: dict[str, Any] = {"samples_in_flight": samples, "latency_s": 1.0, "repeats": repeats,
                           "goals_s": {"one_stage": 1.3, "template_path": 2.5}}

    def median_of(fn: Any) -> tuple[float, list[float]]:
        walls = [round(fn(), 3) for _ in range(repeats)]
        return statistics.median(walls), walls

    runs = {"one_stage": lambda: asyncio.run(wall_in_flight(samples, False)),
            "template_path": lambda: asyncio.run(wall_in_flight(samples, True)),
            "bare_asyncio_one_stage": lambda: asyncio.run(bare_in_flight(samples))}
    for name, run in runs.items():
        out[f"{name}_wall_s_library_gc"], out[f"{name}_runs_library_gc"] = median_of(run)
        out[f"{name}_wall_s_edge_gc"], out[f"{name}_runs_edge_gc"] = median_of(
            lambda run=run: under_edge_gc(run))
    return out


def part_lag(samples: int) -> dict[str, Any]:
    from judgers import Ticker, answer, row

    from pipeline import Judge
    from pipeline.judgers import MathJudger

    rows = [row(f"so the answer is \\boxed{{{i % 97}}}", i % 97) for i in range(samples)]

    async def batch() -> dict[str, float]:
        pipe = Pipeline([answer, Judge(MathJudger())], max_concurrency=256)
        items = pipe.make_items(rows)
        async with Ticker() as ticker:
            result = await pipe.run_batch(items)
        assert all(s.reward == 1.0 for s in result.samples)
        return ticker.summary()

    return {"samples": samples, "goal_lag_p99_ms": 50,
            "library_gc": asyncio.run(batch()),
            "edge_gc": under_edge_gc(lambda: asyncio.run(batch()))}


def goals_only(parts: list[str], samples: int, pairs: int, in_flight: int, repeats: int,
               name: str, quick: bool) -> None:
    """Part 3's goal figures alone (a before/after comparison in one sitting)."""
    figures: dict[str, Any] = {"engine": "simulated (no model)",
                               "load_average_before": os.getloadavg()}
    if "trivial" in parts:
        figures["trivial_stages"] = part_trivial(samples, pairs)
        print(f"5 trivial stages: {figures['trivial_stages']}")
    if "in_flight" in parts:
        figures["in_flight_goals"] = part_in_flight_goals(in_flight, repeats)
        print(f"{in_flight} in flight, 1 s: {figures['in_flight_goals']}")
    figures["load_average_after"] = os.getloadavg()
    if not quick:
        print(f"written to {write_result(name, figures)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--parts", nargs="+", choices=["trivial", "in_flight"],
                        help="only these goals' parts (5 trivial stages; 10,000 in flight "
                             "at 1 s), written to --name")
    parser.add_argument("--name", default="overhead_goals", help="results file for --parts")
    args = parser.parse_args()
    samples, pairs, in_flight = (500, 2, 1000) if args.quick else (4000, 5, 10_000)
    if args.parts:
        goals_only(args.parts, samples, pairs, in_flight, 1 if args.quick else 3, args.name,
                   args.quick)
        return
    cpu = part_cpu(samples, pairs)
    print(
        f"CPU per sample: pipeline {cpu['pipeline_cpu_us_per_sample']} us, hand-written "
        f"baseline {cpu['baseline_cpu_us_per_sample']} us -> overhead "
        f"{cpu['overhead_cpu_us_per_sample']} us/sample, "
        f"{cpu['overhead_cpu_us_per_stage']} us/stage"
    )
    mem = part_memory(in_flight, 1.0)
    print(
        f"{mem['samples_in_flight']} in flight on 1 s latency: wall {mem['wall_s']} s "
        f"(+{mem['wall_over_floor_s']} s over the floor), RSS +{mem['rss_growth_mb']} MB "
        f"({mem['rss_kb_per_sample']} KB/sample), Python allocations peak "
        f"{mem['python_alloc_peak_mb']} MB ({mem['python_alloc_kb_per_sample']} KB/sample)"
    )
    trivial = part_trivial(samples, pairs)
    print(f"5 trivial stages: pipeline {trivial['pipeline_cpu_us_per_sample']} us/sample, "
          f"bare asyncio {trivial['bare_asyncio_cpu_us_per_sample']} us -> ratio "
          f"{trivial['ratio']} (goal <= 3); under edge GC {trivial['edge_gc']['ratio']}")
    goals = part_in_flight_goals(in_flight, 1 if args.quick else 3)
    print(f"{in_flight} in flight, 1 s (medians): " + ", ".join(
        f"{k.removesuffix('_wall_s_edge_gc')} {v} s" for k, v in goals.items()
        if k.endswith("_wall_s_edge_gc")) + " under edge GC; " + ", ".join(
        f"{k.removesuffix('_wall_s_library_gc')} {v} s" for k, v in goals.items()
        if k.endswith("_wall_s_library_gc")) + " with CPython's defaults")
    lag = part_lag(samples)
    print(f"judge-stage batch loop lag: {lag}")
    if not args.quick:
        path = write_result(
            "overhead", {"engine": "simulated (no model)", "load_average": os.getloadavg(),
                         "cpu": cpu, "memory": mem, "trivial_stages": trivial,
                         "in_flight_goals": goals, "judge_stage_lag": lag}
        )
        print(f"written to {path}")


if __name__ == "__main__":
    main()
