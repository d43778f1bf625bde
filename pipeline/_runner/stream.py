"""Streaming samples and groups to a trainer as they finish, and dynamic sampling.

A trainer that waits for ``run_batch`` waits for the slowest straggler; a stream hands over
each sample (or each complete group) the moment it ends, with the same guarantees: every
sample ends exactly once with a status, cleanups run, and closing the stream early cancels
what still runs and waits for it.

Dynamic sampling (as in DAPO, rules and report in :mod:`pipeline._runner.dynamic`): groups
whose rewards carry no signal are set aside and new prompts are drawn until enough
informative groups were kept. Nothing is dropped silently: set-aside and aborted groups are
in the stream's :class:`StreamReport`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Iterable,
)
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from pipeline._data.config import check_count
from pipeline._data.items import make_items
from pipeline._data.models import AgentRolloutItem, RolloutSample
from pipeline._runner.dynamic import (
    DynamicSampling,
    GroupResult,
    StreamReport,
    judge_group,
    tag,
)
from pipeline._runner.producer import SampleCallback, SampleRun

if TYPE_CHECKING:
    from pipeline._runner.host import BatchHost

T = TypeVar("T")


class SampleResult(NamedTuple):
    """One finished sample and its item (what the stages produced)."""

    sample: RolloutSample
    item: AgentRolloutItem


class RolloutStream(Generic[T]):
    """An async iterator over finished samples or groups, closed deterministically by
    ``async with`` (or :meth:`aclose`); see :meth:`pipeline.Pipeline.stream`.

    :meth:`aclose` may be called from any task of the loop, also while the consumer waits
    in ``async for``: the consumer's wait then ends as if the stream had run out.
    """

    def __init__(self, source: AsyncGenerator[T, None], report: StreamReport | None = None
                 ) -> None:
        self._source = source
        self.report = report if report is not None else StreamReport()
        self._consumer: asyncio.Task[Any] | None = None  # the task inside __anext__
        self._close_requested = False
        self._step_ended: asyncio.Event | None = None
        self._closing = asyncio.Lock()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        task = asyncio.current_task()
        self._consumer = task
        try:
            value = await self._source.__anext__()
        except asyncio.CancelledError:
            # aclose() from another task cancelled this wait (and nobody else cancelled us):
            # the generator has run its cleanup; the iteration ends as a stream that ran out.
            if self._close_requested and task is not None and task.uncancel() == 0:
                raise StopAsyncIteration from None
            raise
        finally:
            self._consumer = None
            if self._step_ended is not None:
                self._step_ended.set()
        if self._close_requested and task is not None:
            task.uncancel()  # the close came after the value was ready: take it back
        return value

    async def aclose(self) -> None:
        """Cancel what still runs, run its cleanups and wait for it (idempotent; any task)."""
        async with self._closing:
            consumer = self._consumer
            if consumer is not None and consumer is not asyncio.current_task():
                # The generator is running in the consumer's task (waiting for a sample):
                # it cannot be closed from here, so its wait is cancelled, as a timeout would.
                self._step_ended = asyncio.Event()
                if not self._close_requested:
                    self._close_requested = True
                    consumer.cancel()
                await self._step_ended.wait()
            await self._source.aclose()

    async def __aenter__(self) -> RolloutStream[T]:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()


def check_num_needed(num_needed: int | None, total: int) -> None:
    """Refuse an over-sampling target outside ``[1, total]`` (a bool included)."""
    check_count(num_needed, "num_needed", 1, maximum=total, optional=True)


async def stream_samples(pipeline: BatchHost, items: list[AgentRolloutItem],
                         num_needed: int | None, on_done: SampleCallback | None,
                         report: StreamReport | None = None
                         ) -> AsyncGenerator[SampleResult, None]:
    """Start every item; yield each as it finishes; on close, cancel and wait for the rest.
    ``report`` counts every sample, yielded or not (see :class:`StreamReport`)."""
    report = StreamReport() if report is None else report
    producer = pipeline.producer(num_needed, on_done)
    started = time.monotonic()
    async with pipeline.batch_scope(len(items)):
        producer.start(items)
        report.started(items, 0)
        del items  # the stream keeps no sample the consumer took (and may have dropped)
        report.stop("rows_exhausted")  # every row started at once
        try:
            while producer.unfinished:
                run = await producer.next_finished()
                sample = pipeline.sample_of(run)
                report.count(sample)
                report.samples_yielded += 1
                yield SampleResult(sample, run.item)
                del run, sample
        finally:
            try:
                if producer.unfinished:
                    await producer.cancel()
            finally:
                for run in producer.batch.runs:  # those never handed to the consumer
                    report.count(pipeline.sample_of(run))
                report.wall_time_s = time.monotonic() - started


class _Groups:
    """Which runs belong to which prompt, and which groups are complete."""

    def __init__(self) -> None:
        self.runs: dict[str, list[SampleRun]] = {}
        self.left: dict[str, int] = {}
        self.round: dict[str, int] = {}

    def add(self, runs: list[SampleRun], round_index: int) -> None:
        for run in runs:
            gid = run.item.group_id
            self.runs.setdefault(gid, []).append(run)
            self.left[gid] = self.left.get(gid, 0) + 1
            self.round[gid] = round_index

    def finish(self, run: SampleRun) -> str | None:
        """Count ``run`` as done; its group id when that completed the group."""
        gid = run.item.group_id
        left = self.left[gid] - 1
        if left:
            self.left[gid] = left
            return None
        del self.left[gid]
        return gid


class RowSource:
    """Rows drawn lazily for dynamic sampling, each checked when drawn; row indexes (and so
    the per-sample seeds) keep counting across waves.

    Args:
        rows: any iterable of rows, read as groups are needed.
        n: samples per row (None: each row's ``sampling.n``).
        pipeline: checks the rows (``Pipeline.check_rows``).
        max_samples: cap on the samples of the groups :meth:`next_group` hands out.
    """

    def __init__(self, rows: Iterable[Any], n: int | None, pipeline: BatchHost,
                 max_samples: int | None = None) -> None:
        check_count(n, "n", 1, optional=True)
        self._rows = iter(rows)
        self._n = n
        self._pipeline = pipeline
        self._max_samples = max_samples
        self.drawn = 0
        self.handed_out = 0
        """Samples of the groups :meth:`next_group` returned."""
        self.stopped: str | None = None
        """Why :meth:`next_group` returns None: ``"rows_exhausted"`` or ``"max_samples"``."""

    def draw(self, count: int | None) -> list[AgentRolloutItem]:
        """The next ``count`` rows (all that are left when None) as items."""
        chunk = list(self._rows if count is None else itertools.islice(self._rows, count))
        items = self._pipeline.check_rows(
            make_items(chunk, self._n, self._pipeline.config, start=self.drawn))
        self.drawn += len(chunk)
        return items

    def next_group(self) -> list[AgentRolloutItem] | None:
        """The next row's items, or None once no group may start (see :attr:`stopped`).
        Never hands out a group that would take :attr:`handed_out` past ``max_samples``."""
        if self.stopped is not None:
            return None
        cap = self._max_samples
        if cap is not None and self._n is not None and self.handed_out + self._n > cap:
            self.stopped = "max_samples"  # known without reading a row
            return None
        items = self.draw(1)
        if not items:
            self.stopped = "rows_exhausted"
            return None
        if cap is not None and self.handed_out + len(items) > cap:
            self.stopped = "max_samples"
            return None
        self.handed_out += len(items)
        return items

    def first_wave(self, dynamic: DynamicSampling | None) -> list[AgentRolloutItem]:
        """Every row without dynamic sampling; else up to ``target_groups`` groups, within
        ``max_samples``."""
        if dynamic is None:
            return self.draw(None)
        items: list[AgentRolloutItem] = []
        for _ in range(dynamic.target_groups):
            group = self.next_group()
            if group is None:
                break
            items.extend(group)
        return items


async def stream_groups(pipeline: BatchHost, source: RowSource, first: list[AgentRolloutItem],
                        num_needed: int | None, dynamic: DynamicSampling | None,
                        on_done: SampleCallback | None, report: StreamReport
                        ) -> AsyncGenerator[GroupResult, None]:
    """See :meth:`pipeline.Pipeline.stream_groups`; ``first`` is the first wave, drawn
    (and so checked) before the stream was returned. However the stream ends, every group
    started lands in ``report`` (see :class:`StreamReport`)."""
    producer = pipeline.producer(num_needed, on_done)
    groups = _Groups()
    started = time.monotonic()
    kept = 0

    def launch(items: list[AgentRolloutItem], round_index: int) -> None:
        groups.add(producer.start(items), round_index)
        report.started(items, round_index)

    def group_of(gid: str) -> GroupResult:
        runs = sorted(groups.runs.pop(gid), key=lambda r: r.item.sample_index)
        group = GroupResult(gid, [pipeline.sample_of(r) for r in runs], [r.item for r in runs])
        for sample in group.samples:
            report.count(sample)
        return group

    async with pipeline.batch_scope(None):
        launch(first, 0)
        del first  # the stream keeps no group the consumer took (and may have dropped)
        if dynamic is None:
            report.stop("rows_exhausted")  # every row started at once
        elif source.stopped is not None:
            report.stop(source.stopped)
        try:
            while producer.unfinished:
                gid = groups.finish(await producer.next_finished())
                if gid is None:
                    continue
                round_index = groups.round.pop(gid)
                group = group_of(gid)
                if dynamic is None:
                    report.groups_yielded += 1
                    report.samples_yielded += len(group.samples)
                    yield group
                    del group  # the consumer's now: kept no longer than it keeps it
                elif kept >= dynamic.target_groups:
                    report.aborted.append(group)
                elif await judge_group(dynamic, group, report):
                    kept += 1
                    report.groups_yielded += 1
                    report.samples_yielded += len(group.samples)
                    if kept >= dynamic.target_groups:
                        report.stop("target")
                        producer.batch.abort_rest()
                    yield group
                    del group
                else:
                    tag(group, "set_aside")
                    report.set_aside.append(group)
                    more = None
                    if round_index + 1 > dynamic.max_rounds:
                        report.stop("max_rounds")
                    else:
                        more = source.next_group()
                    if more is not None:
                        launch(more, round_index + 1)
                    elif source.stopped is not None:
                        report.stop(source.stopped)
        except BaseException as exc:
            report.ended_with(exc)
            raise
        finally:
            try:
                if producer.unfinished:
                    await producer.cancel()
            finally:
                for gid in list(groups.runs):  # started, never judged nor yielded
                    report.aborted.append(group_of(gid))
                report.stop("rows_exhausted")  # not reached: every way out sets a reason
                report.wall_time_s = time.monotonic() - started
