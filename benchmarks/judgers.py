"""Judging speed and event-loop responsiveness: process pool, Judge stage, chaos batch, sandbox.

Run:  python benchmarks/judgers.py           (about two minutes on 2 cores)
      python benchmarks/judgers.py --quick   (smaller counts, for a smoke run)

Writes benchmarks/results/judgers.json. Sections:

- pool: a worker's cold start, the round trip of one call, calls/s with the pool full, the
  cost of "one fresh process per call" (the alternative to a pool), and how long a hung call
  takes to be killed and its worker replaced.
- judge_stage: samples/s of a Pipeline whose only work is judging (math on the loop, a sync
  reward function in the pool, the same function inline), against the runner alone. With
  stages that never wait, the runner finishes many samples per loop iteration, so the lag
  there measures batch CPU work, not a judge blocking (compare runner_only_lag).
- chaos: a batch with crashing, hanging, dying and slow judges; every sample accounted for,
  the event loop's lag while it runs (a 5 ms ticker), and the same slow judge run on the
  loop as the control.
- sandbox: latency of one sandboxed code run, runs/s, and how long an infinite loop and a
  fork bomb take to be stopped and swept.

The reward functions come from the test plugin (tests/judger_plugin): standard library only,
so a fresh worker imports them in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import operator
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from _common import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "judger_plugin"))

from judger_plugin_demo import rewards

from pipeline import AgentMessage, AgentRolloutItem, Context, Pipeline, artifacts
from pipeline.judgers import (
    JUDGE_RECORDS,
    CodeJudger,
    FunctionJudger,
    JudgeResult,
    MathJudger,
    ProcessPool,
)
from pipeline.stages._judge import Judge, JudgerSpec


async def answer(item: AgentRolloutItem, ctx: Context) -> None:
    item.artifacts[artifacts.MESSAGES] = [
        AgentMessage(role="assistant", content=item.data.extra["answer"])]


def row(text: str, truth: Any, source: str = "ok", **extra: Any) -> dict[str, Any]:
    return {"prompt": "q", "ground_truth": truth, "data_source": source,
            "extra": {"answer": text, **extra}}


class Crash:
    name = "crash"

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        raise RuntimeError("judge bug")


class Hang:
    name = "hang"

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        await asyncio.sleep(3600)
        raise AssertionError


class Ticker:
    """Measures event-loop lag (how late a 5 ms sleep wakes up) and garbage-collector pauses
    (a full collection over a big batch's objects stalls the loop like any blocking call)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self.gc_pauses: list[float] = []
        self.task: asyncio.Task[None] | None = None
        self._gc_start = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_pauses.append(time.perf_counter() - self._gc_start)

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.005)
            self.lags.append(time.perf_counter() - start - 0.005)

    async def __aenter__(self) -> Ticker:
        gc.callbacks.append(self._on_gc)
        self.task = asyncio.create_task(self.run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(0.01)
        gc.callbacks.remove(self._on_gc)
        assert self.task is not None
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass

    def summary(self) -> dict[str, float]:
        lags = sorted(self.lags)
        pick = lambda q: round(lags[min(len(lags) - 1, int(q * len(lags)))] * 1000, 2)  # noqa: E731
        return {"ticks": len(lags), "lag_p50_ms": pick(0.5), "lag_p99_ms": pick(0.99),
                "lag_max_ms": round(lags[-1] * 1000, 2),
                "gc_pause_max_ms": round(max(self.gc_pauses, default=0.0) * 1000, 2),
                "gc_pauses_over_50ms": sum(p > 0.05 for p in self.gc_pauses)}


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 3)


