"""Sample deadlines through the runner's deadline wheel: deadlines falling in one
``RESOLUTION_S`` window share a loop timer, fire never early and at most one window late,
and leave the task's cancellation count as ``asyncio.timeout`` would."""

from __future__ import annotations

import asyncio
import time

from pipeline import Pipeline, Status
from pipeline._deadline import RESOLUTION_S
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


async def test_a_stage_that_swallows_the_deadline_cancel_completes_and_leaves_no_count():
    async def stubborn(item, ctx) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            item.artifacts["reward"] = 0.5  # swallowed: the stage ends normally

    counts: list[int] = []
    pipe = Pipeline([stubborn], tokenizer=ByteTokenizer(), sample_timeout_s=0.02)
    result = await pipe.run_batch([{"prompt": "q"}],
                                  on_sample_done=lambda item, sample: counts.append(
                                      asyncio.current_task().cancelling()))
    assert result.samples[0].status is Status.COMPLETED  # as with asyncio.timeout
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
