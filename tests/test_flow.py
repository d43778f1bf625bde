"""Adaptive concurrency on the SIMULATED engine's capacity model (slots, decode steps, a KV
budget that preempts): it converges from below and from above, holds still once converged,
does not overshoot the engine by more than one turnover's growth, keeps the engine as busy as
a fixed limit past its capacity, and keeps the fixed limit on an engine without load signals.
Its state is in the progress line, the dumps and the metrics.

The convergence tests run on virtual time (``looptime``: the loop's clock jumps to the next
timer when nothing is ready), so what they assert, the limit's path and tokens per simulated
second, depends on the engine model and the rule only, not on this machine's load, and a run
of thousands of samples takes a second or two.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import looptime

from pipeline import AdaptiveConcurrency, Pipeline, SamplingParams, SimulatedEngine, artifacts
from pipeline.diagnostics import capture_snapshot, render_text
from pipeline.observability import ProgressHeartbeat, batch_metrics
from pipeline.testing import ByteTokenizer

EOS = 2
KV_TOKENS = 8192
MAX_RUNNING = 128
T = TypeVar("T")


def on_virtual_time(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` on an event loop with a virtual clock."""
    with asyncio.Runner(loop_factory=lambda: looptime.new_event_loop(noop_cycles=4)) as runner:
        return runner.run(main())  # type: ignore[arg-type]


def kv_engine(kv_tokens: int = KV_TOKENS) -> SimulatedEngine:
    """Short single-turn replies (16-48 tokens) on a 64-token prompt: the KV budget (about
    100 sequences at 8,192 tokens) binds before the engine's 128 slots."""

    def responder(prompt_ids: list[int], rng: random.Random) -> list[int]:
        return [7] * rng.randint(15, 47) + [EOS]

    return SimulatedEngine(responder=responder, eos_token_id=EOS, seed=3,
                           max_running=MAX_RUNNING, token_time_s=0.01,
                           kv_capacity_tokens=kv_tokens)


async def one_turn(item, ctx):
    gen = await ctx.engine.generate([5] * 64, item.sampling, f"{item.uid}-0")
    item.artifacts[artifacts.PROMPT_IDS] = [5] * 64
    item.artifacts[artifacts.RESPONSE_IDS] = list(gen.token_ids)
    item.artifacts[artifacts.RESPONSE_MASK] = [1] * len(gen.token_ids)
    item.artifacts[artifacts.LOGPROBS] = list(gen.logprobs)


def adaptive_pipeline(engine: SimulatedEngine, **options) -> Pipeline:
    return Pipeline([one_turn], engine=engine, tokenizer=ByteTokenizer(), max_concurrency=16,
                    sample_timeout_s=None, progress_log_s=None,
                    sampling=SamplingParams(max_tokens=256),
                    adaptive_concurrency=AdaptiveConcurrency(interval_s=0.05), **options)


async def two_turns_with_a_tool(item, ctx):
    """Generate, wait 20-80 ms on a "tool" (holding no KV), generate again."""
    rng = random.Random(item.sampling.seed)
    prompt = [5] * 64
    sampled: list[int] = []
    for turn in range(2):
        if turn:
            await asyncio.sleep(rng.uniform(0.02, 0.08))
            prompt = [*prompt, *[6] * 16]
        gen = await ctx.engine.generate(prompt, item.sampling, f"{item.uid}-{turn}")
        prompt = [*prompt, *gen.token_ids]
        sampled += gen.token_ids
    item.artifacts[artifacts.PROMPT_IDS] = [5] * 64
    item.artifacts[artifacts.RESPONSE_IDS] = sampled
    item.artifacts[artifacts.RESPONSE_MASK] = [1] * len(sampled)
    item.artifacts[artifacts.LOGPROBS] = [0.0] * len(sampled)


def tool_engine() -> SimulatedEngine:
    """A KV budget of about 30 of the two-turn sequences."""

    def responder(prompt_ids: list[int], rng: random.Random) -> list[int]:
        return [7] * rng.randint(15, 47) + [EOS]

    return SimulatedEngine(responder=responder, eos_token_id=EOS, seed=5, max_running=128,
                           token_time_s=0.005, kv_capacity_tokens=4096)


async def run(stage: Any, engine: SimulatedEngine, samples: int, start: int,
              adaptive: bool, warm: bool = False) -> dict[str, Any]:
    """One batch on the running (virtual-time) loop (``warm``: the second of two on one
    pipeline): tokens per simulated second and, when adaptive, the limit's path; the
    engine's highest running count."""
    pipe = Pipeline([stage], engine=engine, tokenizer=ByteTokenizer(), max_concurrency=start,
                    sample_timeout_s=None, progress_log_s=None,
                    sampling=SamplingParams(max_tokens=256),
                    adaptive_concurrency=AdaptiveConcurrency() if adaptive else False)
    running: list[int] = []

    async def watch() -> None:
        while True:
            running.append(engine.load().running)
            await asyncio.sleep(0.02)

    clock = asyncio.get_running_loop().time
    if warm:
        await pipe.run_batch([{"prompt": f"w{i}"} for i in range(samples)])
    watcher = asyncio.ensure_future(watch())
    started = clock()
    result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(samples)])
    ended = clock()
    watcher.cancel()
    await engine.aclose()
    assert result.stats.by_status == {"completed": samples}
    out: dict[str, Any] = {"tokens_per_s": result.stats.model_tokens / (ended - started),
                           "engine_holds": max(running), "pipe": pipe, "result": result}
    controller = pipe._loop_state().flow.controller
    if adaptive:
        assert controller is not None
        out["second_half"] = half = controller.summary(started + (ended - started) / 2)
        out["swing"] = (half["limit_max"] - half["limit_min"]) / half["limit_mean"]
        out["highest"] = max(n for _, n in controller.history)
        out["history"] = list(controller.history)
    return out