async def bench_pool(calls: int) -> dict[str, Any]:
    cold = []
    for _ in range(5):
        started = time.perf_counter()
        async with ProcessPool(1) as pool:
            await pool.call(operator.add, 1, 2)
            cold.append(time.perf_counter() - started)
    async with ProcessPool(2) as pool:
        await pool.call(operator.add, 1, 2)
        started = time.perf_counter()
        for i in range(calls):
            await pool.call(operator.add, i, 1)
        sequential = (time.perf_counter() - started) / calls
        started = time.perf_counter()
        await asyncio.gather(*(pool.call(operator.add, i, 1) for i in range(calls)))
        parallel_rate = calls / (time.perf_counter() - started)
        replace = []
        for _ in range(5):
            started = time.perf_counter()
            try:
                await pool.call(time.sleep, 60, timeout_s=0.05)
            except TimeoutError:
                pass
            await pool.call(operator.add, 1, 2)  # served by a fresh worker
            replace.append(time.perf_counter() - started - 0.05)
    per_call_process = []
    for _ in range(10):
        started = time.perf_counter()
        async with ProcessPool(1) as pool:
            await pool.call(rewards.exact, "", "1", 1, {})
        per_call_process.append(time.perf_counter() - started)
    return {
        "worker_cold_start_and_first_call_ms": median_ms(cold),
        "call_round_trip_us": round(sequential * 1e6, 1),
        "calls_per_s_pool_of_2": round(parallel_rate),
        "one_fresh_process_per_call_ms": median_ms(per_call_process),
        "kill_and_replace_after_timeout_ms": median_ms(replace),
        "note": "kill_and_replace: from the 50 ms timeout firing to the next call's result "
                "on a fresh worker",
    }


async def run_batch(stages: list[Any], rows: list[dict[str, Any]], concurrency: int = 256
                    ) -> tuple[float, Any, dict[str, float]]:
    pipeline = Pipeline(stages, max_concurrency=concurrency)
    items = pipeline.make_items(rows)
    async with Ticker() as ticker:
        started = time.perf_counter()
        result = await pipeline.run_batch(items)
        wall = time.perf_counter() - started
    return wall, result, ticker.summary()


async def bench_judge_stage(samples: int) -> dict[str, Any]:
    rows = [row(f"so the answer is \\boxed{{{i % 97}}}", i % 97) for i in range(samples)]
    out: dict[str, Any] = {"samples": samples}
    wall, _, lag = await run_batch([answer], rows)
    out["runner_only_samples_per_s"] = round(samples / wall)
    out["runner_only_lag"] = lag
    wall, result, lag = await run_batch([answer, Judge(MathJudger())], rows)
    assert all(s.reward == 1.0 for s in result.samples)
    out["math_samples_per_s"] = round(samples / wall)
    out["math_lag"] = lag
    async with ProcessPool(2) as pool:
        judge = Judge(FunctionJudger(rewards.exact, pool=pool))
        await pool.call(operator.add, 1, 2)
        plain = [row(str(i), i) for i in range(samples)]
        wall, result, lag = await run_batch([answer, judge], plain)
        assert all(s.reward == 1.0 for s in result.samples)
        out["sync_fn_in_pool_of_2_samples_per_s"] = round(samples / wall)
        out["sync_fn_in_pool_lag"] = lag
    inline = Judge(FunctionJudger(rewards.exact, mode="inline"))
    wall, _, _ = await run_batch([answer, inline], [row(str(i), i) for i in range(samples)])
    out["sync_fn_inline_samples_per_s"] = round(samples / wall)
    return out


