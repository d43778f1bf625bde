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

import itertools
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from pipeline._exceptions import ConfigError
from pipeline._items import make_items
from pipeline._models import AgentRolloutItem, RolloutSample
from pipeline._producer import SampleCallback, SampleRun

if TYPE_CHECKING:
    from pipeline._pipeline import Pipeline

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


@dataclass(frozen=True)
class DynamicSampling:
    """Keep drawing prompts until ``target_groups`` groups pass ``keep``.

    Attributes:
        target_groups: informative groups to yield; once reached, samples still running are
            aborted (reported, not yielded).
        max_rounds: refill waves after the first: a group set aside in wave ``r`` is
            replaced by a prompt of wave ``r + 1`` only while ``r + 1 <= max_rounds``.
        max_samples: cap on samples started in all (None: no cap beyond the rounds).
        keep: ``samples -> bool``; default :func:`has_reward_variance`.
    """

    target_groups: int
    max_rounds: int = 4
    max_samples: int | None = None
    keep: Callable[[Sequence[RolloutSample]], bool] = has_reward_variance

    def __post_init__(self) -> None:
        if not isinstance(self.target_groups, int) or self.target_groups < 1:
            raise ConfigError(f"field 'target_groups': must be an int >= 1, got "
                              f"{self.target_groups!r}")
        if not isinstance(self.max_rounds, int) or self.max_rounds < 0:
            raise ConfigError(f"field 'max_rounds': must be an int >= 0, got "
                              f"{self.max_rounds!r}")
        if self.max_samples is not None and (not isinstance(self.max_samples, int)
                                             or self.max_samples < 1):
            raise ConfigError(f"field 'max_samples': must be an int >= 1 or None, got "
                              f"{self.max_samples!r}")
        if not callable(self.keep):
            raise ConfigError(f"field 'keep': must be callable, got {self.keep!r}")


@dataclass
class StreamReport:
    """What a stream did, filled in as it runs (read it after the stream ends).

    Attributes:
        samples: samples started.
        groups_yielded: groups handed to the consumer.
        rounds: waves of prompts started (1 without refills).
        set_aside: groups ``DynamicSampling.keep`` rejected, with their samples.
        aborted: groups cut short once ``target_groups`` was reached.
        by_status: samples by status, all of them (yielded or not).
        wall_time_s: from the first sample started to the last one ended.
        stopped_by: why dynamic sampling stopped drawing (``target``, ``max_rounds``,
            ``max_samples``, ``rows_exhausted``), None without dynamic sampling.
    """

    samples: int = 0
    groups_yielded: int = 0
    rounds: int = 0
    set_aside: list[GroupResult] = field(default_factory=list)
    aborted: list[GroupResult] = field(default_factory=list)
    by_status: dict[str, int] = field(default_factory=dict)
    wall_time_s: float = 0.0
    stopped_by: str | None = None

    @property
    def samples_per_kept_group(self) -> float:
        """Samples generated for each group yielded (inf when none was)."""
        return self.samples / self.groups_yielded if self.groups_yielded else math.inf

    def count(self, sample: RolloutSample) -> None:
        key = sample.status.value
        self.by_status[key] = self.by_status.get(key, 0) + 1


class RolloutStream(Generic[T]):
    """An async iterator over finished samples or groups, closed deterministically by
    ``async with`` (or :meth:`aclose`); see :meth:`pipeline.Pipeline.stream`."""

    def __init__(self, source: AsyncGenerator[T, None], report: StreamReport | None = None
                 ) -> None:
        self._source = source
        self.report = report if report is not None else StreamReport()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await self._source.__anext__()

    async def aclose(self) -> None:
        """Cancel what still runs, run its cleanups and wait for it (idempotent)."""
        await self._source.aclose()

    async def __aenter__(self) -> RolloutStream[T]:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()


def check_num_needed(num_needed: int | None, total: int) -> None:
    """Refuse an over-sampling target outside ``[1, total]``."""
    if num_needed is not None and (isinstance(num_needed, bool) or not isinstance(num_needed, int)
                                   or not 1 <= num_needed <= total):
        raise ConfigError(f"field 'num_needed': must be an int in [1, {total}], got "
                          f"{num_needed!r}")


