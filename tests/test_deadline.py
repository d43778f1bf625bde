"""Sample deadlines through the runner's deadline wheel: deadlines falling in one
``RESOLUTION_S`` window share a loop timer, fire never early and at most one window late,
and leave the task's cancellation count as ``asyncio.timeout`` would."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline import Loop, Pipeline, Status
from pipeline._concurrency.cancel import abandoned_tasks, stage_grace
from pipeline._runner.deadline import RESOLUTION_S
from pipeline.testing import ByteTokenizer


async def test_a_deadline_fires_never_early_and_at_most_a_window_late():
    timeout = 0.05
    seen: dict[str, float] = {}

    async def hang(item, ctx) -> None:
        seen["deadline"] = ctx.deadline
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen["cancelled_at"] = asyncio.get_running_loop().time()
            raise

    pipe = Pipeline([hang], tokenizer=ByteTokenizer(), sample_timeout_s=timeout)
    sample = await pipe.run({"prompt": "q"})
    assert sample.status is Status.TIMEOUT and sample.finish_reason == "timeout"
    late = seen["cancelled_at"] - seen["deadline"]
    assert 0 <= late <= RESOLUTION_S + 0.03  # 30 ms for a loaded machine's loop


async def test_after_a_timeout_the_sample_task_carries_no_cancellation_request():
    async def hang(item, ctx) -> None:
        await asyncio.sleep(10)

    seen_after: list[int] = []

    def on_done(item, sample) -> None:  # runs in the sample's task, after its stages
        seen_after.append(asyncio.current_task().cancelling())

    pipe = Pipeline([hang], tokenizer=ByteTokenizer(), sample_timeout_s=0.02)
    result = await pipe.run_batch([{"prompt": "q"}] * 3, on_sample_done=on_done)
    assert [s.status for s in result.samples] == [Status.TIMEOUT] * 3
    assert seen_after == [0, 0, 0]  # the deadline's cancel was taken back
    assert [record.status for item in result.items for record in item.records] == (
        [Status.TIMEOUT] * 3)


async def test_item1_a_stage_that_swallows_the_deadline_cancel_ends_timeout_with_no_count():
    later: list[str] = []

    async def stubborn(item, ctx) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            item.artifacts["reward"] = 0.5  # swallowed: the stage ends normally

    async def after(item, ctx) -> None:
        later.append(item.uid)
        await asyncio.sleep(3600)  # would hold the batch forever with no deadline left

    counts: list[int] = []
    pipe = Pipeline([stubborn, after], tokenizer=ByteTokenizer(), sample_timeout_s=0.02)
    result = await asyncio.wait_for(pipe.run_batch(
        [{"prompt": "q"}], on_sample_done=lambda item, sample: counts.append(
            asyncio.current_task().cancelling())), 5)
    sample = result.samples[0]
    assert sample.status is Status.TIMEOUT and sample.finish_reason == "timeout"
    assert sample.masked and "swallowed" in sample.error and "'stubborn'" in sample.error
    assert later == []  # no stage starts after the deadline fired
    assert [r.status for r in result.items[0].records] == [Status.TIMEOUT]
    assert counts == [0]


async def test_samples_started_together_share_loop_timers():
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    original = loop.call_at

    def counting_call_at(when, callback, *args, **kwargs):
        if getattr(callback, "__name__", "") == "_fire":
            timers.append(when)
        return original(when, callback, *args, **kwargs)

    async def quick(item, ctx) -> None:
        await asyncio.sleep(0)

    loop.call_at = counting_call_at  # type: ignore[method-assign]
    try:
        pipe = Pipeline([quick], tokenizer=ByteTokenizer(), max_concurrency=1000,
                        sample_timeout_s=30)
        start = time.monotonic()
        result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(1000)])
        elapsed = time.monotonic() - start
    finally:
        del loop.call_at
    assert result.stats.by_status == {"completed": 1000}
    # One timer per window the batch's start times spread over, not one per sample.
    assert 1 <= len(timers) <= elapsed / RESOLUTION_S + 2
    assert len(timers) < 1000 // 4


async def test_a_deadline_that_fires_while_a_sample_waits_in_a_nested_timeout_is_a_timeout():
    async def nested(item, ctx) -> None:
        async with asyncio.timeout(10):  # the stage's own, longer timeout
            await asyncio.sleep(10)

    pipe = Pipeline([nested], tokenizer=ByteTokenizer(), sample_timeout_s=0.02)
    sample = await pipe.run({"prompt": "q"})
    assert sample.status is Status.TIMEOUT
    assert "timed out after 0.02s in stage 'nested'" in sample.error


async def test_item1_a_stage_blocking_the_loop_past_the_deadline_ends_timeout():
    ran: list[str] = []

    async def blocks(item, ctx) -> None:
        time.sleep(0.08)  # noqa: ASYNC251 - holds the loop: the deadline timer cannot fire

    async def after(item, ctx) -> None:
        ran.append(item.uid)

    pipe = Pipeline([blocks, after], tokenizer=ByteTokenizer(), sample_timeout_s=0.03)
    sample = await pipe.run({"prompt": "q"})
    assert sample.status is Status.TIMEOUT and sample.masked
    assert "blocked the event loop" in sample.error
    assert ran == []


async def test_item1_a_blocking_last_stage_cannot_end_completed():
    async def blocks(item, ctx) -> None:
        item.artifacts["reward"] = 1.0
        time.sleep(0.08)  # noqa: ASYNC251 - holds the loop on purpose

    pipe = Pipeline([blocks], tokenizer=ByteTokenizer(), sample_timeout_s=0.03)
    sample = await pipe.run({"prompt": "q"})
    assert sample.status is Status.TIMEOUT and sample.finish_reason == "timeout"


async def test_item1_no_loop_turn_starts_after_a_swallowed_deadline():
    turns: list[int] = []

    async def stubborn_turn(item, ctx) -> None:
        turns.append(ctx.turn)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            pass

    pipe = Pipeline([Loop([stubborn_turn], max_turns=5, until=lambda item: False)],
                    tokenizer=ByteTokenizer(), sample_timeout_s=0.03)
    sample = await asyncio.wait_for(pipe.run({"prompt": "q"}), 5)
    assert sample.status is Status.TIMEOUT
    assert turns == [0]


async def test_item1_a_stage_ignoring_every_cancellation_is_abandoned_within_the_bound():
    cleaned: list[str] = []
    release = asyncio.Event()

    class Deaf:
        name = "deaf"

        async def run(self, item, ctx) -> None:
            while not release.is_set():  # swallows the deadline's and every later cancel
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    continue

        async def cleanup(self, item, ctx) -> None:
            cleaned.append(item.uid)

    async def fine(item, ctx) -> None:
        item.artifacts["reward"] = 1.0

    deaf, cleanup_s = Deaf(), 0.05
    pipe = Pipeline([deaf], tokenizer=ByteTokenizer(), sample_timeout_s=0.05,
                    cleanup_timeout_s=cleanup_s, max_concurrency=1)
    loop = asyncio.get_running_loop()
    start = loop.time()
    result = await asyncio.wait_for(pipe.run_batch([{"prompt": "a"}, {"prompt": "b"}]), 10)
    wall = loop.time() - start
    # Two samples one after the other on one slot: each bounded by deadline + stage grace.
    bound = 2 * (0.05 + stage_grace(cleanup_s)) + 0.5
    assert wall < bound, (wall, bound)
    assert [s.status for s in result.samples] == [Status.TIMEOUT] * 2
    assert all("abandoned" in s.error and "'deaf'" in s.error for s in result.samples)
    assert pipe.inflight() == [] and len(abandoned_tasks()) == 2
    assert cleaned == []  # its stage has not returned yet
    release.set()
    for _ in range(100):
        if not abandoned_tasks():
            break
        await asyncio.sleep(0.01)
    assert abandoned_tasks() == {}
    assert sorted(cleaned) == sorted(item.uid for item in result.items)  # once it returned
    # The abandoned samples' results stand: their late return changed nothing.
    assert [item.status for item in result.items] == [Status.TIMEOUT] * 2


async def test_item1_a_cancelled_batch_does_not_wait_for_a_stage_ignoring_cancellation():
    release = asyncio.Event()
    started = asyncio.Event()

    async def deaf(item, ctx) -> None:
        started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    pipe = Pipeline([deaf], tokenizer=ByteTokenizer(), sample_timeout_s=None,
                    cleanup_timeout_s=0.05)
    items = pipe.make_items([{"prompt": "a"}])
    batch = asyncio.create_task(pipe.run_batch(items))
    await asyncio.wait_for(started.wait(), 5)
    batch.cancel()
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(batch, 10)
    assert loop.time() - start < stage_grace(0.05) + 0.5
    assert items[0].status is Status.ABORTED and "ignored its cancellation" in items[0].error
    release.set()
    await asyncio.sleep(0.05)
    assert abandoned_tasks() == {}


async def test_item1_a_cleanup_ignoring_its_cancellation_is_bounded():
    release = asyncio.Event()

    class DeafCleanup:
        name = "deaf_cleanup"

        async def run(self, item, ctx) -> None:
            item.artifacts["reward"] = 1.0

        async def cleanup(self, item, ctx) -> None:
            while not release.is_set():
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    continue

    pipe = Pipeline([DeafCleanup()], tokenizer=ByteTokenizer(), cleanup_timeout_s=0.05)
    result = await asyncio.wait_for(pipe.run_batch([{"prompt": "a"}]), 10)
    assert result.samples[0].status is Status.COMPLETED  # a cleanup never changes the outcome
    record = next(r for r in result.items[0].records if r.phase == "cleanup")
    assert record.status is Status.TIMEOUT and "abandoned" in record.error_message
    release.set()
    await asyncio.sleep(0.05)
    assert abandoned_tasks() == {}
