"""Re-entrancy (issue 33, item 6): a batch started from inside one of the same pipeline's
samples is refused (it would wait for slots its callers hold); a second pipeline sharing the
resources works; finished items passed again run again from the start; an item running in
another call, or passed twice, is refused."""

from __future__ import annotations

import asyncio

import pytest

from pipeline import ConfigError, Pipeline, Status
from pipeline.testing import ByteTokenizer


async def test_item6_run_batch_from_inside_a_stage_of_the_same_pipeline_is_refused():
    box: dict[str, Pipeline] = {}

    async def nested(item, ctx) -> None:
        await box["pipe"].run_batch([{"prompt": "inner"}])

    pipe = box["pipe"] = Pipeline([nested], tokenizer=ByteTokenizer(), max_concurrency=2,
                                  sample_timeout_s=None)
    result = await asyncio.wait_for(pipe.run_batch([{"prompt": "a"}, {"prompt": "b"}]), 10)
    assert [s.status for s in result.samples] == [Status.FAILED] * 2
    assert all("called from inside a stage of the same Pipeline" in s.error
               for s in result.samples)


@pytest.mark.parametrize("call", ["stream", "stream_groups", "run"])
async def test_item6_every_entry_point_refuses_reentry_also_from_a_child_task(call):
    box: dict[str, Pipeline] = {}

    async def nested(item, ctx) -> None:
        async def child() -> None:  # a task the stage starts inherits the sample's context
            if call == "run":
                await box["pipe"].run({"prompt": "inner"})
            else:
                async with getattr(box["pipe"], call)([{"prompt": "inner"}]) as stream:
                    async for _ in stream:
                        pass
        await asyncio.create_task(child())

    pipe = box["pipe"] = Pipeline([nested], tokenizer=ByteTokenizer(), sample_timeout_s=None)
    sample = await asyncio.wait_for(pipe.run({"prompt": "a"}), 10)
    refused = "run_batch" if call == "run" else call
    assert sample.status is Status.FAILED and f"Pipeline.{refused} was called" in sample.error


async def test_item6_a_second_pipeline_sharing_resources_may_run_nested_batches():
    async def leaf(item, ctx) -> None:
        item.artifacts["reward"] = 1.0

    inner = Pipeline([leaf], tokenizer=ByteTokenizer(), max_concurrency=1)

    async def nested(item, ctx) -> None:
        result = await inner.run_batch([{"prompt": "inner"}])
        item.artifacts["reward"] = result.samples[0].reward

    outer = Pipeline([nested], resources=inner.resources, max_concurrency=1)
    result = await asyncio.wait_for(outer.run_batch([{"prompt": "a"}, {"prompt": "b"}]), 10)
    assert [s.reward for s in result.samples] == [1.0, 1.0]


async def test_item6_finished_items_passed_again_run_again_from_the_start():
    attempts: dict[str, int] = {}

    async def flaky(item, ctx) -> None:
        attempts[item.uid] = attempts.get(item.uid, 0) + 1
        item.artifacts.setdefault("seen", []).append(attempts[item.uid])
        if item.index == 0 and attempts[item.uid] == 1:
            raise RuntimeError("first try fails")
        item.artifacts["reward"] = 1.0

    pipe = Pipeline([flaky], tokenizer=ByteTokenizer())
    first = await pipe.run_batch([{"prompt": "a"}, {"prompt": "b"}])
    assert [s.status for s in first.samples] == [Status.FAILED, Status.COMPLETED]
    failed = [item for item in first.items if item.status is Status.FAILED]
    uid, group = failed[0].uid, failed[0].group_id
    retry = await pipe.run_batch(failed, num_needed=1)
    sample, item = retry.samples[0], retry.items[0]
    assert sample.status is Status.COMPLETED and sample.error is None and not sample.masked
    assert (item.uid, item.group_id) == (uid, group)  # the same rollout, run again
    assert item.artifacts["seen"] == [2]  # nothing of the first run was kept
    assert [r.status for r in item.records] == [Status.COMPLETED]


async def test_item6_an_item_running_elsewhere_or_passed_twice_is_refused():
    gate = asyncio.Event()

    async def wait(item, ctx) -> None:
        await gate.wait()

    pipe = Pipeline([wait], tokenizer=ByteTokenizer())
    items = pipe.make_items([{"prompt": "a"}])
    with pytest.raises(ConfigError, match="passed twice"):
        await pipe.run_batch([items[0], items[0]])
    running = asyncio.create_task(pipe.run_batch(items))
    await asyncio.sleep(0.01)
    with pytest.raises(ConfigError, match="running in another call"):
        await pipe.run_batch(items)
    gate.set()
    assert (await running).samples[0].status is Status.COMPLETED
