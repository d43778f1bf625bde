"""Streaming samples and groups as they finish, and dynamic sampling, on real asyncio."""

from __future__ import annotations

import asyncio
import gc

import pytest

from pipeline import (
    AgentRolloutItem,
    ConfigError,
    Context,
    DynamicSampling,
    Pipeline,
    RowError,
    Status,
    artifacts,
)
from pipeline.testing import ByteTokenizer


class Delays:
    """A stage that sleeps per row (row ``delay`` field via its prompt) and counts cleanups."""

    name = "delay"

    def __init__(self) -> None:
        self.cleanups: dict[str, int] = {}
        self.started: set[str] = set()

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        self.started.add(item.uid)
        delay = float(item.data.extra.get("delay", 0.0))
        await asyncio.sleep(delay)
        reward = item.data.extra.get("rewards")
        item.artifacts[artifacts.REWARD] = (
            float(reward[item.sample_index]) if reward is not None else 1.0)

    async def cleanup(self, item: AgentRolloutItem, ctx: Context) -> None:
        self.cleanups[item.uid] = self.cleanups.get(item.uid, 0) + 1


def row(delay: float = 0.0, rewards: list[float] | None = None, name: str = "q") -> dict:
    extra = {"delay": delay}
    if rewards is not None:
        extra["rewards"] = rewards
    return {"prompt": name, "extra": extra}


def make(stage: Delays, **options) -> Pipeline:
    return Pipeline([stage], tokenizer=ByteTokenizer(), **options)


def leftover_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("sample:")]


async def test_samples_arrive_as_they_finish_while_a_straggler_runs():
    stage = Delays()
    pipe = make(stage)
    rows = [row(10.0)] + [row(0.1) for _ in range(7)]
    loop = asyncio.get_running_loop()
    start = loop.time()
    got = []
    async with pipe.stream(rows, n=2) as samples:
        async for sample, item in samples:
            if not got:
                first_after = loop.time() - start
            got.append((sample, item))
            if len(got) == 14:
                break  # everything but the straggler's two samples
    assert first_after < 1.0
    assert all(s.status is Status.COMPLETED for s, _ in got)
    assert len({s.uid for s, _ in got}) == 14
    # Leaving the block cancelled the straggler's samples, ran their cleanups, waited for them.
    assert stage.cleanups == {uid: 1 for uid in stage.started}
    assert len(stage.cleanups) == 16
    assert pipe.inflight() == [] and leftover_tasks() == []
    assert loop.time() - start < 5


async def test_every_sample_exactly_once_with_statuses():
    stage = Delays()

    async def fail_odd(item, ctx):
        if item.sample_index % 2:
            raise ValueError("odd")

    pipe = Pipeline([stage, fail_odd], tokenizer=ByteTokenizer())
    seen = []
    async with pipe.stream([row(0.01 * i) for i in range(5)], n=4) as samples:
        async for sample, item in samples:
            assert sample.uid == item.uid and item.status is sample.status
            seen.append(sample)
    assert len(seen) == 20 and len({s.uid for s in seen}) == 20
    assert sum(s.status is Status.FAILED for s in seen) == 10
    assert all(s.masked for s in seen if s.status is Status.FAILED)


async def test_groups_are_yielded_once_complete_first_fast_ones():
    stage = Delays()
    pipe = make(stage)
    rows = [row(3.0, name="slow")] + [row(0.05, name=f"fast{i}") for i in range(3)]
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with pipe.stream_groups(rows, n=3) as groups:
        first = await anext(groups)
        first_after = loop.time() - start
        assert len(first.samples) == 3 and len({s.group_id for s in first.samples}) == 1
        assert [s.uid for s in first.samples] == [i.uid for i in first.items]
        assert [i.sample_index for i in first.items] == [0, 1, 2]
        rest = [g async for g in groups]
    assert first_after < 1.0
    assert len(rest) == 3 and groups.report.groups_yielded == 4
    assert rest[-1].items[0].data.extra["delay"] == 3.0  # the straggler's group is last
    assert groups.report.by_status == {"completed": 12}


async def test_plain_async_for_with_break_leaves_nothing_behind():
    stage = Delays()
    pipe = make(stage)

    async def consume():
        async for _sample, _item in pipe.stream([row(0.01)] + [row(30.0)] * 3, n=1):
            break

    await consume()
    gc.collect()  # the abandoned stream is finalised: its close is scheduled on the loop
    for _ in range(50):
        if not leftover_tasks():
            break
        await asyncio.sleep(0.02)
    assert leftover_tasks() == [] and pipe.inflight() == []
    assert stage.cleanups == {uid: 1 for uid in stage.started}


