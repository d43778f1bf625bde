"""What diagnostics cost and how fast they answer.

Run::

    python benchmarks/diagnostics.py            # full figures (about two minutes)
    python benchmarks/diagnostics.py --quick    # smaller sizes, for a smoke run

1. Dump time with 10,000 stuck samples (10,001 tasks): from ``kill -USR1`` (sent to this
   process) until the dump file is in place, with the loop idle, blocked in ``time.sleep``
   and spinning in pure Python; plus the snapshot/render split. Goal: under 1 s.
2. Watchdog detection latency: the loop blocks (``time.sleep`` and a pure-Python spin) at a
   random phase of the heartbeat; latency is detection time minus block start. Goal:
   threshold + 100 ms.
3. False alarms on a busy but healthy loop: many tasks doing short CPU bursts and a pipeline
   batch for 10 s under a strict threshold (0.25 s). A coroutine measuring its own oversleep
   is the ground truth: an alarm that matches a stall it saw (a long GC pause, say) is real;
   any other alarm is false. Goal: 0 false alarms.
4. Pipeline throughput with diagnostics on (``asyncio_run`` with the dumper, the default
   watchdog and task-age tracking) vs off (a bare uvloop ``asyncio.Runner``), on the
   simulated engine. Runs alternate ABAB (the order flips every pair), and the pair-by-pair
   ratio's median and spread are reported, since one pair is within noise on 2 cores. The
   cyclic GC is collected before and kept off during each timed run on both sides.
   Goal: >= 0.98.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvloop
from _common import write_result

from pipeline import BuildPrompt, Generate, Pipeline, SimulatedEngine
from pipeline.diagnostics import (
    TaskDumper,
    Watchdog,
    asyncio_run,
    capture_snapshot,
    render_json,
    render_text,
)
from pipeline.testing import ByteTokenizer


class Stuck:
    """A stage that never ends; ``all_in`` is set once ``expected`` samples are inside."""

    name = "stuck"

    def __init__(self, expected: int) -> None:
        self.never = asyncio.Event()
        self.all_in = asyncio.Event()
        self.expected = expected
        self.inside = 0

    async def run(self, item: Any, ctx: Any) -> None:
        self.inside += 1
        if self.inside == self.expected:
            self.all_in.set()
        await self.never.wait()


def _names(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("tasks-*.txt")}


def _wait_file(directory: Path, before: set[str], limit: float = 30.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if _names(directory) - before:
            return time.monotonic()
        time.sleep(0.001)
    raise TimeoutError("no dump")


def _spin_until_file(directory: Path, before: set[str], limit: float = 30.0) -> float:
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < limit:
        n += 1
        if n % 2000 == 0 and _names(directory) - before:
            return time.monotonic()
    raise TimeoutError("no dump")


async def part_dump(samples: int, repeats: int) -> dict[str, Any]:
    stuck = Stuck(samples)
    pipe = Pipeline([BuildPrompt(offload=False), stuck], engine=SimulatedEngine(),
                    tokenizer=ByteTokenizer(), max_concurrency=samples, sample_timeout_s=3600)
    batch = asyncio.create_task(pipe.run_batch([{"prompt": f"q{i}"} for i in range(samples)],
                                               n=1))
    await stuck.all_in.wait()
    out: dict[str, Any] = {"samples_stuck": samples, "repeats": repeats}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        dumper = TaskDumper(directory, signum=signal.SIGUSR1).install()
        try:
            for case in ("idle", "sleep", "spin"):
                times = []
                for _ in range(repeats):
                    before = _names(directory)
                    t0 = time.monotonic()
                    os.kill(os.getpid(), signal.SIGUSR1)
                    if case == "idle":
                        done = await asyncio.to_thread(_wait_file, directory, before)
                    elif case == "sleep":
                        done = _wait_file(directory, before)  # blocks the loop thread
                    else:
                        done = _spin_until_file(directory, before)  # spins on the loop thread
                    times.append(done - t0)
                out[f"signal_to_file_s_loop_{case}"] = _summary(times)
            out["text_dump_bytes"] = max((directory / n).stat().st_size
                                         for n in _names(directory))
        finally:
            dumper.close()
    captures, texts, jsons = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        snap = capture_snapshot()
        t1 = time.perf_counter()
        render_text(snap)
        t2 = time.perf_counter()
        render_json(snap)
        t3 = time.perf_counter()
        captures.append(t1 - t0)
        texts.append(t2 - t1)
        jsons.append(t3 - t2)
    out["tasks_in_snapshot"] = len(snap.tasks)
    out["capture_s"] = _summary(captures)
    out["render_text_s"] = _summary(texts)
    out["render_json_s"] = _summary(jsons)
    batch.cancel()
    await asyncio.gather(batch, return_exceptions=True)
    return out


def _block_sleep(seconds: float) -> None:
    time.sleep(seconds)


def _block_spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


async def part_latency(threshold: float, blocks: int) -> dict[str, Any]:
    detected: list[float] = []
    dog = Watchdog(threshold, on_block=lambda r: detected.append(time.monotonic())).start()
    rng = random.Random(0)
    out: dict[str, Any] = {"threshold_s": threshold, "interval_s": dog.interval_s,
                           "blocks_per_kind": blocks}
    try:
        for name, block in (("sleep", _block_sleep), ("spin", _block_spin)):
            excess = []
            for _ in range(blocks):
                await asyncio.sleep(0.1 + rng.uniform(0, dog.interval_s * 2))
                before = len(detected)
                start = time.monotonic()
                block(threshold + 0.4)
                await asyncio.sleep(0.05)
                if len(detected) != before + 1:
                    raise RuntimeError(f"{len(detected) - before} reports for one block")
                excess.append(detected[-1] - start - threshold)
            out[f"excess_over_threshold_s_{name}"] = _summary(excess)
    finally:
        dog.stop()
    worst = max(out[f"excess_over_threshold_s_{k}"]["max"] for k in ("sleep", "spin"))
    out["worst_excess_s"] = worst
    out["goal_met"] = worst <= 0.1
    return out


async def part_false_alarms(threshold: float, seconds: float) -> dict[str, Any]:
    gc_pauses: list[float] = []
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_started[0])

    gc.callbacks.append(on_gc)
    dog = Watchdog(threshold).start()
    stop = time.monotonic() + seconds
    rng = random.Random(1)

    async def cpu_worker() -> int:
        steps = 0
        while time.monotonic() < stop:
            _block_spin(rng.uniform(0.0002, 0.002))
            steps += 1
            await asyncio.sleep(0)
        return steps

    async def pipeline_worker() -> int:
        pipe = _pipeline(SimulatedEngine(latency_s=0.002, latency_sigma=0.5, seed=2))
        done = 0
        while time.monotonic() < stop:
            result = await pipe.run_batch([{"prompt": "busy"}] * 50, n=2)
            done += len(result.samples)
        return done

    stalls: list[tuple[float, float]] = []  # (start, length) of real loop stalls, seen inside

    async def ground_truth() -> int:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            late = time.monotonic() - t0 - 0.01
            if late >= threshold * 0.8:
                stalls.append((t0, late))
        return 0

    try:
        results = await asyncio.gather(pipeline_worker(), ground_truth(),
                                       *(cpu_worker() for _ in range(40)))
    finally:
        dog.stop()
        gc.callbacks.remove(on_gc)
    stats = dog.stats()
    real = [r for r in dog.blocks
            if any(start - 0.05 <= r.started + r.lag_s and r.started <= start + length + 0.05
                   for start, length in stalls)]
    false = len(dog.blocks) - len(real)
    return {"threshold_s": threshold, "seconds": seconds, "cpu_tasks": 40,
            "cpu_steps": sum(results[2:]), "pipeline_samples": results[0],
            "heartbeats": stats.beats, "max_lag_s": round(stats.max_s, 4),
            "mean_lag_s": round(stats.mean_s, 5), "alarms": stats.blocks,
            "alarms_at": [f"{r.lag_s:.3f}s in {r.blocking}" for r in dog.blocks],
            "real_stalls_seen_inside_the_loop": [round(length, 3) for _, length in stalls],
            "gc_max_pause_s": round(max(gc_pauses, default=0.0), 4),
            "false_alarms": false, "goal_met": false == 0}


def _pipeline(engine: SimulatedEngine) -> Pipeline:
    return Pipeline([BuildPrompt(offload=False), Generate()], engine=engine,
                    tokenizer=ByteTokenizer(), max_concurrency=256,
                    sampling={"max_tokens": 64}, seed=1)


def _batch(samples: int) -> Any:
    async def run() -> float:
        pipe = _pipeline(SimulatedEngine(latency_s=0.001, latency_sigma=0.0, tail_prob=0.0))
        rows = [{"prompt": f"question {i}"} for i in range(samples)]
        start = time.perf_counter()
        result = await pipe.run_batch(rows, n=1)
        elapsed = time.perf_counter() - start
        assert result.stats.by_status == {"completed": samples}
        return samples / elapsed
    return run


def _off(samples: int) -> float:
    with _no_gc(), asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return float(runner.run(_batch(samples)()))


def _on(samples: int) -> float:
    with _no_gc():
        return float(asyncio_run(_batch(samples)(), watchdog=True))


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Collect, then keep the cyclic GC off for one timed run: a full collection (up to half
    a second here) landing in one run or the other is noise unrelated to what is measured."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def part_throughput(samples: int, pairs: int) -> dict[str, Any]:
    _off(samples // 4)  # warm up both paths
    _on(samples // 4)
    on, off, ratios = [], [], []
    for i in range(pairs):
        if i % 2 == 0:
            a = _off(samples)
            b = _on(samples)
        else:
            b = _on(samples)
            a = _off(samples)
        off.append(a)
        on.append(b)
        ratios.append(b / a)
    q = statistics.quantiles(ratios, n=4)
    return {"samples_per_run": samples, "pairs": pairs, "order": "AB, BA, AB, ...",
            "off": "bare uvloop asyncio.Runner",
            "on": "asyncio_run: SIGUSR1 dumper + socket, Watchdog(1.0, stall_after_s=300), "
                  "task ages",
            "ratio_on_over_off_median": round(statistics.median(ratios), 4),
            "ratio_iqr": [round(q[0], 4), round(q[2], 4)],
            "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
            "ratios": [round(r, 4) for r in ratios],
            "samples_per_s_off_median": round(statistics.median(off), 1),
            "samples_per_s_on_median": round(statistics.median(on), 1),
            "goal_met": statistics.median(ratios) >= 0.98}


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    args = parser.parse_args()
    quick = args.quick
    figures: dict[str, Any] = {"engine": "simulated (no model)",
                               "load_avg_1m_at_start": round(os.getloadavg()[0], 2)}
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        figures["false_alarms"] = runner.run(part_false_alarms(0.25, 2.0 if quick else 10.0))
        print("false alarms:", figures["false_alarms"], flush=True)
        figures["watchdog_latency"] = runner.run(part_latency(0.5, 3 if quick else 10))
        print("latency:", figures["watchdog_latency"], flush=True)
        figures["dump_10k"] = runner.run(part_dump(2000 if quick else 10_000, 2 if quick else 5))
        print("dump:", figures["dump_10k"], flush=True)
    figures["throughput"] = part_throughput(500 if quick else 8000, 3 if quick else 15)
    print("throughput:", figures["throughput"], flush=True)
    figures["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    if not quick:
        print("written:", write_result("diagnostics", figures))


if __name__ == "__main__":
    main()
