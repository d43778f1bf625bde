"""What an :class:`~pipeline.AsyncRollout` did: its groups counted by version lag."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline._data.models import RolloutSample
from pipeline._runner.dynamic import GroupResult


@dataclass
class AsyncReport:
    """What an :class:`AsyncRollout` did; every dict maps a version lag to a group count.

    Invariant once the driver is closed: ``groups_started == sum(delivered) +
    sum(set_aside) + undelivered``.

    Attributes:
        version: the trainer's version now (the engine's after the last update).
        updates: weight updates through the driver.
        groups_started: groups started.
        delivered: groups handed to the trainer, by lag when handed over.
        set_aside: finished groups whose lag exceeded ``max_staleness``, by lag.
        interrupted: groups in flight at an update, by their lag just after it (a group
            in flight at two updates is counted twice).
        undelivered: groups started and not handed over when the driver closed (finished
            or cut short; their samples end ``aborted`` if cut short).
        update_stall_s: seconds each update held the trainer (pause to resume; over a pool,
            until every worker had resumed).
        worker_stall_s: per update, each engine's seconds paused by worker id (``"local"``
            for the pipeline's own engine).
        by_status: samples by status, of every group that finished.
        set_aside_groups: the groups set aside, samples included.
        wall_time_s: from start to close.
    """

    version: int = 0
    updates: int = 0
    groups_started: int = 0
    delivered: dict[int, int] = field(default_factory=dict)
    set_aside: dict[int, int] = field(default_factory=dict)
    interrupted: dict[int, int] = field(default_factory=dict)
    undelivered: int = 0
    update_stall_s: list[float] = field(default_factory=list)
    worker_stall_s: list[dict[str, float]] = field(default_factory=list)
    by_status: dict[str, int] = field(default_factory=dict)
    set_aside_groups: list[GroupResult] = field(default_factory=list)
    wall_time_s: float = 0.0

    def count(self, sample: RolloutSample) -> None:
        """Count one finished sample under its status."""
        key = sample.status.value
        self.by_status[key] = self.by_status.get(key, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """The counts as plain JSON-ready values (the groups themselves left out)."""
        return {"version": self.version, "updates": self.updates,
                "groups_started": self.groups_started,
                "delivered": _keyed(self.delivered), "set_aside": _keyed(self.set_aside),
                "interrupted": _keyed(self.interrupted), "undelivered": self.undelivered,
                "update_stall_s": [round(s, 4) for s in self.update_stall_s],
                "worker_stall_s": [{k: round(v, 4) for k, v in w.items()}
                                   for w in self.worker_stall_s],
                "by_status": dict(self.by_status), "wall_time_s": round(self.wall_time_s, 3)}


def _keyed(counts: dict[int, int]) -> dict[str, int]:
    return {str(lag): counts[lag] for lag in sorted(counts)}


def bump(counts: dict[int, int], lag: int) -> None:
    """Count one more group at ``lag``."""
    counts[lag] = counts.get(lag, 0) + 1


def group_lag(group: GroupResult, version: int, started: int) -> int:
    """``version`` minus the oldest version of any token of ``group`` (``started`` when no
    sample reports one)."""
    oldest = [s.policy_version for s in group.samples if s.policy_version is not None]
    return version - min(oldest, default=started)