async def test_cancelling_the_consumer_cancels_the_stream():
    stage = Delays()
    pipe = make(stage)
    got = asyncio.Event()

    async def consume():
        async with pipe.stream([row(0.0)] + [row(30.0)] * 4, n=1) as samples:
            async for _ in samples:
                got.set()

    task = asyncio.create_task(consume())
    await got.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert leftover_tasks() == [] and pipe.inflight() == []
    assert len(stage.cleanups) == 5 and set(stage.cleanups.values()) == {1}


async def test_over_sampling_composes_with_streaming():
    stage = Delays()
    pipe = make(stage)
    rows = [row(0.01 * i) for i in range(4)] + [row(30.0) for _ in range(4)]
    async with pipe.stream(rows, n=1, num_needed=4) as samples:
        seen = [s async for s, _ in samples]
    assert len(seen) == 8
    by = {s.status for s in seen[:4]}, {s.status for s in seen[4:]}
    assert by == ({Status.COMPLETED}, {Status.ABORTED})


async def test_bad_rows_and_options_are_refused_before_any_work():
    stage = Delays()
    pipe = make(stage)
    with pytest.raises(RowError):
        pipe.stream([{"nothing": 1}])
    with pytest.raises(ConfigError, match="num_needed"):
        pipe.stream([row()], n=2, num_needed=3)
    with pytest.raises(ConfigError, match="dynamic"):
        pipe.stream_groups([row()], n=2, dynamic={"target_groups": 1})
    with pytest.raises(ConfigError, match="not both"):
        pipe.stream_groups([row()], n=2, num_needed=1, dynamic=DynamicSampling(target_groups=1))
    with pytest.raises(ConfigError, match="target_groups"):
        DynamicSampling(target_groups=0)
    assert stage.started == set()


def informative(i: int) -> dict:
    return row(0.01, [0.0, 1.0, 1.0, 0.0], name=f"mixed{i}")


def flat(i: int, value: float = 1.0) -> dict:
    return row(0.01, [value] * 4, name=f"flat{i}")


async def test_dynamic_sampling_keeps_informative_groups_and_reports_the_rest():
    stage = Delays()
    pipe = make(stage)
    # Pattern: two flat groups for each informative one, endless.
    def source():
        i = 0
        while True:
            yield informative(i) if i % 3 == 2 else flat(i, float(i % 2))
            i += 1

    stream = pipe.stream_groups(source(), n=4, dynamic=DynamicSampling(target_groups=3,
                                                                        max_rounds=10))
    async with stream as groups:
        kept = [g async for g in groups]
    report = stream.report
    assert len(kept) == 3
    assert all(len(set(g.rewards)) > 1 for g in kept)
    assert report.stopped_by == "target"
    assert report.groups_yielded == 3
    assert len(report.set_aside) >= 3
    assert all(len(set(g.rewards)) == 1 for g in report.set_aside)
    assert all(s.extra_fields["dynamic_sampling"] == "set_aside"
               for g in report.set_aside for s in g.samples)
    finished = report.groups_yielded + len(report.set_aside) + len(report.aborted)
    assert report.samples == 4 * finished
    assert sum(report.by_status.values()) == report.samples
    assert report.rounds >= 2
    assert report.samples_per_kept_group == report.samples / 3
    assert leftover_tasks() == []


@pytest.mark.parametrize(("dynamic", "rows", "stopped_by"), [
    (DynamicSampling(target_groups=2, max_rounds=0), [flat(i) for i in range(10)], "max_rounds"),
    (DynamicSampling(target_groups=2, max_rounds=50, max_samples=16),
     [flat(i) for i in range(50)], "max_samples"),
    (DynamicSampling(target_groups=2, max_rounds=50), [flat(i) for i in range(5)],
     "rows_exhausted"),
])
async def test_dynamic_sampling_stops_at_its_caps(dynamic, rows, stopped_by):
    stage = Delays()
    pipe = make(stage)
    stream = pipe.stream_groups(rows, n=4, dynamic=dynamic)
    async with stream as groups:
        kept = [g async for g in groups]
    assert kept == [] and stream.report.stopped_by == stopped_by
    if dynamic.max_samples is not None:
        assert stream.report.samples <= dynamic.max_samples
    assert stream.report.samples == 4 * len(stream.report.set_aside)
