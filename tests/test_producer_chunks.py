"""Big batches start in chunks of ``START_CHUNK`` tasks per loop iteration; a sample whose
task was not made yet when over-sampling had enough, or when the batch was cancelled, still
ends with a status (or is cancelled with its batch), and nothing is left behind."""

from __future__ import annotations

import asyncio

import pytest

from pipeline import Pipeline, Status
from pipeline._runner.outcome import ENOUGH
from pipeline._runner.producer import START_CHUNK
from pipeline.testing import ByteTokenizer

ROWS = [{"prompt": f"q{i}"} for i in range(4 * START_CHUNK)]


def sample_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("sample:")]


async def test_a_big_batch_makes_one_chunk_of_tasks_per_loop_iteration():
    async def quick(item, ctx) -> None:
        await asyncio.sleep(0)

    pipe = Pipeline([quick], tokenizer=ByteTokenizer(), max_concurrency=len(ROWS))
    counts: list[int] = []

    async def watch() -> None:
        for _ in range(3):
            counts.append(len(sample_tasks()))
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    result = await pipe.run_batch(ROWS)
    await watcher
    assert result.stats.by_status == {"completed": len(ROWS)}
    assert counts[0] <= START_CHUNK  # not the whole batch in one go
    assert max(counts) < len(ROWS)


async def test_over_sampling_aborts_samples_whose_tasks_were_not_made_yet():
    ran: list[str] = []

    async def quick(item, ctx) -> None:
        ran.append(item.uid)

    pipe = Pipeline([quick], tokenizer=ByteTokenizer(), max_concurrency=len(ROWS))
    result = await pipe.run_batch(ROWS, num_needed=10)
    assert len(result.samples) == len(ROWS)
    by_status = result.stats.by_status
    assert by_status["completed"] >= 10
    assert by_status["completed"] + by_status["aborted"] == len(ROWS)
    # The samples of later chunks never ran a stage: they ended when their task started.
    assert len(ran) <= START_CHUNK
    aborted = [s for s in result.samples if s.status is Status.ABORTED]
    assert all(s.error == ENOUGH and s.masked and s.finish_reason == "abort" for s in aborted)
    assert not sample_tasks()


async def test_item10_cleanups_run_only_for_stages_that_began_when_a_batch_is_cancelled():
    started: list[str] = []
    cleaned: list[str] = []

    class Hang:
        name = "hang"

        async def run(self, item, ctx) -> None:
            started.append(item.uid)
            await asyncio.sleep(10)

        async def cleanup(self, item, ctx) -> None:
            cleaned.append(item.uid)

    pipe = Pipeline([Hang()], tokenizer=ByteTokenizer(), max_concurrency=len(ROWS))
    batch = asyncio.create_task(pipe.run_batch(ROWS))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the first chunk started, later ones not yet
    assert 0 < len(started) < len(ROWS)
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    await asyncio.sleep(0.01)  # a chunk scheduled before the cancel must not start anything
    assert not sample_tasks()
    # Cleanups ran for exactly the samples whose stage began: not for those parked at the
    # stage's start by the loop slice (run() never entered), nor those whose tasks were never
    # made.
    assert sorted(cleaned) == sorted(started)
    assert len(cleaned) < len(ROWS)


async def test_leaving_a_stream_early_cancels_samples_not_made_yet():
    async def slow(item, ctx) -> None:
        await asyncio.sleep(0.001)

    pipe = Pipeline([slow], tokenizer=ByteTokenizer(), max_concurrency=len(ROWS))
    got = 0
    async with pipe.stream(ROWS) as samples:
        async for _sample, _item in samples:
            got += 1
            if got == 3:
                break
    await asyncio.sleep(0.01)
    assert got == 3
    assert not sample_tasks()