async def bench_chaos(samples: int) -> dict[str, Any]:
    async with ProcessPool(2) as pool:
        def sync(fn: Any, **options: Any) -> FunctionJudger:
            return FunctionJudger(fn, pool=pool, **options)

        judge = Judge([MathJudger(), sync(rewards.exact)], routes={
            "sync_crash": [JudgerSpec(sync(rewards.crash), on_error="score")],
            "sync_hang": [sync(rewards.spin, timeout_s=0.3)],
            "sync_die": [sync(rewards.die)],
            "sync_slow": [sync(rewards.slow)],
            "async_crash": [Crash()],
            "async_hang": [JudgerSpec(Hang(), timeout_s=0.2)],
        })
        kinds = {0: "sync_hang", 1: "sync_crash", 2: "sync_die", 3: "async_crash",
                 4: "async_hang"}
        rows = []
        for i in range(samples):
            source = kinds.get(i % 50, "sync_slow" if i % 10 == 5 else "ok")
            rows.append(row(str(i), i, source, sleep_s=0.05))
        wall, result, lag = await run_batch([answer, judge], rows, concurrency=64)
        killed, started = pool.killed, pool.started
    outcomes: Counter[str] = Counter()
    for item in result.items:
        record = item.artifacts[JUDGE_RECORDS][0]
        outcomes[f"{item.data.data_source}:{record.status}"] += 1
    control_rows = [row("x", None, "x", sleep_s=0.05)] * 20
    inline = Judge(FunctionJudger(rewards.slow, mode="inline"))
    _, _, control = await run_batch([answer, inline], control_rows, concurrency=4)
    return {
        "samples": samples, "wall_s": round(wall, 3), "samples_returned": len(result.samples),
        "by_status": dict(Counter(s.status.value for s in result.samples)),
        "judge_records": dict(sorted(outcomes.items())),
        "workers_killed": killed, "workers_started": started,
        "lag_during_batch": lag,
        "control_slow_fn_on_the_loop": {"samples": len(control_rows), **control},
        "mix": "per 50 samples: 1 sync hang (0.3 s limit), 1 sync crash (on_error=score), "
               "1 worker death, 1 async crash, 1 async hang (0.2 s limit); 1 in 10 a sync "
               "function sleeping 50 ms; the rest math + sync exact match",
    }


async def bench_sandbox(runs: int) -> dict[str, Any]:
    tests = ["assert add(1, 2) == 3"]
    good = "```python\ndef add(a, b):\n    return a + b\n```"

    def item(code: str) -> AgentRolloutItem:
        return AgentRolloutItem(uid="u-0", group_id="u", data={"messages": [
            {"role": "user", "content": "q"}], "ground_truth": tests}, artifacts={
            artifacts.MESSAGES: [AgentMessage(role="assistant", content=code)]})

    judger = CodeJudger(timeout_s=1.0, max_processes=16, concurrency=2)
    try:
        facts = await judger.sandbox.facts()
        latencies = []
        for _ in range(max(3, runs // 4)):
            started = time.perf_counter()
            assert (await judger.judge(item(good))).score == 1.0
            latencies.append(time.perf_counter() - started)
        started = time.perf_counter()
        await asyncio.gather(*(judger.judge(item(good)) for _ in range(runs)))
        rate = runs / (time.perf_counter() - started)
        started = time.perf_counter()
        loop = await judger.judge(item("while True:\n    pass"))
        loop_s = time.perf_counter() - started
        bomb_code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n" \
                    "        pass"
        started = time.perf_counter()
        bomb = await judger.judge(item(bomb_code))
        bomb_s = time.perf_counter() - started
    finally:
        await judger.aclose()
    return {
        "facts": {"privileges_dropped": facts.privileges_dropped,
                  "network_isolated": facts.network_isolated},
        "passing_run_latency_ms": median_ms(latencies),
        "runs_per_s_concurrency_2": round(rate, 1),
        "infinite_loop_1s_limit_total_s": round(loop_s, 3),
        "infinite_loop_status": loop.payload["status"],
        "fork_bomb_1s_limit_total_s": round(bomb_s, 3),
        "fork_bomb_status": bomb.payload["status"],
        "fork_bomb_stragglers_killed": bomb.payload["run"]["stragglers_killed"],
    }


async def main(quick: bool) -> None:
    figures: dict[str, Any] = {"loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    figures["pool"] = await bench_pool(200 if quick else 2000)
    print("pool", figures["pool"], flush=True)
    figures["judge_stage"] = await bench_judge_stage(500 if quick else 4000)
    print("judge_stage", figures["judge_stage"], flush=True)
    figures["chaos"] = await bench_chaos(500 if quick else 2000)
    print("chaos", figures["chaos"], flush=True)
    figures["sandbox"] = await bench_sandbox(8 if quick else 40)
    print("sandbox", figures["sandbox"], flush=True)
    figures["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    if not quick:
        print("wrote", write_result("judgers", figures))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller counts; writes nothing")
    args = parser.parse_args()
    asyncio.run(main(args.quick))