def test_from_below_and_above_the_limit_converges_holds_still_and_keeps_the_engine_busy():
    # A KV budget of about 25 sequences, so that 1,500 samples are some 30 turnovers: the
    # climb from a start of 8 (x2 per turnover at most) is then a small share of the batch.
    async def main() -> dict[str, Any]:
        # Fixed 1,024 is past the engine's capacity (a queue always waits in it): in this
        # model more samples then cost nothing, so it is the best a fixed limit does.
        best = await run(one_turn, kv_engine(2048), 1500, 1024, adaptive=False)
        return {"best": best,
                "up": await run(one_turn, kv_engine(2048), 1500, 8, adaptive=True),
                "down": await run(one_turn, kv_engine(2048), 1500, 256, adaptive=True)}

    runs = on_virtual_time(main)
    best = runs["best"]["tokens_per_s"]
    for name in ("up", "down"):
        r = runs[name]
        # Within 5% of the best fixed limit, cold (one batch, from its start: 8, or 256,
        # the default max_concurrency, ten times what the engine runs) ...
        assert r["tokens_per_s"] >= 0.95 * best, (name, r["tokens_per_s"], best)
        # ... past what the engine runs at once (it keeps a queue there), ...
        assert r["second_half"]["limit_mean"] > r["engine_holds"], (name, r["second_half"])
        # ... and still over the run's second half: a swing under 10% of its mean.
        assert r["swing"] < 0.10, (name, r["second_half"], r["history"])
    # Never past the engine by more than one turnover's growth (x2) on the way up.
    up = runs["up"]
    assert up["highest"] <= 2 * up["second_half"]["limit_mean"], up["history"]


def test_with_tool_waits_the_limit_converges_past_the_engine_and_keeps_it_busy():
    # Samples out on the tool hold no KV, so the limit must settle above what the engine
    # runs, and get there from a start of 8 within the batch.
    async def main() -> dict[str, Any]:
        return {"best": await run(two_turns_with_a_tool, tool_engine(), 1500, 1024, False),
                "up": await run(two_turns_with_a_tool, tool_engine(), 1500, 8, True),
                "warm": await run(two_turns_with_a_tool, tool_engine(), 1500, 8, True,
                                  warm=True)}

    runs = on_virtual_time(main)
    up, best = runs["up"], runs["best"]["tokens_per_s"]
    # The climb from 8 takes about six turnovers of this 40-turnover batch: within 10% of
    # the best fixed limit cold, within 5% in the next batch (the limit carries over).
    assert up["tokens_per_s"] >= 0.90 * best, (up["tokens_per_s"], best, up["history"])
    assert runs["warm"]["tokens_per_s"] >= 0.95 * best, (runs["warm"]["tokens_per_s"], best)
    assert up["second_half"]["limit_mean"] > up["engine_holds"], up["second_half"]
    assert up["swing"] < 0.10, (up["second_half"], up["history"])
    # Never over the engine's capacity by more than one turnover: the engine's sequences,
    # their queue target (as many again) and the samples on the tool (at most a turnover's
    # share), grown by one turnover (x2).
    assert up["highest"] <= 3 * up["engine_holds"] * 2, (up["engine_holds"], up["history"])


def test_growth_waits_for_completions_while_the_turnover_is_unknown():
    # Replies of 300 tokens at 10 ms a step: no sample completes for 3 simulated seconds,
    # and the KV cache has room all along (what a vLLM server's does while it holds only the
    # prompts it admitted). Growth is clocked by completions: none before the first.
    def responder(prompt_ids: list[int], rng: random.Random) -> list[int]:
        return [7] * 299 + [EOS]

    async def main() -> list[int]:
        engine = SimulatedEngine(responder=responder, eos_token_id=EOS, seed=3,
                                 max_running=4096, token_time_s=0.01,
                                 kv_capacity_tokens=1_000_000)
        pipe = adaptive_pipeline(engine)
        batch = asyncio.ensure_future(pipe.run_batch([{"prompt": "q"}] * 400))
        limits = []
        for _ in range(5):
            await asyncio.sleep(0.5)  # simulated seconds
            limits.append(pipe.flow_state()["limit"])
        await batch
        await engine.aclose()
        return limits

    limits = on_virtual_time(main)
    # 16 at the start, and no growth in the 2.5 s before any sample completed (the turnover
    # estimate's default of 0.5 s had doubled it about every half second).
    assert limits == [16] * 5, limits


