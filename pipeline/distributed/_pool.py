"""RayRolloutPool: rollout workers as Ray actors, driven like one ``Pipeline``.

The driver turns rows into items itself (with the workers' config, so uids, groups and seeds
are those one process would give), shards them by group (a prompt's ``n`` samples stay on one
worker, where the engine's prefix cache serves them) to the least loaded workers, and merges
what streams back (``_merge.py``). A worker that dies mid-batch loses nothing: the samples it
had not returned are run again once on another worker, then reported ``failed`` naming it
(``_batch.py``); the pool starts a replacement (``_fleet.py``, with the health watch that
finds a worker that dies while idle). The driver never waits on a dead worker: Ray reports the
death to the stream that was reading from it.

After :meth:`RayRolloutPool.aclose`, ``run_batch``, ``stream``, ``stream_groups`` and
``start`` raise :class:`PoolClosed`; a batch still running when it closes ends its samples
``aborted``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import ray
import structlog

from pipeline._data.items import make_items
from pipeline._data.models import AgentRolloutItem, ProduceBatchResult
from pipeline._exceptions import ConfigError
from pipeline._runner.dynamic import GroupResult
from pipeline._runner.stream import RolloutStream, SampleResult, check_num_needed
from pipeline.diagnostics import Watchdog, add_dump_section, capture_snapshot, render_text
from pipeline.distributed._async import (
    PoolGroups,
    UpdateArgs,
    WeightUpdate,
    check_update,
    update_fleet,
)
from pipeline.distributed._batch import BatchRun
from pipeline.distributed._errors import PoolClosed, PoolNotStarted
from pipeline.distributed._fleet import Fleet, WorkerInfo
from pipeline.distributed._fleet_dump import fleet_section
from pipeline.distributed._merge import BatchCollector, GroupCollector, by_group, shard
from pipeline.ratelimit import BucketStats

_logger = structlog.get_logger("pipeline.distributed")

DEFAULT_WORKER_OPTIONS: Mapping[str, Any] = {"num_cpus": 0.5}
"""Per-worker Ray resources: four workers fit a ``num_cpus=2`` cluster."""


class RayRolloutPool:
    """``num_workers`` Ray actors, each running the pipeline ``pipeline_factory`` builds.

    Use it as ``async with RayRolloutPool(4, make_pipeline) as pool: result = await
    pool.run_batch(rows, n=8)``. It reuses the Ray runtime already initialised in this
    process, else connects to ``ray_address``, else starts a local one.

    Args:
        num_workers: actors to run.
        pipeline_factory: builds a worker's :class:`~pipeline.Pipeline` (sync or async, no
            arguments), called inside the worker on its own loop; it must be picklable
            (a top-level function, or a ``functools.partial`` of one).
        ray_address: the cluster to connect to when Ray is not initialised yet.
        worker_options: Ray actor options per worker (default ``{"num_cpus": 0.5}``; say
            ``{"num_gpus": 1}`` for one in-process engine per GPU).
        max_retries: times a dead worker's samples are run again on another worker.
        fleet_limits: replace each worker's limiter registry with one leased from a shared
            limiter actor, so every ``rate``/``burst`` holds for the whole fleet.
        watchdog: each worker loop's :class:`~pipeline.diagnostics.Watchdog` (True: defaults).
        dump_timeout_s: how long a fleet dump waits for each worker's snapshot.
        replace_timeout_s: how long a retry waits for a live worker when none is left.
        health_interval_s: how often the health watch asks every worker how it is.
        health_probe_s: how long one health question waits for its answer.
        health_timeout_s: a worker that answers no health question for this long is lost.
        ray_init: keyword arguments for ``ray.init`` when the pool starts Ray itself.
    """

    def __init__(self, num_workers: int, pipeline_factory: Callable[[], Any], *,
                 ray_address: str | None = None,
                 worker_options: Mapping[str, Any] | None = None, max_retries: int = 1,
                 fleet_limits: bool = True, watchdog: Watchdog | bool = True,
                 dump_timeout_s: float = 5.0, replace_timeout_s: float = 120.0,
                 health_interval_s: float = 1.0, health_probe_s: float = 5.0,
                 health_timeout_s: float = 60.0,
                 ray_init: Mapping[str, Any] | None = None) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not callable(pipeline_factory):
            raise TypeError(f"pipeline_factory must be callable, got {pipeline_factory!r}")
        for name, value in (("health_interval_s", health_interval_s),
                            ("health_probe_s", health_probe_s),
                            ("health_timeout_s", health_timeout_s)):
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        self.num_workers = num_workers
        self._address = ray_address
        self.max_retries = max_retries
        self.dump_timeout_s = dump_timeout_s
        self.replace_timeout_s = replace_timeout_s
        self.health_interval_s = health_interval_s
        self.health_probe_s = health_probe_s
        self.health_timeout_s = health_timeout_s
        self._ray_init = dict(ray_init or {})
        options = dict(DEFAULT_WORKER_OPTIONS if worker_options is None else worker_options)
        self._fleet = Fleet(num_workers, pipeline_factory, options, watchdog, fleet_limits,
                            settings=self)
        self._runs: set[BatchRun] = set()
        self._remove_section: Callable[[], None] | None = None
        self._started = False

    # -- life cycle --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._fleet.closed

    @property
    def replacements(self) -> int:
        """Workers started to replace dead ones."""
        return self._fleet.replacements

    def _check_open(self) -> None:
        if self._fleet.closed:
            raise PoolClosed("this RayRolloutPool is closed (aclose() was called); start a "
                             "new pool to run more samples")

    async def start(self) -> RayRolloutPool:
        """Connect to Ray, start every worker and the health watch (idempotent).

        Raises:
            PoolClosed: the pool was closed.
            Exception: whatever a worker's pipeline factory raised.
        """
        self._check_open()
        if self._started:
            return self
        if not ray.is_initialized():
            options = {"include_dashboard": False, **self._ray_init}
            if self._address is not None:
                options["address"] = self._address
            ray.init(**options)
        await self._fleet.start()
        self._started = True
        self._remove_section = add_dump_section("ray workers", self.fleet_section)
        self._fleet.watch()
        _logger.info("ray_pool_started", workers=[w.worker_id for w in self.workers])
        return self

    async def aclose(self) -> None:
        """Abort what still runs, stop the health watch, the workers and the limiter actor
        (idempotent). Later calls raise :class:`PoolClosed`."""
        if self._fleet.closed:
            return
        self._fleet.close()
        if self._remove_section is not None:
            self._remove_section()
        for run in list(self._runs):
            run.abort_all()
        await self._fleet.stop()

    async def __aenter__(self) -> RayRolloutPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def workers(self) -> list[WorkerInfo]:
        """Every slot: its current worker, pid, whether alive, its load."""
        return [slot.info() for slot in self._fleet.slots]

    # -- running -----------------------------------------------------------------------------

    async def run_batch(self, rows: Iterable[Any], *, n: int | None = None,
                        num_needed: int | None = None) -> ProduceBatchResult:
        """Run a batch across the workers; one sample per item, in input order, exactly as
        :meth:`pipeline.Pipeline.run_batch` returns it.

        Raises:
            RowError, ConfigError: bad input, before any work starts.
            PoolClosed: the pool was closed; PoolNotStarted: it was never started.
        """
        items = self._items(rows, n, num_needed)
        started = time.monotonic()
        batch = BatchCollector(items)
        async with RolloutStream(self._run(items, num_needed)) as stream:
            async for sample, item in stream:
                batch.add(sample, item)
        return batch.result(started)

    def stream(self, rows: Iterable[Any], *, n: int | None = None,
               num_needed: int | None = None) -> RolloutStream[SampleResult]:
        """Yield each sample as ``(sample, item)`` as soon as its worker returns it; see
        :meth:`pipeline.Pipeline.stream`. Leaving the ``async with`` block early aborts
        what still runs on the workers and waits for it.

        Raises:
            PoolClosed, PoolNotStarted: as :meth:`run_batch` (here, or when iterated if the
                pool closed meanwhile).
        """
        return RolloutStream(self._run(self._items(rows, n, num_needed), num_needed))

    def stream_groups(self, rows: Iterable[Any], *, n: int | None = None,
                      num_needed: int | None = None) -> RolloutStream[GroupResult]:
        """Yield each prompt's group once all its samples are back (a group runs on one
        worker, so a group is complete as soon as that worker has finished it)."""
        items = self._items(rows, n, num_needed)
        return RolloutStream(self._groups(items, num_needed))

    def _check_started(self) -> None:
        self._check_open()
        if self._fleet.config is None:
            raise PoolNotStarted("start the pool first: await pool.start() or async with pool")

    def _items(self, rows: Iterable[Any], n: int | None,
               num_needed: int | None) -> list[AgentRolloutItem]:
        self._check_started()
        assert self._fleet.config is not None
        items = make_items(rows, n, self._fleet.config)
        check_num_needed(num_needed, len(items))
        return items

    async def _groups(self, items: list[AgentRolloutItem], num_needed: int | None
                      ) -> AsyncGenerator[GroupResult, None]:
        groups = GroupCollector(items)
        stream = RolloutStream(self._run(items, num_needed))
        del items  # the collector counts each group's size; _run keeps what is not back
        async with stream:
            async for result in stream:
                gid = groups.add(result)
                del result  # the collector's until its group is complete, then the consumer's
                if gid is not None:
                    yield groups.take(gid)  # in no local: the consumer's alone once yielded

    async def _run(self, items: list[AgentRolloutItem], num_needed: int | None
                   ) -> AsyncGenerator[SampleResult, None]:
        """The driver's side of one batch: shard, merge, retry, abort.

        It keeps no item or sample it has handed over: an item stays (in its worker call's
        ``pending``, for a retry) only until its sample is back, and a result only until
        it is yielded. A long stream would otherwise keep every sample it produced, item
        included, for the collector to walk (as ``Pipeline.stream`` no longer does)."""
        self._check_open()
        run = BatchRun(self._fleet, num_needed, self.max_retries)
        self._runs.add(run)
        try:
            left = len(items)
            run.send_all(shard(list(by_group(items).values()), self._fleet.targets()))
            del items
            try:
                while left:
                    results = await run.next_results()
                    left -= len(results)
                    results.reverse()
                    while results:  # popped: the list keeps none of those yielded before
                        yield results.pop()
            finally:
                await run.close()
        finally:
            self._runs.discard(run)

    # -- weights and asynchronous RL ---------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version of every worker's engine (after the last :meth:`update_weights`)."""
        return self._fleet.policy_version

    async def update_weights(self, state_dict: Mapping[str, Any] | None = None,
                             path: str | Path | None = None, *, version: int | None = None,
                             load: Callable[[Any], Any] | None = None,
                             mode: str = "keep") -> WeightUpdate:
        """Push new weights to every worker's engine while their samples keep going: each
        worker pauses its engine (``mode``; ``"keep"``: requests in flight go on afterwards
        with the tokens they had), loads, takes the same version and resumes. Returns once
        every worker has updated.

        ``state_dict`` is put in Ray's object store once and fetched by each worker (before
        its pause); ``path`` is read by each engine; ``load`` (picklable by value) is called
        in each worker with its engine while paused and returns the new version (or None:
        the engine's). ``version`` defaults to :attr:`policy_version` + 1 (with ``load``, to
        what the loads return, which must agree). A worker started later to replace a lost
        one gets the last update before it takes work.

        Raises:
            WeightUpdateFailed: some worker's update failed (naming each, with its cause;
                every worker was resumed) or the workers' versions disagree.
            ConfigError: more than one source, or engines without weight sync hooks.
            PoolClosed, PoolNotStarted: as :meth:`run_batch`.
        """
        self._check_started()
        check_update(state_dict, path, load)
        if not self._fleet.weight_sync:
            raise ConfigError("the workers' engines have no weight sync hooks (pause, resume, "
                              "update_weights)", field="engine")
        if version is None and load is None:
            version = self.policy_version + 1
        args = UpdateArgs(mode, [ray.put(dict(state_dict))] if state_dict is not None else None,
                          None if path is None else str(path), version, load)
        result = await update_fleet(self._fleet, args)
        self._fleet.policy_version = result.version
        self._fleet.last_update = args
        return result

    def group_runner(self) -> PoolGroups:
        """What :class:`~pipeline.AsyncRollout` drives when given this pool: groups started
        one by one on the least loaded worker, handed back whole.

        Raises:
            PoolClosed, PoolNotStarted: as :meth:`run_batch`.
        """
        self._check_started()
        run = BatchRun(self._fleet, None, self.max_retries)
        self._runs.add(run)
        return PoolGroups(self._fleet, run, self.update_weights, lambda: self.policy_version,
                          self._runs.discard)

    # -- diagnostics and limits --------------------------------------------------------------

    def fleet_section(self) -> tuple[str, Any]:
        """Every worker's snapshot, rendered (the ``ray workers`` section of this process's
        dumps). Blocks up to ``dump_timeout_s``; run it off the event loop."""
        return fleet_section(self._fleet.slots, self.dump_timeout_s)

    async def dump(self, reason: str = "pool.dump()") -> str:
        """The driver's snapshot followed by every worker's, as text (what ``rollout dump
        <driver pid>`` prints)."""
        snap = capture_snapshot(reason=reason)
        text, _ = await asyncio.to_thread(self.fleet_section)
        return f"{render_text(snap)}\n== ray workers ==\n{text}\n"

    async def limiter_stats(self) -> dict[str, BucketStats]:
        """The fleet-wide figures of every limit (empty without ``fleet_limits``)."""
        if self._fleet.limiter is None:
            return {}
        stats: dict[str, BucketStats] = await self._fleet.limiter.stats.remote()
        return stats
