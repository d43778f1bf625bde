"""The runner's failure rules, with real asyncio (nothing in the runner is mocked)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pipeline import (
    AgentRolloutItem,
    BuildPrompt,
    ConfigError,
    Context,
    ExitReason,
    Generate,
    Loop,
    Pipeline,
    RowError,
    SimulatedEngine,
    StageDefinitionError,
    Status,
    artifacts,
    asyncio_run,
)
from pipeline.testing import ByteTokenizer, capture_logs

ROWS = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(8)]


def make(stages, **options):
    options.setdefault("engine", SimulatedEngine(latency_s=0.001, latency_sigma=0, tail_prob=0))
    options.setdefault("tokenizer", ByteTokenizer())
    return Pipeline(stages, **options)


class Recorder:
    """A stage that counts runs and cleanups per sample."""

    name = "recorder"

    def __init__(self) -> None:
        self.runs: dict[str, int] = {}
        self.cleanups: dict[str, int] = {}

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        self.runs[item.uid] = self.runs.get(item.uid, 0) + 1

    async def cleanup(self, item: AgentRolloutItem, ctx: Context) -> None:
        self.cleanups[item.uid] = self.cleanups.get(item.uid, 0) + 1


async def test_completed_samples_are_aligned_and_in_order():
    pipe = make([BuildPrompt(), Generate()], sampling={"max_tokens": 16})
    result = await pipe.run_batch(ROWS, n=3)
    assert len(result.samples) == 24
    for i, (sample, item) in enumerate(zip(result.samples, result.items, strict=True)):
        assert sample.index == i and sample.uid == item.uid
        assert sample.status is Status.COMPLETED and not sample.masked
        assert len(sample.response_ids) == len(sample.response_mask) == len(sample.logprobs)
        assert all(m == 1 for m in sample.response_mask)
        assert sample.prompt_ids == ByteTokenizer().encode(item.artifacts[artifacts.RAW_PROMPT])
        assert [r.name for r in item.records] == ["build_prompt", "generate"]
    groups = [s.group_id for s in result.samples]
    assert groups[0] == groups[2] != groups[3]
    seeds = {it.sampling.seed for it in result.items[:3]}
    assert len(seeds) == 3


async def test_seeded_batches_replay_identically():
    pipe = make([BuildPrompt(), Generate()], seed=7)
    first = await pipe.run_batch(ROWS[:3], n=2)
    second = await pipe.run_batch(ROWS[:3], n=2)
    assert [s.response_ids for s in first.samples] == [s.response_ids for s in second.samples]


async def test_stage_exception_fails_only_that_sample():
    rec = Recorder()

    async def flaky(item: AgentRolloutItem, ctx: Context) -> None:
        if item.data.messages[0]["content"] == "question 3":
            raise ValueError("bad {value} 100% %s")

    after = Recorder()
    after.name = "after"
    result = await make([rec, flaky, after]).run_batch(ROWS)
    bad = result.samples[3]
    assert bad.status is Status.FAILED and bad.finish_reason == "error" and bad.masked
    assert bad.exit_reason == ExitReason.ERROR
    assert bad.error == "stage 'flaky' raised ValueError: bad {value} 100% %s"
    assert result.items[3].error_stage == "flaky"
    assert bad.uid not in after.runs and len(after.runs) == 7
    assert rec.cleanups[bad.uid] == 1 and bad.response_mask == []
    assert result.stats.by_status == {"completed": 7, "failed": 1}


async def test_timeout_cancels_stage_runs_cleanup_and_keeps_artifacts():
    rec = Recorder()
    cancelled = []

    async def hang(item: AgentRolloutItem, ctx: Context) -> None:
        item.artifacts["partial"] = "kept"
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(item.uid)
            raise

    judged = Recorder()
    result = await make([rec, hang, judged], sample_timeout_s=0.2).run_batch(ROWS[:2])
    for sample, item in zip(result.samples, result.items, strict=True):
        assert sample.status is Status.TIMEOUT and sample.finish_reason == "timeout"
        assert sample.masked and sample.exit_reason == "timeout"
        assert "timed out after 0.2s in stage 'hang'" in sample.error
        assert item.artifacts["partial"] == "kept"
        assert item.records[-2].name == "hang" and item.records[-2].status is Status.TIMEOUT
        assert rec.cleanups[item.uid] == 1
    assert len(cancelled) == 2 and not judged.runs


async def test_timeout_error_raised_by_a_stage_is_a_failure_not_a_timeout():
    async def tool_timed_out(item: AgentRolloutItem, ctx: Context) -> None:
        raise TimeoutError("search API did not answer")

    sample = await make([tool_timed_out], sample_timeout_s=5).run(ROWS[0])
    assert sample.status is Status.FAILED
    assert "TimeoutError: search API did not answer" in sample.error


async def test_queued_samples_do_not_time_out_while_waiting_for_a_slot():
    async def slow(item: AgentRolloutItem, ctx: Context) -> None:
        await asyncio.sleep(0.1)

    # 10 samples through 2 slots take ~0.5 s; each runs 0.1 s, well inside 0.3 s.
    result = await make([slow], max_concurrency=2, sample_timeout_s=0.3).run_batch(ROWS + ROWS[:2])
    assert result.stats.by_status == {"completed": 10}
    assert result.stats.wall_time_s >= 0.45


async def test_cleanup_runs_once_per_sample_even_in_a_loop():
    rec = Recorder()
    loop = Loop([rec], max_turns=3, until=lambda item: False)
    result = await make([loop]).run_batch(ROWS[:4])
    for sample, item in zip(result.samples, result.items, strict=True):
        assert sample.exit_reason == ExitReason.MAX_TURNS and sample.status is Status.COMPLETED
        assert rec.runs[item.uid] == 3 and rec.cleanups[item.uid] == 1
        assert [r.turn for r in item.records if r.name == "recorder" and r.phase == "run"] == [
            0,
            1,
            2,
        ]


async def test_loop_ends_when_until_holds_or_a_stage_sets_an_exit_reason():
    async def stop_at_two(item: AgentRolloutItem, ctx: Context) -> None:
        item.artifacts["turns_seen"] = ctx.turn
        if ctx.turn == 1:
            item.artifacts[artifacts.EXIT_REASON] = "length"

    result = await make([Loop([stop_at_two], max_turns=5, until=lambda i: False)]).run(ROWS[0])
    assert result.exit_reason == "length"
    done = await make([Loop([stop_at_two], max_turns=5, until=lambda i: True)]).run(ROWS[0])
    assert done.exit_reason == "done"


async def test_failing_or_hanging_cleanup_is_recorded_and_never_replaces_the_result():
    class BadCleanup:
        name = "bad_cleanup"

        async def run(self, item, ctx):
            item.artifacts[artifacts.REWARD] = 1.0

        async def cleanup(self, item, ctx):
            raise OSError("sandbox already gone")

    class SlowCleanup:
        name = "slow_cleanup"

        async def run(self, item, ctx):
            pass

        async def cleanup(self, item, ctx):
            await asyncio.sleep(10)

    closed = []

    async def with_resource(item, ctx):
        ctx.exit_stack.push_async_callback(lambda: asyncio.sleep(0, closed.append(item.uid)))

    pipe = make([with_resource, BadCleanup(), SlowCleanup()], cleanup_timeout_s=0.1)
    with capture_logs() as logs:
        batch = await pipe.run_batch(ROWS[:1])
    result = batch.samples[0]
    assert result.status is Status.COMPLETED and result.reward == 1.0
    item_records = {r.name: r for r in batch.items[0].records if r.phase == "cleanup"}
    assert item_records["bad_cleanup"].status is Status.FAILED
    assert item_records["bad_cleanup"].error_message == "sandbox already gone"
    assert item_records["slow_cleanup"].status is Status.TIMEOUT
    assert closed == [result.uid]
    assert {e["cleanup"] for e in logs if e["event"] == "cleanup_failed"} == {
        "bad_cleanup",
        "slow_cleanup",
    }


async def test_failing_fill_falls_back_to_a_fully_masked_sample():
    def broken_fill(item, ctx):
        raise KeyError("no such artifact")

    pipe = make([BuildPrompt(), Generate()], fill=broken_fill)
    sample = await pipe.run(ROWS[0])
    assert sample.status is Status.FAILED and sample.masked
    assert sample.exit_reason == ExitReason.BUILD_FAILED
    assert sample.response_ids == [ByteTokenizer.pad_token_id] and sample.response_mask == [0]
    assert "KeyError" in sample.error
    assert sample.prompt_ids == ByteTokenizer().encode(
        ByteTokenizer().apply_chat_template(ROWS[0]["messages"], add_generation_prompt=True)
    )


async def test_cancelling_run_batch_cancels_every_sample_and_leaves_no_task():
    rec = Recorder()
    started = asyncio.Event()

    async def hang(item, ctx):
        started.set()
        await asyncio.Event().wait()

    pipe = make([rec, hang], max_concurrency=4)
    batch = asyncio.create_task(pipe.run_batch(ROWS))
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.05)
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith("sample:")]
    assert leftovers == []
    assert len(rec.runs) == 4 and rec.cleanups == dict.fromkeys(rec.runs, 1)
    assert pipe.inflight() == []


@pytest.mark.parametrize("fatal", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()],
                         ids=lambda exc: type(exc).__name__)
async def test_item3a_a_base_exception_in_a_stage_fails_that_sample_only(fatal):
    async def stage(item, ctx):
        if item.index == 1:
            raise fatal
        item.artifacts["reward"] = 1.0

    result = await make([stage]).run_batch(ROWS[:3])
    assert [s.status for s in result.samples] == [Status.COMPLETED, Status.FAILED,
                                                  Status.COMPLETED]
    failed = result.samples[1]
    assert failed.masked and f"raised {type(fatal).__name__}" in failed.error
    assert asyncio.current_task().cancelling() == 0


async def test_over_sampling_aborts_the_rest_and_their_engine_requests():
    engine = SimulatedEngine(latency_s=0.01, latency_sigma=0, tail_prob=0, hang_rate=0.5, seed=3)
    pipe = make([BuildPrompt(offload=False), Generate()], engine=engine, sample_timeout_s=30)
    result = await pipe.run_batch(ROWS, n=4, num_needed=5)
    statuses = result.stats.by_status
    assert statuses["completed"] >= 5 and statuses["aborted"] >= 1
    assert sum(statuses.values()) == 32 and "timeout" not in statuses
    aborted = [s for s in result.samples if s.status is Status.ABORTED]
    assert all(s.masked and s.finish_reason == "abort" and s.error for s in aborted)
    assert engine.aborted and not engine.in_flight


@pytest.mark.parametrize(
    ("rows", "options", "error", "text"),
    [
        ([{"prompt": "ok"}, {"content": "no messages"}], {}, RowError, "row 1: field 'messages'"),
        (
            [{"messages": [{"role": "robot", "content": "x"}]}],
            {},
            RowError,
            "field 'messages.0.role'",
        ),
        ([{"messages": "not a list"}], {}, RowError, "field 'messages'"),
        (
            [{"prompt": "ok", "sampling": {"temperature": -1}}],
            {},
            ConfigError,
            "row 0: sampling.temperature",
        ),
        (ROWS, {"n": 0}, ConfigError, "field 'n'"),
        (ROWS, {"num_needed": 100}, ConfigError, "field 'num_needed'"),
    ],
)
async def test_bad_input_is_rejected_before_any_work(rows, options, error, text):
    rec = Recorder()
    with pytest.raises(error, match=text.replace(".", r"\.")):
        await make([rec]).run_batch(rows, **options)
    assert rec.runs == {}


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"sample_timeout_s": 0}, "sample_timeout_s"),
        ({"max_concurrency": -1}, "max_concurrency"),
        ({"sampling": {"top_p": 2}}, "sampling.top_p"),
        ({"sample_timeuot_s": 3}, "sample_timeuot_s"),
    ],
)
def test_invalid_config_names_the_field(options, field):
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        make([Recorder()], **options)


def test_non_stages_are_rejected_with_their_position():
    def sync_stage(item, ctx):
        return None

    with pytest.raises(StageDefinitionError, match="stage 1"):
        make([Recorder(), sync_stage])
    with pytest.raises(StageDefinitionError, match="empty"):
        make([])
    with pytest.raises(StageDefinitionError, match="max_turns"):
        Loop([Recorder()], max_turns=0)


async def test_batch_of_1000_with_failures_hangs_and_bad_cleanups():
    """10% raise, 10% hang past the deadline, 5% have a failing cleanup: all accounted for."""

    class Chaos:
        name = "chaos"

        async def run(self, item, ctx):
            k = item.index % 20
            if k < 2:
                raise RuntimeError(f"boom {item.index}")
            if k < 4:
                await asyncio.Event().wait()
            await asyncio.sleep(0.001)

        async def cleanup(self, item, ctx):
            if item.index % 20 == 4:
                raise RuntimeError("cleanup boom")

    rows = [{"prompt": f"q{i}"} for i in range(1000)]
    # the deadline leaves room for 900 trivial samples on a loaded 2-core machine (at 2 s,
    # under load 8, two thirds of them timed out); the hanging 100 wait it out
    pipe = make([Chaos()], sample_timeout_s=5.0, max_concurrency=1000)
    result = await pipe.run_batch(rows)
    assert result.stats.by_status == {"completed": 800, "failed": 100, "timeout": 100}
    assert [s.index for s in result.samples] == list(range(1000))
    bad_cleanups = [
        it
        for it in result.items
        if any(r.phase == "cleanup" and r.status is Status.FAILED for r in it.records)
    ]
    assert len(bad_cleanups) == 50 and all(it.status is Status.COMPLETED for it in bad_cleanups)
    assert all(s.error for s in result.samples if s.status is not Status.COMPLETED)
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("sample:")]


async def test_inflight_view_shows_stage_and_age():
    gate = asyncio.Event()

    async def wait_gate(item, ctx):
        await gate.wait()

    pipe = make([Recorder(), wait_gate])
    batch = asyncio.create_task(pipe.run_batch(ROWS[:3]))
    for _ in range(100):
        if len(pipe.inflight()) == 3:
            break
        await asyncio.sleep(0.01)
    view = pipe.inflight()
    assert {v.stage for v in view} == {"wait_gate"} and all(v.running_s >= 0 for v in view)
    gate.set()
    result = await batch
    assert result.stats.by_status == {"completed": 3} and pipe.inflight() == []


async def test_response_budget_and_row_overrides():
    engine = SimulatedEngine(
        latency_s=0.001, latency_sigma=0, tail_prob=0, responder=lambda ids, rng: [5] * 50
    )
    pipe = make(
        [BuildPrompt(), Loop([Generate()], max_turns=10, until=lambda i: False)],
        engine=engine,
        sampling={"max_tokens": 8, "max_response_tokens": 20},
    )
    sample = await pipe.run(ROWS[0])
    assert sample.exit_reason == "length" and sample.finish_reason == "length"
    assert len(sample.response_ids) == 8
    capped = await pipe.run({"prompt": "x", "sampling": {"max_tokens": 3}})
    assert len(capped.response_ids) == 3


def test_sync_entry_point_and_a_loop_in_another_thread():
    # Every sample of both batches must be in flight at once to pass the barrier: the two
    # loops really run concurrently on one pipeline (run one after the other, it breaks).
    barrier = threading.Barrier(4, timeout=20)

    async def rendezvous(item, ctx):
        await asyncio.to_thread(barrier.wait)

    pipe = make([BuildPrompt(), rendezvous, Generate()])
    out = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(pipe.run_batch(ROWS[:2]))))
    thread.start()
    assert asyncio_run(pipe.run_batch(ROWS[:2])).stats.by_status == {"completed": 2}
    thread.join(30)
    assert out and out[0].stats.by_status == {"completed": 2}
    assert pipe.samples_done == 4


async def test_engine_fault_is_a_failed_sample_with_a_readable_error():
    engine = SimulatedEngine(latency_s=0.001, error_rate=1.0)
    sample = await make([BuildPrompt(), Generate()], engine=engine).run(ROWS[0])
    assert sample.status is Status.FAILED
    assert "stage 'generate' raised EngineError: simulated engine fault" in sample.error


async def test_a_failing_sample_callback_is_logged_and_never_costs_the_batch():
    seen = []

    def callback(item, sample):
        seen.append(sample.uid)
        if len(seen) == 2:
            raise RuntimeError("progress bar broke")

    with capture_logs() as logs:
        result = await make([Recorder()]).run_batch(ROWS[:4], on_sample_done=callback)
    assert result.stats.by_status == {"completed": 4} and len(seen) == 4
    assert [e["event"] for e in logs].count("on_sample_done_failed") == 1


async def test_stats_skip_counter_artifacts_that_are_not_numbers():
    async def custom(item, ctx):
        item.artifacts[artifacts.TOOL_CALLS] = ["search", "calc"]  # a user's own meaning
        item.artifacts[artifacts.TOOL_ERRORS] = 2

    result = await make([custom]).run_batch(ROWS[:3])
    assert result.stats.by_status == {"completed": 3}
    assert result.stats.tool_calls == 0 and result.stats.tool_errors == 6