def test_the_progress_line_and_metrics_show_the_controller():
    async def main() -> tuple[dict[str, Any], Any, Pipeline, Any]:
        engine = kv_engine()
        pipe = adaptive_pipeline(engine)
        beat = ProgressHeartbeat(pipe, interval_s=60)
        async with beat:
            batch = asyncio.ensure_future(pipe.run_batch([{"prompt": "q"}] * 600))
            await asyncio.sleep(1.0)  # simulated seconds
            progress = beat.fields()["concurrency"]
            result = await batch
        await engine.aclose()
        return progress, result, pipe, pipe._loop_state().flow.controller

    progress, result, pipe, controller = on_virtual_time(main)
    assert controller is not None
    assert progress["decision"] in {"grow", "hold", "shrink", "steer"}
    assert progress["min"] == 4 and progress["max"] == 8192 and progress["limit"] > 16
    assert 0.0 <= progress["kv_usage"] <= 1.0
    metrics = batch_metrics(result, flow=pipe.flow_state())
    assert metrics["rollout/flow/limit"] == controller.slots.size
    assert metrics["rollout/flow/preemptions"] == controller.preemptions


async def test_the_dump_shows_the_controller():
    engine = kv_engine()
    pipe = adaptive_pipeline(engine)
    batch = asyncio.ensure_future(pipe.run_batch([{"prompt": "q"}] * 40))
    await asyncio.sleep(0.3)
    snapshot = capture_snapshot(reason="test")
    await batch
    await engine.aclose()
    flow = [f for f in snapshot.flow if "decision" in f]
    # (A limit under its start of 16 is possible here: requests in transit at the start
    # read as a queue longer than the running batch.)
    assert flow and 4 == flow[0]["min"] <= flow[0]["limit"] <= flow[0]["max"]
    assert "flow control: pipeline=" in render_text(snapshot)


async def test_an_engine_without_load_signals_keeps_the_fixed_limit():
    engine = SimulatedEngine(latency_s=0.005, latency_sigma=0, tail_prob=0)  # latency model
    pipe = adaptive_pipeline(engine)
    result = await pipe.run_batch([{"prompt": "q"}] * 200)
    assert result.stats.by_status == {"completed": 200}
    state = pipe.flow_state()
    assert state is not None
    assert state["decision"] == "fixed" and state["limit"] == 16
    assert [n for _, n in pipe._loop_state().flow.controller.history] == [16]


async def test_resized_slots_let_waiters_in_and_pay_back_a_shrink():
    from pipeline._concurrency.slots import FifoSlots

    slots = FifoSlots(2)
    assert slots.take_now() and slots.take_now() and not slots.take_now()
    waiters = [asyncio.ensure_future(slots.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    slots.resize(4)  # two more: two waiters get in now
    await asyncio.sleep(0)
    assert [w.done() for w in waiters] == [True, True, False]
    slots.resize(1)  # four held, one allowed: three releases pay the debt first
    for _ in range(3):
        slots.release()
    await asyncio.sleep(0)
    assert not waiters[2].done() and slots.in_use == 1
    slots.release()
    await asyncio.sleep(0)
    assert waiters[2].done() and slots.in_use == 1


def test_a_reading_just_after_preemptions_is_not_room_to_grow():
    # A preempted sequence frees its KV and goes back to the engine's queue, so the reading
    # after a burst of preemptions shows KV below kv_high and a queue: "room" by the KV
    # alone. On an H200 (vLLM's server, a 1 GiB cache) growth on such readings took the
    # limit to 1,168 where fixed 256 ran best. Room needs half a turnover without one.
    from pipeline._concurrency.slots import FifoSlots
    from pipeline._runner.adaptive import ConcurrencyController
    from pipeline.engines import EngineLoad

    slots = FifoSlots(100)
    assert all(slots.take_now() for _ in range(100))  # every slot held: demand at the limit
    controller = ConcurrencyController(slots, AdaptiveConcurrency())
    preempted = 0
    now = 0.0
    for _ in range(21):  # 2 s full and preempting: 100 completions a second, turnover 1 s
        for _ in range(10):
            controller.sample_done()
        preempted += 5
        controller.update(EngineLoad(running=100, waiting=100, kv_usage=0.99,
                                     preemptions=preempted, max_running=1024), now)
        now += 0.1
    assert controller.limit == 100 and 0.9 < controller.turnover_s < 1.1
    limits = []
    for _ in range(8):  # the preemptions stop; KV reads 0.8 with the same queue
        for _ in range(10):
            controller.sample_done()
        controller.update(EngineLoad(running=100, waiting=100, kv_usage=0.8,
                                     preemptions=preempted, max_running=1024), now)
        limits.append(round(controller.limit))
        now += 0.1
    assert limits[:4] == [100] * 4, limits  # within half a turnover of the last preemption
    assert limits[-1] > 100, limits  # then the engine has room again, and the limit grows
