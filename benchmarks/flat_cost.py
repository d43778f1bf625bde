"""CPU and memory per sample as the number of samples in flight grows (issue 43).

Run::

    python benchmarks/flat_cost.py                 # 1k / 10k / 100k, both collector settings
    python benchmarks/flat_cost.py --sizes 1000 10000 --quick   # a smoke run, nothing written
    python benchmarks/flat_cost.py --workloads single --settings library_gc --name NAME

The pipeline is imported as a trainer imports it and run with ``asyncio.run`` (not
``pipeline.asyncio_run``), so the collector keeps CPython's defaults (``library_gc``); the
same runs inside ``pipeline.diagnostics.rollout_gc()`` (``edge_gc``: what ``asyncio_run`` and
the CLI set) are reported beside them. Every sample is in flight at once
(``max_concurrency`` = batch size).

Workloads, both on the simulated engine with a 50 ms latency (the engine waits; the CPU spent
is the pipeline's, the stages' and the event loop's):

- ``single``: ``BuildPrompt`` + ``Generate`` + a judge function (``scenarios.arith``);
- ``tool_loop``: ``BuildPrompt`` + ``Loop([Generate(), CallTools()])`` with three calculator
  calls then an answer per sample (four model turns, three tool turns);
- ``single_stream``: ``single`` consumed through ``Pipeline.stream`` by a consumer that keeps
  each ``RolloutSample`` and drops its item (what a trainer that collates samples needs);
  the others through ``run_batch``, whose result holds every item and sample;
- ``single_held``: ``single`` with a 20 s engine latency, so that every sample is in flight
  at once (at 100,000 the batch takes about 10 s to start): with 50 ms, samples finish while
  later ones start, and how many are in flight at once is the scheduler's to decide (its
  1,000 row is mostly the idle loop's own CPU over 20 s: compare its 100,000 row with
  ``single``'s 1,000);
- ``bare_asyncio``: the floor, no pipeline at all: a hand-rolled ``asyncio.gather`` loop
  over the same rows, tokenizer, simulated engine and answer check, keeping a small dict per
  sample (its ids, reply, logprobs and reward): what any asyncio program pays the collector
  for the same samples in flight.

Per run: process CPU time per sample (the whole ``run_batch``: items, stages, samples,
stats), wall time, when the first sample finished, the samples' latency (stages begun to
ended; median and 99th percentile) and the most samples in flight at once (from the items'
``started_at`` / ``ended_at``), the peak RSS growth per sample while the batch runs (sampled every
10 ms), the collector's passes per generation and the time they took (``gc.callbacks``), and
what a finished batch still holds per sample (Python allocations alive after ``run_batch``
returned, held by its result; tracemalloc in a separate, smaller run), the objects the
collector tracks per finished sample (held with its item, and as its ``RolloutSample``
alone), per sample in flight and per sample queued for a slot, in all and by type (what each
full collection walks), and how many objects the full passes of a 10,000-sample batch walk
in all, per sample (counted in a separate, untimed run). With ``--ray-driver N``: what a
``RayRolloutPool``'s driver holds while an ``N``-sample stream runs (a local Ray cluster).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import collections
import gc
import os
import statistics
import subprocess
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import write_result
from token_integrity import TOOL_TURNS, TOOLS, TextEngine

import pipeline
from pipeline import (
    BuildPrompt,
    Generate,
    Loop,
    Pipeline,
    SamplingParams,
    SimulatedEngine,
)
from pipeline._gc import rollout_gc
from pipeline.stages import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import calculator_tool, make_registry
from scenarios import arith

LATENCY_S = 0.05
HELD_LATENCY_S = 20.0


def single_pipeline(size: int, latency_s: float = LATENCY_S, timeout_s: float = 600) -> Pipeline:
    tok = ByteTokenizer()
    eng = SimulatedEngine(latency_s=latency_s, latency_sigma=0.0, tail_prob=0.0,
                          responder=arith.responder(tok), eos_token_id=tok.eos_token_id)
    return Pipeline([BuildPrompt(), Generate(), arith.score_answer], engine=eng, tokenizer=tok,
                    max_concurrency=size, sample_timeout_s=timeout_s,
                    sampling={"max_tokens": 64}, seed=1)


def tool_pipeline(size: int) -> Pipeline:
    tok = ByteTokenizer()
    return Pipeline([BuildPrompt(), Loop([Generate(), CallTools()], max_turns=TOOL_TURNS + 2)],
                    engine=TextEngine(tok, LATENCY_S, report_text=False), tokenizer=tok,
                    tools=make_registry([calculator_tool()]), sampling={"max_tokens": 256},
                    sample_timeout_s=600, max_concurrency=size)


def single_rows(size: int) -> list[dict[str, Any]]:
    return arith.rows(size, seed=0)


def tool_rows(size: int) -> list[dict[str, Any]]:
    return [{"prompt": f"Question {i}: add the numbers with the calculator.", "tools": TOOLS}
            for i in range(size)]


WORKLOADS: dict[str, tuple[Callable[[int], Pipeline], Callable[[int], list[Any]]]] = {
    "single": (single_pipeline, single_rows),
    "tool_loop": (tool_pipeline, tool_rows),
    "single_stream": (single_pipeline, single_rows),
    "single_held": (lambda size: single_pipeline(size, HELD_LATENCY_S), single_rows),
    "bare_asyncio": (single_pipeline, single_rows),  # its tokenizer and engine only
}
STREAMED = {"single_stream"}


class Timeline:
    """When each sample's stages began and when it ended (``time.monotonic()``), as two
    arrays of doubles: nothing per sample for the collector to walk."""

    def __init__(self) -> None:
        self.started = array.array("d")
        self.ended = array.array("d")

    def add(self, item: Any) -> None:
        self.note(item.started_at, item.ended_at)

    def note(self, started: float, ended: float) -> None:
        self.started.append(started)
        self.ended.append(ended)

    def figures(self, batch_start: float) -> dict[str, Any]:
        """First sample done (s after the batch began), latency median / p99 (s), and the
        most samples in flight at once."""
        latencies = sorted(e - s for s, e in zip(self.started, self.ended, strict=True))
        peak = in_flight = 0
        for _, step in sorted([(t, 1) for t in self.started] + [(t, -1) for t in self.ended]):
            in_flight += step
            peak = max(peak, in_flight)
        return {"first_done_s": round(min(self.ended) - batch_start, 3),
                "latency_p50_s": round(latencies[len(latencies) // 2], 3),
                "latency_p99_s": round(latencies[int(len(latencies) * 0.99)], 3),
                "peak_in_flight": peak}


class Outcome:
    """What a consumer keeps of a batch (``held``), and the counts checked after it."""

    def __init__(self, held: Any, by_status: dict[str, int], tool_turns_min: int,
                 timeline: Timeline) -> None:
        self.held = held
        self.by_status = by_status
        self.tool_turns_min = tool_turns_min
        self.timeline = timeline


async def bare_batch(pipe: Pipeline, rows: list[Any]) -> Outcome:
    """``bare_asyncio``: one task per row through ``asyncio.gather``, each rendering its
    prompt, awaiting the engine and checking the answer, with no item, record, deadline,
    status or concurrency limit."""
    tok, engine = pipe.resources.tokenizer, pipe.resources.engine
    assert tok is not None and engine is not None
    timeline = Timeline()

    async def one(i: int, row: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        ids = tok.apply_chat_template(row["messages"], add_generation_prompt=True,
                                      tokenize=True)
        gen = await engine.generate(ids, SamplingParams(max_tokens=64, seed=i), f"bare-{i}")
        reward = 1.0 if arith.answer_of(tok.decode(gen.token_ids)) == row["ground_truth"] else 0.0
        timeline.note(started, time.monotonic())
        return {"prompt_ids": ids, "response_ids": gen.token_ids, "logprobs": gen.logprobs,
                "reward": reward}

    kept = await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))
    return Outcome(kept, {"completed": len(kept)}, 0, timeline)


async def consume(workload: str, pipe: Pipeline, rows: list[Any]) -> Outcome:
    """``run_batch`` (its result held), or a stream whose consumer keeps the samples only
    (and notes each one's start and end)."""
    if workload == "bare_asyncio":
        return await bare_batch(pipe, rows)
    timeline = Timeline()
    if workload not in STREAMED:
        result = await pipe.run_batch(rows)
        for item in result.items:
            timeline.add(item)
        return Outcome(result, result.stats.by_status, result.stats.tool_turns_min, timeline)
    kept = []
    async with pipe.stream(rows) as samples:
        async for sample, item in samples:
            kept.append(sample)
            timeline.add(item)
    return Outcome(kept, samples.report.by_status, min(s.tool_turns for s in kept), timeline)


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class CollectorClock:
    """Counts the collector's passes per generation and the time they take."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.passes[info["generation"]] += 1
            self.seconds[info["generation"]] += time.thread_time() - self._start

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


async def one_batch(workload: str, pipe: Pipeline, rows: list[Any]) -> tuple[Outcome, int]:
    peak = [rss_bytes()]

    async def watch() -> None:
        while True:
            await asyncio.sleep(0.01)
            peak[0] = max(peak[0], rss_bytes())

    watcher = asyncio.create_task(watch())
    try:
        result = await consume(workload, pipe, rows)
    finally:
        watcher.cancel()
    return result, peak[0]


def run_once(workload: str, size: int) -> dict[str, Any]:
    make_pipe, make_rows = WORKLOADS[workload]
    pipe, rows = make_pipe(size), make_rows(size)
    gc.collect()
    before = rss_bytes()
    with CollectorClock() as clock:
        cpu0, wall0, began = time.process_time(), time.perf_counter(), time.monotonic()
        result, peak = asyncio.run(one_batch(workload, pipe, rows))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert result.by_status == {"completed": size}, result.by_status
    if workload == "tool_loop":
        assert result.tool_turns_min == TOOL_TURNS, result.tool_turns_min
    schedule = result.timeline.figures(began)
    del result
    return {"cpu_us_per_sample": round(cpu / size * 1e6, 1), "wall_s": round(wall, 2),
            **schedule, "rss_growth_kb_per_sample": round((peak - before) / 1024 / size, 2),
            "gc_passes": clock.passes, "gc_s": [round(s, 3) for s in clock.seconds]}


def kept_after(workload: str, size: int) -> dict[str, Any]:
    """Python allocations still alive, per sample, once ``run_batch`` returned (its result
    held; for a stream, the samples its consumer kept), and the peak while the batch ran;
    both with tracemalloc, so on a smaller batch."""
    make_pipe, make_rows = WORKLOADS[workload]
    pipe, rows = make_pipe(size), make_rows(size)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    result = asyncio.run(consume(workload, pipe, rows))
    gc.collect()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert result.by_status == {"completed": size}
    return {"samples": size,
            "python_alloc_peak_kb_per_sample": round((peak - base) / 1024 / size, 2),
            "kept_by_result_kb_per_sample": round((kept - base) / 1024 / size, 2)}


def in_flight_memory(size: int) -> dict[str, Any]:
    """Python memory per single-turn sample while every sample waits on the engine (the
    engine's latency raised), tracemalloc from before the rows are made: the row, item,
    records, artifacts, messages, task, coroutines and the simulated engine's timer."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    kb = asyncio.run(_in_flight_memory(size, base))
    tracemalloc.stop()
    return {"samples": size, "python_alloc_kb_per_sample_in_flight": kb}


async def _in_flight_memory(size: int, base: int) -> float:
    pipe = single_pipeline(size)
    engine = pipe.resources.engine
    assert isinstance(engine, SimulatedEngine)
    engine.latency_s = 600.0
    batch = asyncio.ensure_future(pipe.run_batch(single_rows(size)))
    for _ in range(60_000):  # bounded: every sample reaches the engine within seconds
        await asyncio.sleep(0.001)
        if len(engine.in_flight) == size:
            break
    gc.collect()
    kb = round((tracemalloc.get_traced_memory()[0] - base) / 1024 / size, 2)
    await engine.aclose()  # the samples end aborted
    await batch
    return kb


def tracked_objects(workload: str, size: int) -> dict[str, Any]:
    """Objects the cyclic collector tracks per sample (``gc.get_objects()``, after a
    collection), in all and by type: per finished sample held in the result, per finished
    sample held as its ``RolloutSample`` alone (what a consumer that keeps only the samples
    would hold, were the items not kept), and, for the single-turn workload, per sample
    waiting on the engine (every sample in flight, the engine's latency raised) and per
    sample queued for a concurrency slot (one slot: all but one sample queue)."""
    make_pipe, make_rows = WORKLOADS[workload]
    out: dict[str, Any] = {}
    base = census()
    result = asyncio.run(consume(workload, make_pipe(size), make_rows(size)))
    out["per_kept_sample"], out["kept_by_type"] = per_sample(census() - base, size)
    if workload not in STREAMED:
        samples = result.held.samples
        del result
        out["per_sample_alone"], _ = per_sample(census() - base, size)
        del samples
    else:
        del result
        out["per_sample_at_last_yield"], out["at_last_yield_by_type"] = asyncio.run(
            _at_last_yield(workload, size))
    if workload == "single":
        out["per_sample_in_flight"], out["in_flight_by_type"] = asyncio.run(
            _in_flight_count(size, size))
        out["per_sample_queued"], out["queued_by_type"] = asyncio.run(
            _in_flight_count(size, 1))
    return out


def census() -> collections.Counter[str]:
    """Tracked objects by type name, after a collection."""
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def per_sample(delta: collections.Counter[str], size: int) -> tuple[float, dict[str, float]]:
    """The total per sample and the types of at least 0.05 per sample."""
    return (round(sum(delta.values()) / size, 1),
            {name: round(n / size, 2) for name, n in delta.most_common() if n / size >= 0.05})


async def _at_last_yield(workload: str, size: int) -> tuple[float, dict[str, float]]:
    """Per sample, as the stream yields its last sample: what the stream still holds beside
    the samples its consumer kept (before issue 43's fifth round: every run, item and
    sample it had yielded)."""
    make_pipe, make_rows = WORKLOADS[workload]
    pipe, rows = make_pipe(size), make_rows(size)
    base = census()
    kept = []
    counts: tuple[float, dict[str, float]] = (0.0, {})
    async with pipe.stream(rows) as samples:
        async for sample, _ in samples:
            kept.append(sample)
            if len(kept) == size:
                del sample, _
                counts = per_sample(census() - base, size)
    return counts


async def _in_flight_count(size: int, slots: int) -> tuple[float, dict[str, float]]:
    """Per sample, once ``slots`` samples wait on the engine and the rest for a slot."""
    pipe = single_pipeline(slots)
    engine = pipe.resources.engine
    assert isinstance(engine, SimulatedEngine)
    engine.latency_s = 600.0
    base = census()
    batch = asyncio.ensure_future(pipe.run_batch(single_rows(size)))
    waiters = None
    for _ in range(60_000):  # bounded: every sample reaches the engine or a slot's queue
        await asyncio.sleep(0.001)
        waiters = waiters or pipe._loop_state().slots.waiters
        if len(engine.in_flight) == slots and len(waiters) == size - slots:
            break
    counts = per_sample(census() - base, size)
    engine.latency_s = 0.0  # the queued samples then end at once, once a slot is theirs
    await engine.aclose()  # the samples at the engine end aborted
    await batch
    return counts


def ray_driver(size: int) -> dict[str, Any]:
    """What a ``RayRolloutPool``'s driver holds while ``pool.stream`` runs, its consumer
    keeping each ``RolloutSample`` and dropping its item (a local Ray cluster of 2 CPUs, two
    workers, ``BuildPrompt`` + ``Generate`` on a 2 ms simulated engine): items and samples
    alive in the driver, and tracked objects per sample, at the middle and last yields."""
    import ray  # here: the library and the other figures do not need Ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local cluster, as the tests start it
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        return asyncio.run(_ray_driver(size))
    finally:
        ray.shutdown()


def ray_worker_pipeline() -> Pipeline:
    return Pipeline([BuildPrompt(), Generate()], engine=SimulatedEngine(latency_s=0.002),
                    tokenizer=ByteTokenizer(), sampling={"max_tokens": 8})


async def _ray_driver(size: int) -> dict[str, Any]:
    from pipeline import AgentRolloutItem, RolloutSample
    from pipeline.distributed import RayRolloutPool

    def alive() -> tuple[dict[str, int], int]:
        gc.collect()
        found = gc.get_objects()
        ours = collections.Counter(type(o).__name__ for o in found
                                   if isinstance(o, (AgentRolloutItem, RolloutSample)))
        return dict(ours), len(found)

    seen: dict[str, Any] = {}
    async with RayRolloutPool(2, ray_worker_pipeline) as pool:
        await pool.run_batch([{"prompt": "warm-up"}])
        base = alive()[1]
        kept = []
        rows = [{"prompt": f"q{i}"} for i in range(size)]
        async with pool.stream(rows) as samples:
            del rows
            async for sample, _ in samples:
                kept.append(sample)
                del sample, _
                if len(kept) in (size // 2, size - 1):
                    by_type, total = alive()
                    seen[str(len(kept))] = {"alive": by_type, "tracked_per_sample": round(
                        (total - base) / size, 1)}
    return {"samples": size, "workers": 2, "at_yield": seen}


def full_pass_walk(workload: str, size: int) -> dict[str, Any]:
    """Objects the collector's full passes walk during one batch with CPython's settings,
    per sample: ``gc.get_objects()`` counted as each full pass starts (a separate, untimed
    run: counting takes time of its own)."""
    make_pipe, make_rows = WORKLOADS[workload]
    pipe, rows = make_pipe(size), make_rows(size)
    gc.collect()
    walked: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            walked.append(len(gc.get_objects()))

    gc.callbacks.append(count)
    try:
        result = asyncio.run(consume(workload, pipe, rows))
    finally:
        gc.callbacks.remove(count)
    assert result.by_status == {"completed": size}
    return {"samples": size, "full_passes": len(walked),
            "walked_per_sample": round(sum(walked) / size, 1)}


def table(sizes: list[int], repeats: int, workloads: list[str],
          settings: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    wraps = {"library_gc": lambda fn: fn(), "edge_gc": rollout_gc_call}
    for workload in workloads:
        for setting, wrap in ((name, wraps[name]) for name in settings):
            rows: dict[str, Any] = {}
            for size in sizes:
                runs = [wrap(lambda size=size, workload=workload: run_once(workload, size))
                        for _ in range(repeats if size < 100_000 else 1)]
                best = statistics.median_low(sorted(r["cpu_us_per_sample"] for r in runs))
                row = next(r for r in runs if r["cpu_us_per_sample"] == best)
                row["cpu_runs_us"] = [r["cpu_us_per_sample"] for r in runs]
                rows[str(size)] = row
                print(f"{workload:9} {setting:10} {size:>7}: {row['cpu_us_per_sample']:6} us/"
                      f"sample, wall {row['wall_s']} s, first done {row['first_done_s']} s, "
                      f"latency p50/p99 {row['latency_p50_s']}/{row['latency_p99_s']} s, "
                      f"in flight <= {row['peak_in_flight']}, RSS "
                      f"+{row['rss_growth_kb_per_sample']} KB/sample, gc passes "
                      f"{row['gc_passes']} in {row['gc_s']} s", flush=True)
            first, last = rows[str(sizes[0])], rows[str(sizes[-1])]
            rows["cpu_ratio_largest_to_smallest"] = round(
                last["cpu_us_per_sample"] / first["cpu_us_per_sample"], 2)
            out.setdefault(workload, {})[setting] = rows
    return out


def rollout_gc_call(fn: Callable[[], Any]) -> Any:
    with rollout_gc():
        return fn()


def library_commit() -> str:
    """The commit of the library measured (``git describe --always --dirty``): a before/after
    pair runs this one script on two checkouts, the other one put first by ``PYTHONPATH``."""
    root = Path(pipeline.__file__).resolve().parent.parent
    out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per size below 100,000 (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="print only, write nothing")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=list(WORKLOADS))
    parser.add_argument("--settings", nargs="+", choices=["library_gc", "edge_gc"],
                        default=["library_gc", "edge_gc"])
    parser.add_argument("--name", default="flat_cost", help="results file name")
    parser.add_argument("--ray-driver", type=int, metavar="SAMPLES", default=0,
                        help="also count what a RayRolloutPool's driver holds mid-stream")
    parser.add_argument("--table-only", action="store_true",
                        help="the CPU table alone (no memory, object or walk counts)")
    args = parser.parse_args()
    figures: dict[str, Any] = {"engine": "simulated (no model)", "latency_s": LATENCY_S,
                               "library_commit": library_commit(),
                               "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                               "load_average_before": os.getloadavg(),
                               "gc_threshold_at_start": gc.get_threshold(),
                               "goal_cpu_ratio": 1.15, "goal_memory_kb_per_sample": 5,
                               "table": table(args.sizes, args.repeats, args.workloads,
                                              args.settings)}
    if not args.table_only:
        # single_held holds what single holds, only longer: counted in the table alone.
        counted = [w for w in args.workloads if w not in ("single_held", "bare_asyncio")]
        figures["kept"] = {w: kept_after(w, 2000) for w in counted}
        if "single" in args.workloads:
            figures["kept"]["single_in_flight"] = in_flight_memory(2000)
        figures["tracked_objects"] = {w: tracked_objects(w, 2000) for w in counted}
        figures["full_pass_walk"] = {w: full_pass_walk(w, 10_000) for w in counted}
        print(f"after run_batch: {figures['kept']}; tracked objects: "
              f"{figures['tracked_objects']}; full passes: {figures['full_pass_walk']}")
    if args.ray_driver:
        figures["ray_driver"] = ray_driver(args.ray_driver)
        print(f"ray driver: {figures['ray_driver']}")
    figures["load_average_after"] = os.getloadavg()
    if not args.quick:
        print(f"written to {write_result(args.name, figures)}")


if __name__ == "__main__":
    main()
