"""Asynchronous RL: a rollout stream a trainer holds across weight updates.

A synchronous trainer generates a batch, stops, trains, pushes weights and generates again:
the engine idles while the trainer trains, and the trainer waits for each batch's slowest
sample. :class:`AsyncRollout` keeps up to ``max_inflight`` groups generating while the trainer
takes batches of finished groups (:meth:`AsyncRollout.next_batch`) and pushes new weights
without stopping the stream (:meth:`AsyncRollout.update_weights`): the engine is paused with
``"keep"``, its weights replaced, and resumed; requests in flight go on under the new weights
with the tokens they had (a partial rollout), and every token records the version that sampled
it (``RolloutSample.token_versions``).

Staleness (AReaL's bound): with ``max_staleness=eta`` a group's *lag* is the trainer's version
minus the oldest version of any of its tokens (the version current when it started, for a
group that sampled nothing). Two rules keep it within ``eta``:

- admission: a group starts only while the groups started (and not set aside) are fewer than
  ``(updates + eta + 1) * batch_groups``, so nothing starts that could only be trained on
  more than ``eta`` versions later; ``eta = 0`` is the synchronous loop (one batch per
  version, started after the update);
- delivery: a finished group whose lag exceeds ``eta`` when the trainer takes it is set aside
  and counted, never delivered; groups started under an older version that finish within the
  bound are delivered.

Nothing is lost: every group started ends delivered, set aside, or (when the driver closes)
undelivered, each counted in :class:`AsyncReport` by lag; its samples keep their status.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pipeline._concurrency.cancel import wait_through_cancellation
from pipeline._data.config import check_count
from pipeline._exceptions import ConfigError
from pipeline._runner.async_report import AsyncReport, bump, group_lag
from pipeline._runner.dynamic import GroupResult
from pipeline._runner.group_runner import GroupRunner, LocalRunner

if TYPE_CHECKING:
    from pipeline._runner.pipeline import Pipeline

WeightLoader = Callable[[], Awaitable[int | None]]
"""Loads new weights into the paused engine by the caller's own means (an NCCL broadcast) and
returns the new version, or None to let the driver read ``engine.policy_version``."""


@dataclass
class _Group:
    version: int
    """The trainer's version when the group started."""


