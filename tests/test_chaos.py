"""Seeded chaos: thousands of samples with every kind of fault, every one accounted for.

Each sample draws one fault from a seeded plan: engine errors, engine hangs (with an abort
that works or raises), raising, hanging and stray-cancelled stages, stages that swallow the
deadline's cancellation (once, or every one for a while), block the event loop past the
deadline, or raise ``SystemExit``/``KeyboardInterrupt``, failing and hanging cleanups, a NaN
counter, a badly typed item field, a NaN reward. The engine is
:class:`SimulatedEngine` (simulated, named as such), extended only to look up each request's
planned fault. Checked: every sample ends with the status its fault implies, every started
cleanup ran exactly once, and nothing is left behind (no task, no in-flight entry, no limiter
token). A second batch is cancelled at a random moment, with the same checks.

The CI version runs 2,000 samples; the longer one is this file as a script:

    python tests/test_chaos.py --samples 20000 --seed 7 --timeout 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass, field

import pytest

from pipeline import (
    AgentRolloutItem,
    BuildPrompt,
    Context,
    EngineError,
    Generate,
    Pipeline,
    SimulatedEngine,
    Status,
    artifacts,
)
from pipeline.ratelimit import LimiterRegistry
from pipeline.testing import ByteTokenizer

# fault -> (weight, the status it must end with)
FAULTS: dict[str, tuple[float, Status]] = {
    "ok": (40, Status.COMPLETED),
    "nan_counter": (4, Status.COMPLETED),
    "cleanup_fails": (5, Status.COMPLETED),
    "cleanup_hangs": (3, Status.COMPLETED),
    "stage_raises": (8, Status.FAILED),
    "stray_cancel": (4, Status.FAILED),
    "engine_error": (6, Status.FAILED),
    "nan_reward": (4, Status.FAILED),
    "bad_field": (4, Status.FAILED),
    "stage_hangs": (5, Status.TIMEOUT),
    "swallows_deadline": (3, Status.TIMEOUT),
    "deaf_for_a_while": (2, Status.TIMEOUT),
    "blocks_loop_past_deadline": (1, Status.TIMEOUT),
    "system_exit": (2, Status.FAILED),
    "keyboard_interrupt": (2, Status.FAILED),
    "engine_hangs": (5, Status.TIMEOUT),
    "engine_hangs_abort_raises": (3, Status.TIMEOUT),
}
SAMPLE_TIMEOUT_S = 2.0  # far above a healthy sample, even on a loaded 2-core machine
CLEANUP_TIMEOUT_S = 0.2


@dataclass
class Plan:
    """The seeded fault of every row, and what the harness saw happen."""

    faults: list[str]
    uid_fault: dict[str, str] = field(default_factory=dict)
    started: collections.Counter[str] = field(default_factory=collections.Counter)
    cleanups: collections.Counter[str] = field(default_factory=collections.Counter)
    aborts: collections.Counter[str] = field(default_factory=collections.Counter)

    @classmethod
    def draw(cls, count: int, seed: int) -> Plan:
        rng = random.Random(seed)
        names = list(FAULTS)
        weights = [FAULTS[n][0] for n in names]
        return cls(rng.choices(names, weights, k=count))


class ChaosEngine(SimulatedEngine):
    """The simulated engine, with each request's planned engine fault."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(latency_s=0.005, latency_sigma=0.5, tail_prob=0.02, eos_token_id=2)
        self.plan = plan

    async def generate(self, prompt_ids, sampling, request_id):
        fault = self.plan.uid_fault[request_id.rsplit("-", 1)[0]]
        if fault == "engine_error":
            await asyncio.sleep(0.001)
            raise EngineError("chaos: engine fault")
        if fault.startswith("engine_hangs"):
            await asyncio.get_running_loop().create_future()  # never resolves
        return await super().generate(prompt_ids, sampling, request_id)

    async def abort(self, request_id: str) -> None:
        self.plan.aborts[request_id] += 1
        if self.plan.uid_fault[request_id.rsplit("-", 1)[0]] == "engine_hangs_abort_raises":
            raise EngineError("chaos: abort failed")
        await super().abort(request_id)


