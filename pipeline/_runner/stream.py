"""Streaming samples and groups to a trainer as they finish, and dynamic sampling.

A trainer that waits for ``run_batch`` waits for the slowest straggler; a stream hands over
each sample (or each complete group) the moment it ends, with the same guarantees: every
sample ends exactly once with a status, cleanups run, and closing the stream early cancels
what still runs and waits for it.

Dynamic sampling (as in DAPO): groups whose rewards carry no signal are set aside and new
prompts are drawn until enough informative groups were kept. Nothing is dropped silently:
set-aside and aborted groups are in the stream's :class:`StreamReport`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Sequence,
)
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from pipeline._concurrency.callables import call_either, check_callable
from pipeline._data.items import make_items
from pipeline._data.models import AgentRolloutItem, RolloutSample
from pipeline._exceptions import ConfigError
from pipeline._runner.producer import SampleCallback, SampleRun

if TYPE_CHECKING:
    from pipeline._runner.pipeline import Pipeline

T = TypeVar("T")


class SampleResult(NamedTuple):
    """One finished sample and its item (what the stages produced)."""

    sample: RolloutSample
    item: AgentRolloutItem


@dataclass
class GroupResult:
    """The ``n`` samples of one prompt, in sample order, once all of them have finished."""

    group_id: str
    samples: list[RolloutSample]
    items: list[AgentRolloutItem]

    @property
    def rewards(self) -> list[float | None]:
        """Each sample's reward (None where masked)."""
        return [s.reward for s in self.samples]


def has_reward_variance(samples: Sequence[RolloutSample]) -> bool:
    """Default keep rule: at least two unmasked samples whose rewards differ (a group that
    is all right or all wrong gives GRPO no signal)."""
    rewards = {s.reward for s in samples if not s.masked and s.reward is not None}
    return len(rewards) > 1


def check_count(value: object, field: str, minimum: int, *, maximum: int | None = None,
                optional: bool = False) -> None:
    """Refuse a count that is not an int in ``[minimum, maximum]`` (``None`` only when
    ``optional``). A bool is not a count: ``True`` is refused, not read as 1.

    Raises:
        ConfigError: naming ``field``.
    """
    if value is None and optional:
        return
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        none = " or None" if optional else ""
        raise ConfigError(f"field '{field}': must be an int {bounds}{none}, got {value!r:.60}",
                          field=field)


@dataclass(frozen=True)
class DynamicSampling:
    """Keep drawing prompts until ``target_groups`` groups pass ``keep``.

    Attributes:
        target_groups: informative groups to yield; once reached, samples still running are
            aborted (reported, not yielded).
        max_rounds: refill waves after the first: a group set aside in wave ``r`` is
            replaced by a prompt of wave ``r + 1`` only while ``r + 1 <= max_rounds``.
        max_samples: cap on samples *started* in all, first wave included (None: no cap
            beyond the rounds). A group that would take the total past it is not started
            (groups start whole or not at all) and drawing stops there; its row was read
            from ``rows`` to learn its size (its own ``sampling.n`` when ``n`` is not given)
            and is not started.
        keep: ``samples -> bool``, a plain function or an ``async def`` (awaited); default
            :func:`has_reward_variance`. If it raises, or a plain one returns an awaitable,
            the group goes to :attr:`StreamReport.failed` and the stream raises that error.

    Raises:
        ConfigError: a count that is not an int in range (bools included), or a ``keep``
            that is not callable or is a generator function; naming the field.
    """

    target_groups: int
    max_rounds: int = 4
    max_samples: int | None = None
    keep: Callable[[Sequence[RolloutSample]], bool | Awaitable[bool]] = has_reward_variance
    _keep_is_async: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_count(self.target_groups, "target_groups", 1)
        check_count(self.max_rounds, "max_rounds", 0)
        check_count(self.max_samples, "max_samples", 1, optional=True)
        is_async = check_callable(self.keep, "keep", "either", owner="DynamicSampling",
                                  shape="(samples) -> bool")
        object.__setattr__(self, "_keep_is_async", is_async)


STOPPED_BY = ("target", "max_rounds", "max_samples", "rows_exhausted", "closed", "error")
"""Values of :attr:`StreamReport.stopped_by`."""