async def stream_samples(pipeline: Pipeline, items: list[AgentRolloutItem],
                         num_needed: int | None, on_done: SampleCallback | None
                         ) -> AsyncGenerator[SampleResult, None]:
    """Start every item; yield each as it finishes; on close, cancel and wait for the rest."""
    producer = pipeline.producer(num_needed, on_done)
    async with pipeline.batch_scope(len(items)):
        producer.start(items)
        try:
            while producer.unfinished:
                run = await producer.next_finished()
                yield SampleResult(pipeline.sample_of(run), run.item)
        finally:
            if producer.unfinished:
                await producer.cancel()


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
    the per-sample seeds) keep counting across waves."""

    def __init__(self, rows: Iterable[Any], n: int | None, pipeline: Pipeline) -> None:
        self._rows = iter(rows)
        self._n = n
        self._pipeline = pipeline
        self.drawn = 0

    def draw(self, count: int | None) -> list[AgentRolloutItem]:
        """The next ``count`` rows (all that are left when None) as items."""
        chunk = list(self._rows if count is None else itertools.islice(self._rows, count))
        items = self._pipeline.check_rows(
            make_items(chunk, self._n, self._pipeline.config, start=self.drawn))
        self.drawn += len(chunk)
        return items


async def stream_groups(pipeline: Pipeline, source: RowSource, first: list[AgentRolloutItem],
                        num_needed: int | None, dynamic: DynamicSampling | None,
                        on_done: SampleCallback | None, report: StreamReport
                        ) -> AsyncGenerator[GroupResult, None]:
    """See :meth:`pipeline.Pipeline.stream_groups`; ``first`` is the first wave, drawn
    (and so checked) before the stream was returned."""
    producer = pipeline.producer(num_needed, on_done)
    groups = _Groups()
    started = time.monotonic()
    kept = 0

    def launch(items: list[AgentRolloutItem], round_index: int) -> None:
        groups.add(producer.start(items), round_index)
        report.samples += len(items)
        report.rounds = max(report.rounds, round_index + 1)

    def group_of(gid: str) -> GroupResult:
        runs = sorted(groups.runs.pop(gid), key=lambda r: r.item.sample_index)
        return GroupResult(gid, [pipeline.sample_of(r) for r in runs], [r.item for r in runs])

    async with pipeline.batch_scope(None):
        launch(first, 0)
        try:
            while producer.unfinished:
                gid = groups.finish(await producer.next_finished())
                if gid is None:
                    continue
                round_index = groups.round.pop(gid)
                group = group_of(gid)
                for sample in group.samples:
                    report.count(sample)
                if dynamic is None:
                    report.groups_yielded += 1
                    yield group
                elif kept >= dynamic.target_groups:
                    report.aborted.append(group)
                elif dynamic.keep(group.samples):
                    kept += 1
                    report.groups_yielded += 1
                    if kept >= dynamic.target_groups:
                        report.stopped_by = "target"
                        producer.batch.abort_rest()
                    yield group
                else:
                    _mark_set_aside(group)
                    report.set_aside.append(group)
                    cap = _refill_cap(dynamic, report, round_index, len(group.samples))
                    more = source.draw(1) if cap is None else []
                    if more:
                        launch(more, round_index + 1)
                    elif report.stopped_by is None:
                        report.stopped_by = cap or "rows_exhausted"
        finally:
            report.wall_time_s = time.monotonic() - started
            if producer.unfinished:
                await producer.cancel()


def _refill_cap(dynamic: DynamicSampling, report: StreamReport, round_index: int,
                group_size: int) -> str | None:
    """None when a replacement prompt may start, else the cap that forbids it."""
    if round_index + 1 > dynamic.max_rounds:
        return "max_rounds"
    if dynamic.max_samples is not None and report.samples + group_size > dynamic.max_samples:
        return "max_samples"
    return None


def _mark_set_aside(group: GroupResult) -> None:
    """Tag a set-aside group's samples, so dumps and trainers can tell them apart."""
    for sample in group.samples:
        sample.extra_fields["dynamic_sampling"] = "set_aside"