class ChaosStage:
    """Does the sample's planned stage fault; counts runs and cleanups."""

    name = "chaos"

    def __init__(self, plan: Plan) -> None:
        self.plan = plan

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        fault = self.plan.faults[item.index]
        self.plan.uid_fault[item.uid] = fault
        self.plan.started[item.uid] += 1
        if fault == "stage_raises":
            raise ValueError("chaos: stage failed {with braces}")
        if fault == "stage_hangs":
            await asyncio.sleep(3600)
        if fault == "swallows_deadline":
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)
        if fault == "deaf_for_a_while":  # ignores every cancellation until 0.3 s after it
            until = None
            while until is None or time.monotonic() < until:
                try:
                    await asyncio.sleep(3600 if until is None else until - time.monotonic())
                except asyncio.CancelledError:
                    until = until or time.monotonic() + 0.3
        if fault == "blocks_loop_past_deadline":
            await asyncio.sleep(max(0.0, ctx.time_left() - 0.01))
            time.sleep(0.03)  # noqa: ASYNC251 - the deadline passes while the loop is held
        if fault == "system_exit":
            sys.exit(3)
        if fault == "keyboard_interrupt":
            raise KeyboardInterrupt
        if fault == "stray_cancel":
            future = asyncio.get_running_loop().create_future()
            future.cancel()
            await future
        if fault == "nan_counter":
            item.artifacts[artifacts.TOOL_CALLS] = math.nan

    async def cleanup(self, item: AgentRolloutItem, ctx: Context) -> None:
        self.plan.cleanups[item.uid] += 1
        fault = self.plan.faults[item.index]
        if fault == "cleanup_fails":
            raise OSError("chaos: cleanup failed")
        if fault == "cleanup_hangs":
            await asyncio.sleep(3600)


async def take_token(item: AgentRolloutItem, ctx: Context) -> None:
    """Every sample goes through a shared, fair rate limit (tokens must not leak)."""
    bucket = ctx.resources.limiters.get("tool:chaos", 20_000.0, 64)
    await bucket.acquire(key=item.group_id)


async def finish(item: AgentRolloutItem, ctx: Context) -> None:
    """Write the reward; the planned faults corrupt it or an item field here."""
    plan_fault = ctx.resources.extras["plan"].faults[item.index]
    if plan_fault == "nan_reward":
        item.artifacts[artifacts.REWARD] = math.nan
        return
    if plan_fault == "bad_field":
        item.raw_finish_reason = 404  # a wrongly typed field: the trainer view cannot hold it
    item.artifacts[artifacts.REWARD] = 1.0


def build(plan: Plan, concurrency: int, timeout_s: float) -> Pipeline:
    limiters = LimiterRegistry()
    return Pipeline(
        [BuildPrompt(), ChaosStage(plan), Generate(), take_token, finish],
        engine=ChaosEngine(plan), tokenizer=ByteTokenizer(), limiters=limiters,
        extras={"plan": plan}, sample_timeout_s=timeout_s,
        cleanup_timeout_s=CLEANUP_TIMEOUT_S, max_concurrency=concurrency,
        sampling={"max_tokens": 16},
    )


async def check_nothing_left(pipe: Pipeline, plan: Plan) -> None:
    assert pipe.inflight() == []
    # A stage that ignores its cancellation past the grace (stage_grace: 1.4 s here) is
    # abandoned: the batch ends without waiting for it, and its task ends by itself. On a
    # loaded machine a stage deaf for 0.3 s can pass the grace (seen once in CI: 4 of 1,000
    # tasks); they must still end, within a bound, and nothing may stay behind.
    leftover = [t for t in asyncio.all_tasks() if t.get_name().startswith("sample:")]
    if leftover:
        await asyncio.wait(leftover, timeout=10)
    leftover = [t for t in leftover if not t.done()]
    assert leftover == []
    for uid, runs in plan.started.items():
        assert runs == 1 and plan.cleanups[uid] == 1, (uid, plan.uid_fault[uid])
    bucket = pipe.resources.limiters.get("tool:chaos", 20_000.0, 64)
    ledger = bucket.stats()
    assert ledger.leaked == 0 and ledger.queue_len == 0 and ledger.in_flight == 0
    engine = pipe.resources.engine
    assert isinstance(engine, ChaosEngine) and engine.in_flight == {}