@dataclass
class StreamReport:
    """What a stream did, filled in as it runs (complete once the stream has ended).

    Invariants, once the stream has ended however it ended (run out, ``break``, ``aclose``,
    cancelled, or an error): ``sum(by_status.values()) == samples`` (every sample started is
    counted once, yielded or not), and every group started is in exactly one of: yielded
    (``groups_yielded``), ``set_aside``, ``aborted``, ``failed``.

    Attributes:
        samples: samples started.
        samples_yielded: samples handed to the consumer (``stream``: one per item yielded;
            ``stream_groups``: the samples of the groups yielded).
        groups_started: groups (prompts) started.
        groups_yielded: groups handed to the consumer (``stream_groups`` only).
        rounds: waves of prompts started (1 without refills).
        set_aside: groups ``DynamicSampling.keep`` rejected, with their samples.
        aborted: groups started but never judged nor yielded: those ending after
            ``target_groups`` was reached, and those still running or not yet handed over
            when the stream was closed early (``break``, ``aclose``, a cancellation) or
            stopped by an error; their samples that were cut short end ``aborted``.
        failed: groups whose ``keep`` rule raised (or returned an awaitable from a plain
            function): the stream raised that error.
        by_status: samples by status, all of them (yielded or not).
        wall_time_s: from the first sample started to the stream's end.
        stopped_by: why the stream stopped starting samples, set for every stream once it
            ended: ``"target"`` (``target_groups`` kept), ``"max_rounds"``,
            ``"max_samples"``, ``"rows_exhausted"`` (every row was started: always the case
            without dynamic sampling, whose rows all start at once), ``"closed"`` (the
            consumer closed the stream, or was cancelled, before drawing stopped otherwise),
            ``"error"`` (the rows or a ``keep`` rule raised; see ``error``). The first
            reason wins.
        error: ``"Type: message"`` of the error that stopped the stream, if one did.
    """

    samples: int = 0
    samples_yielded: int = 0
    groups_started: int = 0
    groups_yielded: int = 0
    rounds: int = 0
    set_aside: list[GroupResult] = field(default_factory=list)
    aborted: list[GroupResult] = field(default_factory=list)
    failed: list[GroupResult] = field(default_factory=list)
    by_status: dict[str, int] = field(default_factory=dict)
    wall_time_s: float = 0.0
    stopped_by: str | None = None
    error: str | None = None

    @property
    def samples_per_kept_group(self) -> float:
        """Samples generated for each group yielded (inf when none was)."""
        return self.samples / self.groups_yielded if self.groups_yielded else math.inf

    def count(self, sample: RolloutSample) -> None:
        """Count one sample under its status."""
        key = sample.status.value
        self.by_status[key] = self.by_status.get(key, 0) + 1

    def stop(self, reason: str) -> None:
        """Record why drawing stopped, unless an earlier reason was recorded."""
        if self.stopped_by is None:
            self.stopped_by = reason

    def started(self, items: Sequence[AgentRolloutItem], round_index: int) -> None:
        """Count a wave of items just started."""
        if items:
            self.samples += len(items)
            self.groups_started += len({item.group_id for item in items})
            self.rounds = max(self.rounds, round_index + 1)

    def ended_with(self, exc: BaseException) -> None:
        """Record how an exception ended the stream (a close, or an error)."""
        if isinstance(exc, GeneratorExit | asyncio.CancelledError):
            self.stop("closed")
        else:
            self.stop("error")
            self.error = f"{type(exc).__name__}: {exc}"


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


async def stream_samples(pipeline: Pipeline, items: list[AgentRolloutItem],
                         num_needed: int | None, on_done: SampleCallback | None,
                         report: StreamReport | None = None
                         ) -> AsyncGenerator[SampleResult, None]:
    """Start every item; yield each as it finishes; on close, cancel and wait for the rest.
    ``report`` counts every sample, yielded or not (see :class:`StreamReport`)."""
    report = StreamReport() if report is None else report
    producer = pipeline.producer(num_needed, on_done)
    started = time.monotonic()
    yielded: set[int] = set()
    async with pipeline.batch_scope(len(items)):
        producer.start(items)
        report.started(items, 0)
        report.stop("rows_exhausted")  # every row started at once
        try:
            while producer.unfinished:
                run = await producer.next_finished()
                sample = pipeline.sample_of(run)
                report.count(sample)
                report.samples_yielded += 1
                yielded.add(id(run))
                yield SampleResult(sample, run.item)
        finally:
            try:
                if producer.unfinished:
                    await producer.cancel()
            finally:
                for run in producer.batch.runs:
                    if id(run) not in yielded:
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
        self.left[gid] -= 1
        return gid if self.left[gid] == 0 else None


class RowSource:
    """Rows drawn lazily for dynamic sampling, each checked when drawn; row indexes (and so
    the per-sample seeds) keep counting across waves.

    Args:
        rows: any iterable of rows, read as groups are needed.
        n: samples per row (None: each row's ``sampling.n``).
        pipeline: checks the rows (``Pipeline.check_rows``).
        max_samples: cap on the samples of the groups :meth:`next_group` hands out.
    """

    def __init__(self, rows: Iterable[Any], n: int | None, pipeline: Pipeline,
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


async def stream_groups(pipeline: Pipeline, source: RowSource, first: list[AgentRolloutItem],
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
                elif kept >= dynamic.target_groups:
                    report.aborted.append(group)
                elif await _judge_group(dynamic, group, report):
                    kept += 1
                    report.groups_yielded += 1
                    report.samples_yielded += len(group.samples)
                    if kept >= dynamic.target_groups:
                        report.stop("target")
                        producer.batch.abort_rest()
                    yield group
                else:
                    _tag(group, "set_aside")
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


async def _judge_group(dynamic: DynamicSampling, group: GroupResult,
                       report: StreamReport) -> bool:
    """The keep rule's verdict; a rule that raises (or returns an awaitable from a plain
    function) puts the group in ``report.failed`` and the error goes to the consumer."""
    try:
        verdict = await call_either(dynamic.keep, dynamic._keep_is_async,
                                    "DynamicSampling.keep", group.samples)
        return bool(verdict)
    except asyncio.CancelledError:  # the stream was closed while an async rule ran
        report.aborted.append(group)
        raise
    except BaseException:
        _tag(group, "keep_failed")
        report.failed.append(group)
        raise


def _tag(group: GroupResult, outcome: str) -> None:
    """Tag a group's samples with what dynamic sampling did with them (``set_aside``,
    ``keep_failed``), so dumps and trainers can tell them apart."""
    for sample in group.samples:
        sample.extra_fields["dynamic_sampling"] = outcome
