"""Asynchronous RL over the pool: weight updates fanned out to every worker, and the groups an
:class:`~pipeline.AsyncRollout` starts one by one on the workers.

- :func:`update_fleet`: every live worker pauses its engine, loads the weights (a state dict
  put once in Ray's object store and fetched by each worker, a path, or a ``load`` callable
  run in each worker), takes the same version and resumes. Each worker resumes its own engine
  however its load ends, so a failure on one never leaves another paused; the call fails
  naming the workers that failed once every worker has answered.
- :class:`PoolGroups`: the driver's :class:`~pipeline.AsyncRollout` keeps admission and
  staleness; this starts each group on the least loaded worker (one ``BatchRun`` for the whole
  stream, so a dead worker's groups are retried as in a batch) and hands groups back whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import ray
import structlog

from pipeline._concurrency.cancel import wait_through_cancellation
from pipeline._data.config import PipelineConfig
from pipeline._data.models import AgentRolloutItem, Status
from pipeline._exceptions import ConfigError
from pipeline._runner.dynamic import GroupResult
from pipeline._runner.host import BatchHost
from pipeline._runner.stream import RowSource, SampleResult
from pipeline.distributed._batch import BatchRun
from pipeline.distributed._errors import (
    CLOSED_WHILE_RUNNING,
    WeightUpdateFailed,
    describe,
    is_worker_loss,
)
from pipeline.distributed._fleet import Fleet, SlotWorker

_logger = structlog.get_logger("pipeline.distributed")

CANCEL_WAIT_S = 30.0
"""How long a cancelled update waits for the workers to resume their engines."""


@dataclass
class WeightUpdate:
    """What :meth:`RayRolloutPool.update_weights` did.

    Attributes:
        version: the version every worker's engine holds now.
        stall_s: worker id -> seconds its engine was paused (pause to resume).
        wall_s: seconds the whole call took (the object store transfer included).
    """

    version: int
    stall_s: dict[str, float]
    wall_s: float


@dataclass
class UpdateArgs:
    """One update as it is sent to a worker (kept to bring a replacement worker up to date)."""

    mode: str
    state: list[Any] | None
    path: str | None
    version: int | None
    load: Callable[[Any], Any] | None

    def send(self, worker: SlotWorker) -> Any:
        return worker.handle.update_weights.remote(self.mode, self.state, self.path,
                                                   self.version, self.load)


def check_update(state_dict: Mapping[str, Any] | None, path: str | Path | None,
                 load: Callable[..., Any] | None) -> None:
    """At most one source of weights (none: the engine's own notion of an update)."""
    given = [name for name, value in (("state_dict", state_dict), ("path", path), ("load", load))
             if value is not None]
    if len(given) > 1:
        raise ConfigError(f"update_weights takes one source of weights, got {' and '.join(given)}",
                          field=given[1])
    if load is not None and not callable(load):
        raise ConfigError(f"load must be a callable (engine) -> version, got {load!r}",
                          field="load")


async def update_fleet(fleet: Fleet, args: UpdateArgs) -> WeightUpdate:
    """Send ``args`` to every live worker and wait for all of them (see the module doc).

    Raises:
        WeightUpdateFailed: some worker's update failed, or the workers disagree on the
            version; naming them.
    """
    began = time.monotonic()
    workers = [s.worker for s in fleet.slots if s.worker is not None and s.alive]
    if not workers:
        raise WeightUpdateFailed("no live worker to update", {}, {})
    refs = {w.worker_id: args.send(w) for w in workers}
    calls = {w.worker_id: asyncio.ensure_future(_await(refs[w.worker_id])) for w in workers}
    try:
        await asyncio.wait(calls.values())
    except asyncio.CancelledError:
        for ref in refs.values():  # each worker's update resumes its engine as it ends
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        await wait_through_cancellation(list(calls.values()), CANCEL_WAIT_S)
        for call in calls.values():  # retrieved: their errors are the cancellation's
            if call.done() and not call.cancelled():
                call.exception()
        raise
    failed: dict[str, str] = {}
    answers: dict[str, dict[str, Any]] = {}
    for worker in workers:
        call = calls[worker.worker_id]
        error = call.exception()
        if error is None:
            answers[worker.worker_id] = call.result()
            continue
        failed[worker.worker_id] = f"{worker.name()}: {describe(error, limit=500)}"
        if is_worker_loss(error):
            fleet.worker_lost(worker, error)
    updated = {wid: int(answer["version"]) for wid, answer in answers.items()}
    if failed:
        others = (f"; the others ({', '.join(sorted(updated))}) were updated and resumed"
                  if updated else "")
        raise WeightUpdateFailed(f"weight update failed on {len(failed)} of {len(workers)} "
                                 f"worker(s): {'; '.join(failed.values())}{others}",
                                 failed, updated)
    if len(set(updated.values())) > 1:
        raise WeightUpdateFailed(f"the workers' engines disagree on the new version: {updated} "
                                 "(pass version= so they all take the same one)", {}, updated)
    version = next(iter(updated.values()))
    stalls = {wid: float(answer["stall_s"]) for wid, answer in answers.items()}
    _logger.info("ray_pool_weights_updated", version=version, workers=len(workers),
                 max_stall_s=round(max(stalls.values()), 4))
    return WeightUpdate(version, stalls, time.monotonic() - began)


async def _await(ref: Any) -> Any:
    return await ref


class _Unchecked:
    """Rows as the pool takes them: made into items with the workers' config, their stage
    checks left to the workers (the driver holds no stages); what ``RowSource`` reads."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config

    def check_rows(self, items: list[AgentRolloutItem]) -> list[AgentRolloutItem]:
        return items


class PoolGroups:
    """The :class:`~pipeline.GroupRunner` of a pool: groups on its workers, one group each.

    Args:
        fleet: the pool's workers.
        run: the stream's batch run (its retries, its aborts), registered with the pool.
        update: the pool's ``update_weights``.
        version: the pool's current version.
        done: called with ``run`` once the stream has ended.
    """

    def __init__(self, fleet: Fleet, run: BatchRun,
                 update: Callable[..., Awaitable[WeightUpdate]], version: Callable[[], int],
                 done: Callable[[BatchRun], None]) -> None:
        self._fleet = fleet
        self._run = run
        self._update = update
        self._version = version
        self._done = done
        self._items: dict[str, list[AgentRolloutItem]] = {}
        self._got: dict[str, list[SampleResult]] = {}
        self._where: dict[str, str] = {}  # group id -> the worker it was sent to
        self._outstanding: dict[str, int] = {}  # worker id -> samples sent, not back

    @property
    def version(self) -> int:
        return self._version()

    def row_source(self, rows: Iterable[Any], n: int | None) -> RowSource:
        assert self._fleet.config is not None
        # RowSource reads a host's config and check_rows only
        return RowSource(rows, n, cast(BatchHost, _Unchecked(self._fleet.config)))

    def scope(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return contextlib.nullcontext()

    def start(self, items: list[AgentRolloutItem]) -> None:
        gid = items[0].group_id
        # a worker's load counts a call only once its task runs: groups started in one go
        # are spread by what this stream has sent too
        worker = min(self._fleet.targets(),
                     key=lambda w: max(w.load, self._outstanding.get(w.worker_id, 0)))
        self._items[gid] = items
        self._got[gid] = []
        self._where[gid] = worker.worker_id
        self._outstanding[worker.worker_id] = self._outstanding.get(worker.worker_id, 0) + len(
            items)
        self._run.send(worker, items)

    async def next_groups(self) -> list[GroupResult]:
        while True:
            done = self._take(await self._run.next_results())
            if done:
                return done

    def _take(self, results: list[SampleResult]) -> list[GroupResult]:
        done = []
        for result in results:
            gid = result.item.group_id
            got = self._got.get(gid)
            if got is None:
                continue
            got.append(result)
            if len(got) == len(self._items[gid]):
                done.append(self._group(gid))
        return done

    def _group(self, gid: str) -> GroupResult:
        got = sorted(self._got.pop(gid), key=lambda r: r.item.sample_index)
        self._outstanding[self._where.pop(gid)] -= len(self._items.pop(gid))
        return GroupResult(gid, [r.sample for r in got], [r.item for r in got])

    async def cancel(self) -> list[GroupResult]:
        closing = asyncio.ensure_future(self._run.close())  # aborts; workers hand back
        cancelled = await wait_through_cancellation([closing])
        cut: list[GroupResult] = []
        try:
            while not self._run.results.empty():
                cut += self._take(self._run.results.get_nowait())
            for gid in list(self._got):  # a call that never answered: ended here
                seen = {r.item.uid for r in self._got[gid]}
                self._got[gid] += [
                    self._run.end_locally(item, Status.ABORTED, CLOSED_WHILE_RUNNING)
                    for item in self._items[gid] if item.uid not in seen]
                cut.append(self._group(gid))
        finally:
            self._done(self._run)
        if cancelled:
            raise asyncio.CancelledError
        closing.result()
        return cut

    async def update_weights(self, mode: str, state_dict: Mapping[str, Any] | None,
                             path: str | Path | None, version: int | None,
                             load: Callable[..., Any] | None) -> tuple[int, dict[str, float]]:
        result = await self._update(state_dict, path, version=version, load=load, mode=mode)
        return result.version, result.stall_s
