"""Dynamic sampling (as in DAPO) and what a stream reports: a prompt's finished group, the
rule that keeps or sets it aside, the caps on drawing more, and the :class:`StreamReport`
that accounts for every group and sample a stream started, however it ended."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pipeline._concurrency.callables import call_either, check_callable
from pipeline._data.config import check_count
from pipeline._data.models import AgentRolloutItem, RolloutSample


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


async def judge_group(dynamic: DynamicSampling, group: GroupResult,
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
        tag(group, "keep_failed")
        report.failed.append(group)
        raise


def tag(group: GroupResult, outcome: str) -> None:
    """Tag a group's samples with what dynamic sampling did with them (``set_aside``,
    ``keep_failed``), so dumps and trainers can tell them apart."""
    for sample in group.samples:
        sample.extra_fields["dynamic_sampling"] = outcome
