"""Where an :class:`~pipeline.AsyncRollout` runs its groups (:class:`GroupRunner`): this
process's pipeline (:class:`LocalRunner`) or a pool of workers
(``RayRolloutPool.group_runner()``), and the one way an engine's weights are updated under a
pause (:func:`update_paused`), which both use."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pipeline._concurrency.cancel import wait_through_cancellation
from pipeline._data.models import AgentRolloutItem
from pipeline._exceptions import ConfigError
from pipeline._runner.dynamic import GroupResult
from pipeline._runner.producer import SampleRun
from pipeline._runner.stream import RowSource

if TYPE_CHECKING:
    from pipeline._runner.pipeline import Pipeline

WEIGHT_SYNC_HOOKS = ("pause", "resume", "update_weights")


class GroupRunner(Protocol):
    """Where an :class:`AsyncRollout` runs its groups: one process's pipeline, or a pool of
    workers (``RayRolloutPool.group_runner()``). The driver keeps admission, staleness and the
    report; a runner only starts groups, hands back the finished ones and updates weights."""

    @property
    def version(self) -> int:
        """The policy version of the runner's engines now."""
        ...

    def row_source(self, rows: Iterable[Any], n: int | None) -> RowSource:
        """``rows`` drawn lazily as groups (checked as the runner checks rows)."""
        ...

    def scope(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """Held while the driver generates."""
        ...

    def start(self, items: list[AgentRolloutItem]) -> None:
        """Start one group's samples."""
        ...

    async def next_groups(self) -> list[GroupResult]:
        """Wait for at least one started group to finish; every finished group once."""
        ...

    async def cancel(self) -> list[GroupResult]:
        """End every group still running (cleanups run) and return them, samples ended."""
        ...

    async def update_weights(self, mode: str, state_dict: Mapping[str, Any] | None,
                             path: str | Path | None, version: int | None,
                             load: Callable[..., Any] | None) -> tuple[int, dict[str, float]]:
        """Pause, load, resume every engine; the new version and each engine's stall."""
        ...


async def update_paused(engine: Any, mode: str, state_dict: Mapping[str, Any] | None,
                        path: str | Path | None, version: int | None,
                        load: Callable[[], Awaitable[int | None]] | None) -> tuple[int, float]:
    """Pause ``engine`` (``mode``), load the weights (``load()``, else
    ``engine.update_weights``), resume it however the load ends (an error, a cancellation).

    Returns:
        The new version and the seconds the engine was held paused.
    """
    began = time.monotonic()
    await engine.pause(mode)
    try:
        if load is not None:
            loaded = await load()
            new = int(loaded if loaded is not None else engine.policy_version or 0)
        else:
            new = int(await engine.update_weights(state_dict, path, version=version))
    finally:
        resume = asyncio.ensure_future(engine.resume())
        cancelled = await wait_through_cancellation([resume])
        if cancelled:
            raise asyncio.CancelledError
        resume.result()  # its error, if any
    return new, time.monotonic() - began


class LocalRunner:
    """Groups on this process's pipeline and its engine."""

    def __init__(self, pipeline: Pipeline) -> None:
        engine = pipeline.resources.engine
        for hook in WEIGHT_SYNC_HOOKS:
            if not callable(getattr(engine, hook, None)):
                raise ConfigError(f"AsyncRollout needs an engine with weight sync hooks; "
                                  f"{type(engine).__name__} has no {hook}()", field="engine")
        self.pipeline = pipeline
        self.engine: Any = engine
        self._producer = pipeline.producer(None, None)
        self._groups: dict[str, list[SampleRun]] = {}
        self._left: dict[str, int] = {}  # samples of each group not finished yet

    @property
    def version(self) -> int:
        return int(getattr(self.engine, "policy_version", None) or 0)

    def row_source(self, rows: Iterable[Any], n: int | None) -> RowSource:
        return RowSource(rows, n, self.pipeline)

    def scope(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.pipeline.batch_scope(None)

    def start(self, items: list[AgentRolloutItem]) -> None:
        runs = self._producer.start(items)
        self._groups[items[0].group_id] = runs
        self._left[items[0].group_id] = len(runs)

    async def next_groups(self) -> list[GroupResult]:
        while True:
            run = await self._producer.next_finished()
            gid = run.item.group_id
            if gid not in self._left:
                continue
            self._left[gid] -= 1
            if self._left[gid] == 0:
                return [self._result(gid)]

    def _result(self, gid: str) -> GroupResult:
        self._left.pop(gid, None)
        runs = sorted(self._groups.pop(gid), key=lambda r: r.item.sample_index)
        return GroupResult(gid, [self.pipeline.sample_of(r) for r in runs],
                           [r.item for r in runs])

    async def cancel(self) -> list[GroupResult]:
        try:
            if self._producer.unfinished:
                await self._producer.cancel()  # re-raises a cancellation of ours
        finally:
            cut = [self._result(gid) for gid in list(self._groups)]
        return cut

    async def update_weights(self, mode: str, state_dict: Mapping[str, Any] | None,
                             path: str | Path | None, version: int | None,
                             load: Callable[..., Any] | None) -> tuple[int, dict[str, float]]:
        new, stall = await update_paused(self.engine, mode, state_dict, path, version, load)
        return new, {"local": stall}