async def run_chaos(samples: int, seed: int, concurrency: int = 256,
                    timeout_s: float = SAMPLE_TIMEOUT_S) -> dict[str, object]:
    """One full batch with every fault; returns figures (raises AssertionError on a miss).

    ``timeout_s`` must leave a healthy sample time to finish on a loaded loop.
    """
    plan = Plan.draw(samples, seed)
    pipe = build(plan, concurrency, timeout_s)
    rows = [{"prompt": f"chaos {i} {{x}}"} for i in range(samples)]
    start = time.perf_counter()
    result = await pipe.run_batch(rows, n=1)
    wall = time.perf_counter() - start
    assert len(result.samples) == samples
    for sample, fault in zip(result.samples, plan.faults, strict=True):
        assert sample.status is FAULTS[fault][1], (fault, sample.status, sample.error)
        assert sample.finish_reason is not None
        if sample.status is not Status.COMPLETED:
            assert sample.masked and sample.error, fault
    for item, fault in zip(result.items, plan.faults, strict=True):
        if fault in ("swallows_deadline", "deaf_for_a_while", "blocks_loop_past_deadline"):
            # No stage starts after the deadline: the engine never saw these samples.
            assert [r.name for r in item.records if r.phase == "run"] == ["build_prompt",
                                                                          "chaos"], fault
    by_fault = collections.Counter(plan.faults)
    for fault in ("engine_hangs", "engine_hangs_abort_raises"):
        hung = [uid for uid, f in plan.uid_fault.items() if f == fault]
        assert all(plan.aborts[f"{uid}-0"] == 1 for uid in hung)
    assert result.stats.skipped_values.get(artifacts.TOOL_CALLS) == by_fault["nan_counter"]
    assert result.stats.reward_mean == 1.0
    await check_nothing_left(pipe, plan)
    assert asyncio.current_task().cancelling() == 0
    return {"samples": samples, "seed": seed, "wall_s": round(wall, 3),
            "by_status": result.stats.by_status, "by_fault": dict(by_fault)}


async def run_cancelled(samples: int, seed: int, concurrency: int = 256,
                        timeout_s: float = SAMPLE_TIMEOUT_S) -> dict[str, object]:
    """A chaos batch cancelled at a seeded random moment: nothing lost, nothing left."""
    plan = Plan.draw(samples, seed)
    pipe = build(plan, concurrency, timeout_s)
    items = pipe.make_items([{"prompt": f"chaos {i}"} for i in range(samples)], n=1)
    delay = random.Random(seed).uniform(0.05, 0.6)
    task = asyncio.create_task(pipe.run_batch(items))
    await asyncio.sleep(delay)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    statuses = collections.Counter(item.status for item in items)
    assert None not in statuses and all(item.finish_reason for item in items)
    await check_nothing_left(pipe, plan)
    return {"samples": samples, "cancel_after_s": round(delay, 3),
            "by_status": {str(k): v for k, v in statuses.items()}}


async def test_chaos_batch_accounts_for_every_sample():
    # A healthy sample's wall time is the loop's work on every sample running beside it
    # (about 2.4 ms each here), so the deadline bounds concurrency x that work on whatever
    # share of a core the loop gets: 256 at once took over 4 s beside 4 CPU-bound processes
    # and timed healthy samples out. 128 at once with 3 s leaves ~10x that work; the batch
    # still waits on about 190 hung samples for 3 s each, 128 at a time.
    figures = await run_chaos(1000, seed=1, concurrency=128, timeout_s=3.0)
    assert sum(figures["by_status"].values()) == 1000
    assert set(figures["by_fault"]) == set(FAULTS)  # every fault drawn, several times


@pytest.mark.parametrize("seed", [2, 3])
async def test_chaos_batch_cancelled_at_a_random_moment(seed):
    figures = await run_cancelled(1000, seed=seed)
    assert figures["by_status"]["aborted"] > 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=3.0, help="sample_timeout_s")
    args = parser.parse_args()

    async def both() -> None:
        print(await run_chaos(args.samples, args.seed, args.concurrency, args.timeout))
        print(await run_cancelled(args.samples, args.seed + 1, args.concurrency, args.timeout))

    asyncio.run(both())


if __name__ == "__main__":
    sys.exit(main())