class AsyncRollout:
    """Groups generating continuously across weight updates, under a staleness bound.

    Use it as ``async with AsyncRollout(pipeline, rows, n=4, batch_groups=8,
    max_inflight=16, max_staleness=1) as rollout:``, then per training step ``groups = await
    rollout.next_batch()``, train, ``await rollout.update_weights(state_dict=...)``. The
    engine is the pipeline's (``pipeline.resources.engine``); it must implement the weight
    sync hooks (:class:`~pipeline.engines.WeightSync`; every built-in engine does, the
    transformers engine through :class:`~pipeline.engines.WeightSyncedEngine`).

    A started :class:`~pipeline.distributed.RayRolloutPool` may stand in for the pipeline:
    groups then run on its workers (each group on one), admission and staleness stay here,
    and :meth:`update_weights` updates every worker's engine (``pool.update_weights``).

    Args:
        pipeline: the pipeline whose samples are generated, or a started
            ``RayRolloutPool`` (anything with a ``group_runner()`` giving a
            :class:`GroupRunner`).
        rows: any iterable of rows, read lazily as groups start.
        n: samples per row (None: each row's ``sampling.n``).
        batch_groups: groups per trainer batch (:meth:`next_batch`).
        max_inflight: groups generating at once at most (default ``2 * batch_groups``).
        max_staleness: ``eta``, the most versions a delivered group's oldest token may lag
            the trainer; None: no bound (only ``max_inflight``).
        pause_mode: how :meth:`update_weights` pauses the engine: ``"keep"`` (partial
            rollouts, the default) or ``"wait"`` (requests in flight finish on the old
            weights first).

    Raises:
        ConfigError: a count out of range, an unknown pause mode, or an engine without the
            weight sync hooks; naming the field.
    """

    def __init__(self, pipeline: Pipeline | Any, rows: Iterable[Any], *, n: int | None = None,
                 batch_groups: int, max_inflight: int | None = None,
                 max_staleness: int | None = None, pause_mode: str = "keep") -> None:
        check_count(batch_groups, "batch_groups", 1)
        check_count(max_inflight, "max_inflight", 1, optional=True)
        check_count(max_staleness, "max_staleness", 0, optional=True)
        if pause_mode not in ("keep", "wait"):
            raise ConfigError(f"pause_mode must be 'keep' or 'wait', got {pause_mode!r}",
                              field="pause_mode")
        make_runner = getattr(pipeline, "group_runner", None)
        if callable(make_runner):  # a pool of workers
            self.runner: GroupRunner = make_runner()
        elif hasattr(pipeline, "resources"):
            self.runner = LocalRunner(pipeline)
        else:
            raise ConfigError(f"AsyncRollout runs a Pipeline or a RayRolloutPool, got "
                              f"{type(pipeline).__name__}", field="pipeline")
        self.pipeline = pipeline
        self.batch_groups = batch_groups
        self.max_inflight = max_inflight if max_inflight is not None else 2 * batch_groups
        self.max_staleness = max_staleness
        self.pause_mode = pause_mode
        self.report = AsyncReport(version=self.runner.version)
        self._source = self.runner.row_source(rows, n)
        self._groups: dict[str, _Group] = {}
        self._ready: deque[tuple[GroupResult, int]] = deque()
        self._useful = 0  # groups started and not set aside
        self._changed = asyncio.Event()  # a group finished, or the feeder ended
        self._wake = asyncio.Event()  # admission may have opened
        self._feeder: asyncio.Task[None] | None = None
        self._scope: Any = None
        self._error: BaseException | None = None
        self._updating = asyncio.Lock()
        self._closed = False
        self._feeding = True
        self._started_at = time.monotonic()

    @property
    def version(self) -> int:
        """The trainer's version: the engine's after the last update through the driver."""
        return self.report.version

    @property
    def inflight_groups(self) -> int:
        """Groups started and not finished yet."""
        return len(self._groups)

    async def __aenter__(self) -> AsyncRollout:
        self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    def start(self) -> None:
        """Start generating (``async with`` calls it); idempotent."""
        if self._feeder is None and not self._closed:
            self._started_at = time.monotonic()
            self._scope = self.runner.scope()
            self._feeder = asyncio.get_running_loop().create_task(
                self._feed(), name="async-rollout-feeder")

    # ----- admission and the feeder --------------------------------------------------------

    def _may_start(self) -> bool:
        if len(self._groups) >= self.max_inflight:
            return False
        if self.max_staleness is None:
            return True
        return self._useful < (self.report.updates + self.max_staleness + 1) * self.batch_groups

    def _fill(self) -> None:
        """Start groups while admission allows (see the module doc)."""
        while not self._closed and self._error is None and self._may_start():
            items = self._source.next_group()
            if items is None:
                return
            self.runner.start(items)
            self._groups[items[0].group_id] = _Group(self.report.version)
            self.report.groups_started += 1
            self._useful += 1

    async def _feed(self) -> None:
        """Owned by the driver: takes finished groups from the runner and refills."""
        assert self._scope is not None
        async with self._scope:
            try:
                while True:
                    self._wake.clear()
                    self._fill()
                    if not self._groups:
                        if self._source.stopped is not None:
                            return  # every row started and finished
                        await self._wake.wait()
                        continue
                    self._finish_groups(await self.runner.next_groups())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad row drawn late: the trainer sees it
                self._error = exc
            finally:
                self._feeding = False  # before the scope's own exit, which may take steps
                self._changed.set()

    def _finish_groups(self, results: list[GroupResult]) -> None:
        # Not in _feed's loop: its locals would keep the last group alive while it waits
        # for the next one, after the trainer may have taken and dropped it.
        for result in results:
            group = self._groups.pop(result.group_id, None)
            if group is not None:
                self._finish_group(result, group)

    def _finish_group(self, result: GroupResult, group: _Group) -> None:
        for sample in result.samples:
            self.report.count(sample)
        self._ready.append((result, group.version))
        self._changed.set()

    # ----- the trainer's side ---------------------------------------------------------------

    async def next_batch(self, num_groups: int | None = None) -> list[GroupResult]:
        """Wait for ``num_groups`` (default ``batch_groups``) finished groups within the
        staleness bound and hand them over, oldest first.

        Returns fewer (possibly none) once the rows are exhausted and nothing is left to
        finish.

        Raises:
            ConfigError: the driver was closed or not started.
            Exception: an error the rows raised when drawn (a bad row).
        """
        want = self.batch_groups if num_groups is None else num_groups
        check_count(want, "num_groups", 1)
        if self._feeder is None or self._closed:
            raise ConfigError("AsyncRollout.next_batch: use the driver inside 'async with' "
                              "(or call start()), before aclose()")
        while True:
            self._set_aside_stale()
            self._fill()
            if len(self._ready) >= want or (not self._feeding and not self._groups):
                break
            if self._error is not None:
                raise self._error
            if not self._groups and self._source.stopped is None:
                raise ConfigError(
                    f"AsyncRollout.next_batch: {len(self._ready)} group(s) ready, {want} asked, "
                    f"and max_staleness={self.max_staleness} lets no group start before the "
                    "next update_weights(): update the weights between batches",
                    field="max_staleness")
            self._changed.clear()
            await self._changed.wait()
        if self._error is not None and not self._ready:
            raise self._error
        batch: list[GroupResult] = []
        while self._ready and len(batch) < want:
            result, started = self._ready.popleft()
            bump(self.report.delivered, group_lag(result, self.report.version, started))
            batch.append(result)
        return batch

    def _set_aside_stale(self) -> None:
        if self.max_staleness is None:
            return
        kept: deque[tuple[GroupResult, int]] = deque()
        for result, started in self._ready:
            lag = group_lag(result, self.report.version, started)
            if lag > self.max_staleness:
                bump(self.report.set_aside, lag)
                self.report.set_aside_groups.append(result)
                self._useful -= 1  # its place may be taken by a fresh group
            else:
                kept.append((result, started))
        if len(kept) != len(self._ready):
            self._ready = kept
            self._fill()
            self._wake.set()

    async def update_weights(self, state_dict: Mapping[str, Any] | None = None,
                             path: str | Path | None = None, *, version: int | None = None,
                             load: Callable[..., Awaitable[int | None]] | None = None) -> int:
        """Push new weights without stopping the stream: pause the engine (``pause_mode``),
        load, resume; return the new version.

        ``state_dict``/``path``/``version`` go to ``engine.update_weights``; or pass ``load``
        to load them by other means while the engine is paused (a :data:`WeightLoader`; over
        a pool, a callable picklable by value that each worker calls with its engine). The
        engine is resumed however the load ends (an error, a cancellation); a failed load
        changes no version. Over a pool every worker's engine is updated to the same version.

        Raises:
            EngineError, ConfigError: what the engine's hooks raise.
            WeightUpdateFailed: over a pool, a worker's update failed (naming it).
        """
        async with self._updating:
            began = time.monotonic()
            try:
                new, stalls = await self.runner.update_weights(self.pause_mode, state_dict,
                                                               path, version, load)
            finally:
                self.report.update_stall_s.append(time.monotonic() - began)
            self.report.worker_stall_s.append(stalls)
            self.report.version = new
            self.report.updates += 1
            for group in self._groups.values():
                bump(self.report.interrupted, new - group.version)
            self._fill()
            self._wake.set()
            self._changed.set()  # ready groups may be stale now
            return new

    async def aclose(self) -> None:
        """Cancel what still runs (cleanups run), wait for it, and count what was never
        delivered; idempotent, safe under cancellation."""
        if self._closed:
            return
        self._closed = True
        feeder = self._feeder
        cancelled = False
        try:
            if feeder is not None and not feeder.done():
                feeder.cancel()
                cancelled = await wait_through_cancellation([feeder])
        finally:
            cut: list[GroupResult] = []
            try:
                cut = await self.runner.cancel()  # re-raises a cancellation of ours
            finally:
                self.report.undelivered = len(self._ready) + len(self._groups)
                for result in cut:
                    if self._groups.pop(result.group_id, None) is not None:
                        for sample in result.samples:
                            self.report.count(sample)
                self._groups.clear()
                self._ready.clear()
                self.report.wall_time_s = time.monotonic() - self._started_at
        if cancelled:
            raise asyncio.CancelledError
