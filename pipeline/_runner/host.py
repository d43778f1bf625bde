"""What streams, the progress heartbeat and diagnostics need of the pipeline that runs
them, as a protocol: they know the :class:`~pipeline.Pipeline` in one direction only."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pipeline._data.config import PipelineConfig
    from pipeline._data.models import AgentRolloutItem, RolloutSample
    from pipeline._runner.producer import Producer, SampleCallback, SampleRun


@dataclass(frozen=True, slots=True)
class InflightSample:
    """A running sample as diagnostics see it."""

    uid: str
    group_id: str
    stage: str | None
    turn: int | None
    running_s: float
    in_stage_s: float | None


class BatchHost(Protocol):
    """The pipeline as the batch machinery around it sees it (``Pipeline`` is one)."""

    config: PipelineConfig
    samples_done: int

    def inflight(self) -> list[InflightSample]:
        """The samples running now."""
        ...

    def check_rows(self, items: list[AgentRolloutItem]) -> list[AgentRolloutItem]:
        """Run the stages' row checks on ``items``."""
        ...

    def producer(self, num_needed: int | None, on_done: SampleCallback | None) -> Producer:
        """A producer whose tasks run this pipeline's samples."""
        ...

    def batch_scope(self, total: int | None) -> contextlib.AbstractAsyncContextManager[Any]:
        """Marks a batch in progress while it is entered."""
        ...

    def sample_of(self, run: SampleRun) -> RolloutSample:
        """The sample a finished run produced."""
        ...
