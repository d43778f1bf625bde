"""RayRolloutPool: rollout workers as Ray actors, driven like one ``Pipeline``.

The driver turns rows into items itself (with the workers' config, so uids, groups and seeds
are those one process would give), shards them by group (a prompt's ``n`` samples stay on one
worker, where the engine's prefix cache serves them) to the least loaded workers, and merges
what streams back. A worker that dies mid-batch loses nothing: the samples it had not
returned are run again once on another worker, then reported ``failed`` naming it; the pool
starts a replacement. The driver never waits on a dead worker: Ray reports the death to the
stream that was reading from it.

Rules the pool keeps on every path:

- A worker is *lost* when Ray reports its death, when it says it is broken (its pipeline loop
  ended: :class:`~pipeline.distributed.WorkerBroken`), or when it leaves health checks
  unanswered for ``health_timeout_s``. A lost worker is marked dead at once (``pool.workers``
  says so), killed, its leases withdrawn, and replaced; only a loss retries samples.
- Any other error of a worker call (Ray could not send the batch, a worker method raised)
  ends that call's unreturned samples ``failed`` with the real cause, once the worker has
  answered a health check; a worker that does not is lost instead.
- Load: a call raises its worker's load by its samples inside the ``try`` whose ``finally``
  lowers it by every sample that did not come back, so no path leaves load behind.
- A background health watch (one task, owned by the pool, stopped by :meth:`aclose`) asks every
  worker every ``health_interval_s`` (each question bounded by ``health_probe_s``), so a worker
  that dies while the pool is idle is replaced within seconds, not found by the next batch.
- After :meth:`aclose`, ``run_batch``, ``stream``, ``stream_groups`` and ``start`` raise
  :class:`PoolClosed`; a batch still running when it closes ends its samples ``aborted``.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import re
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
import structlog

from pipeline._data.config import PipelineConfig
from pipeline._data.items import make_items
from pipeline._data.models import AgentRolloutItem, ProduceBatchResult, RolloutSample, Status
from pipeline._data.stats import safe_stats
from pipeline._exceptions import PipelineError
from pipeline._runner.context import Context, Resources
from pipeline._runner.dynamic import GroupResult
from pipeline._runner.fill import fill_sample, minimal_sample
from pipeline._runner.outcome import ENOUGH, force_end
from pipeline._runner.stream import RolloutStream, SampleResult, check_num_needed
from pipeline.diagnostics import Watchdog, add_dump_section, capture_snapshot, render_text
from pipeline.distributed._limiter import start_limiter
from pipeline.distributed._worker import Chunk, RolloutWorker, WorkerBroken
from pipeline.ratelimit import BucketStats

_logger = structlog.get_logger("pipeline.distributed")

DEFAULT_WORKER_OPTIONS: Mapping[str, Any] = {"num_cpus": 0.5}
"""Per-worker Ray resources: four workers fit a ``num_cpus=2`` cluster."""

CLOSED_WHILE_RUNNING = "the pool was closed before this sample finished"


class PoolClosed(PipelineError, RuntimeError):
    """The :class:`RayRolloutPool` was closed (``aclose``); start a new one to run more."""


class PoolNotStarted(PipelineError, RuntimeError):
    """The :class:`RayRolloutPool` has not been started (``await pool.start()`` or
    ``async with pool``)."""


@dataclass
class WorkerInfo:
    """A pool slot as the driver sees it."""

    slot: int
    worker_id: str
    pid: int | None
    alive: bool
    """Started, and not known to be dead or broken (health checks, calls)."""
    load: int
    """Samples sent to it and not yet returned."""


class _Worker:
    """One actor of a slot: its own liveness and load, so a replacement starts clean."""

    def __init__(self, worker_id: str, handle: Any) -> None:
        self.worker_id = worker_id
        self.handle = handle
        self.pid: int | None = None
        self.alive = False
        self.lost = False
        self.load = 0
        self.unanswered_since: float | None = None

    def name(self) -> str:
        return f"worker {self.worker_id} (pid {self.pid})"


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.generation = 0
        self.worker: _Worker | None = None
        self.replacing: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.worker.alive

    def info(self) -> WorkerInfo:
        w = self.worker
        if w is None:
            return WorkerInfo(self.index, f"worker-{self.index}", None, False, 0)
        return WorkerInfo(self.index, w.worker_id, w.pid, w.alive, w.load)


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
        self._factory = pipeline_factory
        self._address = ray_address
        self._options = dict(DEFAULT_WORKER_OPTIONS if worker_options is None
                             else worker_options)
        self.max_retries = max_retries
        self._fleet_limits = fleet_limits
        self._watchdog = watchdog
        self.dump_timeout_s = dump_timeout_s
        self.replace_timeout_s = replace_timeout_s
        self.health_interval_s = health_interval_s
        self.health_probe_s = health_probe_s
        self.health_timeout_s = health_timeout_s
        self._ray_init = dict(ray_init or {})
        self._slots = [_Slot(i) for i in range(num_workers)]
        self._limiter: Any = None
        self._config: PipelineConfig | None = None
        self._pad_token_id = 0
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._runs: set[_BatchRun] = set()
        self._remove_section: Callable[[], None] | None = None
        self._calls = itertools.count()
        self._started = False
        self._closed = False
        self.replacements = 0
        """Workers started to replace dead ones."""

    # -- life cycle --------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosed("this RayRolloutPool is closed (aclose() was called); start a "
                             "new pool to run more samples")

    async def start(self) -> RayRolloutPool:
        """Connect to Ray, start every worker and the health watch (idempotent).

        Raises:
            PoolClosed: the pool was closed.
            Whatever a worker's pipeline factory raised.
        """
        self._check_open()
        if self._started:
            return self
        if not ray.is_initialized():
            options = {"include_dashboard": False, **self._ray_init}
            if self._address is not None:
                options["address"] = self._address
            ray.init(**options)
        if self._fleet_limits:
            self._limiter = start_limiter()
        launches = [asyncio.ensure_future(self._launch(slot, f"worker-{slot.index}"))
                    for slot in self._slots]
        try:
            await asyncio.gather(*launches)
        except BaseException:
            for launch in launches:  # a launch cancelled kills the actor it started
                launch.cancel()
            await asyncio.gather(*launches, return_exceptions=True)
            await self._kill_all()
            raise
        self._started = True
        self._remove_section = add_dump_section("ray workers", self.fleet_section)
        self.spawn(self._health_watch(), name="ray-pool-health")
        _logger.info("ray_pool_started", workers=[s.info().worker_id for s in self._slots])
        return self

    async def _launch(self, slot: _Slot, worker_id: str) -> None:
        handle: Any = ray.remote(RolloutWorker).options(max_restarts=0, **self._options).remote(
            worker_id, self._factory, self._limiter, self._watchdog)
        worker = _Worker(worker_id, handle)
        try:
            info = await handle.ready.remote()
        except BaseException:
            _kill(handle)  # never leave an actor behind that nobody holds
            raise
        worker.pid, worker.alive = info["pid"], True
        slot.worker = worker
        if self._config is None:
            self._config = info["config"]
            self._pad_token_id = info["pad_token_id"]
        self._changed.set()
        self._changed = asyncio.Event()

    async def aclose(self) -> None:
        """Abort what still runs, stop the health watch, the workers and the limiter actor
        (idempotent). Later calls raise :class:`PoolClosed`."""
        if self._closed:
            return
        self._closed = True
        if self._remove_section is not None:
            self._remove_section()
        for run in list(self._runs):
            run.abort_all()
        self._changed.set()  # a retry waiting for a live worker gives up now
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        live = [s.worker.handle for s in self._slots if s.worker is not None and s.alive]
        if live:
            await asyncio.wait([asyncio.ensure_future(_await(h.shutdown.remote())) for h in live],
                               timeout=15)
        await self._kill_all()

    async def _kill_all(self) -> None:
        for slot in self._slots:
            if slot.worker is not None:
                _kill(slot.worker.handle)
                slot.worker.alive = False
                slot.worker.lost = True  # on purpose: nothing to report or replace
        if self._limiter is not None:
            _kill(self._limiter)

    async def __aenter__(self) -> RayRolloutPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def workers(self) -> list[WorkerInfo]:
        """Every slot: its current worker, pid, whether alive, its load."""
        return [slot.info() for slot in self._slots]

    # -- health ------------------------------------------------------------------------------

    async def _health_watch(self) -> None:
        """Ask every live worker how it is, every ``health_interval_s``; replace the lost."""
        while not self._closed:
            probes = [asyncio.ensure_future(self.probe(s.worker)) for s in self._slots
                      if s.worker is not None and s.alive]
            try:
                if probes:
                    await asyncio.wait(probes)
            finally:
                for probe in probes:
                    probe.cancel()
            for slot in self._slots:  # a slot whose replacement gave up: try again
                if not slot.alive and slot.replacing is None and not self._closed:
                    slot.replacing = self.spawn(self._replace(slot), name="ray-pool-replace")
            await asyncio.sleep(self.health_interval_s)

    async def probe(self, worker: _Worker) -> bool:
        """Ask ``worker`` how it is (bounded by ``health_probe_s``); mark it lost if it is
        dead, broken, or silent for ``health_timeout_s``.

        Returns:
            Whether it is alive after all (a silent one counts as alive until its timeout).
        """
        if worker.lost:
            return False
        try:
            problem = await asyncio.wait_for(_await(worker.handle.health.remote()),
                                             self.health_probe_s)
        except TimeoutError:
            now = time.monotonic()
            if worker.unanswered_since is None:
                worker.unanswered_since = now
            silent = now - worker.unanswered_since
            _logger.warning("ray_worker_silent", worker=worker.worker_id, silent_s=round(silent, 1))
            if silent >= self.health_timeout_s:
                self.worker_lost(worker, WorkerBroken(
                    f"no answer to health checks for {silent:.0f}s"))
                return False
            return True
        except ray.exceptions.RayActorError as exc:
            self.worker_lost(worker, exc)
            return False
        except Exception as exc:  # Ray itself in trouble: say so, decide nothing
            _logger.warning("ray_worker_probe_failed", worker=worker.worker_id,
                            error=describe(exc))
            return True
        worker.unanswered_since = None
        if problem is not None:
            self.worker_lost(worker, WorkerBroken(str(problem)))
            return False
        return True

    def worker_lost(self, worker: _Worker, exc: BaseException) -> None:
        """Mark ``worker`` dead (once), withdraw its leases, kill it, start a replacement."""
        if worker.lost:
            return
        worker.lost = True
        worker.alive = False
        _logger.error("ray_worker_lost", worker=worker.worker_id, pid=worker.pid,
                      error=describe(exc, first_line=True, limit=300))
        if self._limiter is not None:
            self._limiter.release.remote(worker.worker_id)
        _kill(worker.handle)
        for slot in self._slots:
            if slot.worker is worker and slot.replacing is None and not self._closed:
                slot.replacing = self.spawn(self._replace(slot), name="ray-pool-replace")

    async def _replace(self, slot: _Slot) -> None:
        try:
            for attempt in range(3):
                slot.generation += 1
                worker_id = f"worker-{slot.index}.{slot.generation}"
                try:
                    await self._launch(slot, worker_id)
                except Exception as exc:
                    _logger.error("ray_worker_replace_failed", worker=worker_id,
                                  attempt=attempt + 1, error=describe(exc))
                    await asyncio.sleep(1.0 * (attempt + 1))
                    continue
                self.replacements += 1
                _logger.info("ray_worker_replaced", worker=worker_id, pid=slot.info().pid)
                return
        finally:
            slot.replacing = None  # the health watch tries again later if this gave up

    def spawn(self, coro: Any, name: str = "ray-pool") -> asyncio.Task[Any]:
        """A task owned by the pool (cancelled and awaited by :meth:`aclose`)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
        position = {item.uid: i for i, item in enumerate(items)}
        samples: list[RolloutSample | None] = [None] * len(items)
        out_items = list(items)
        async with RolloutStream(self._run(items, num_needed)) as stream:
            async for sample, item in stream:
                i = position[item.uid]
                samples[i], out_items[i] = sample, item
        done = [s for s in samples if s is not None]
        assert len(done) == len(items), "every sample comes back exactly once"
        return ProduceBatchResult(samples=done, items=out_items,
                                  stats=safe_stats(done, out_items, time.monotonic() - started))

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

    def _items(self, rows: Iterable[Any], n: int | None,
               num_needed: int | None) -> list[AgentRolloutItem]:
        self._check_open()
        if self._config is None:
            raise PoolNotStarted("start the pool first: await pool.start() or async with pool")
        items = make_items(rows, n, self._config)
        check_num_needed(num_needed, len(items))
        return items

    async def _groups(self, items: list[AgentRolloutItem], num_needed: int | None
                      ) -> AsyncGenerator[GroupResult, None]:
        size: dict[str, int] = {}
        for item in items:
            size[item.group_id] = size.get(item.group_id, 0) + 1
        got: dict[str, list[SampleResult]] = {}
        async with RolloutStream(self._run(items, num_needed)) as stream:
            async for result in stream:
                gid = result.item.group_id
                done = got.setdefault(gid, [])
                done.append(result)
                if len(done) == size[gid]:
                    done.sort(key=lambda r: r.item.sample_index)
                    del got[gid]
                    yield GroupResult(gid, [r.sample for r in done], [r.item for r in done])

    async def _run(self, items: list[AgentRolloutItem], num_needed: int | None
                   ) -> AsyncGenerator[SampleResult, None]:
        """The driver's side of one batch: shard, merge, retry, abort."""
        self._check_open()
        run = _BatchRun(self, num_needed)
        self._runs.add(run)
        try:
            groups: dict[str, list[AgentRolloutItem]] = {}
            for item in items:
                groups.setdefault(item.group_id, []).append(item)
            for worker, chunk in self._shard(list(groups.values())):
                run.send(worker, chunk)
            left = len(items)
            try:
                while left:
                    for result in await run.next_results():
                        left -= 1
                        yield result
            finally:
                await run.close()
        finally:
            self._runs.discard(run)

    def _shard(self, groups: list[list[AgentRolloutItem]]
               ) -> list[tuple[_Worker, list[AgentRolloutItem]]]:
        live = [s.worker for s in self._slots if s.worker is not None and s.alive]
        if not live:  # every call fails and retries wait for a replacement
            live = [s.worker for s in self._slots if s.worker is not None]
        load = {id(w): w.load for w in live}
        batches: dict[int, list[AgentRolloutItem]] = {id(w): [] for w in live}
        for group in groups:
            target = min(live, key=lambda w: load[id(w)])
            batches[id(target)].extend(group)
            load[id(target)] += len(group)
        return [(w, batches[id(w)]) for w in live if batches[id(w)]]

    async def live_worker(self, exclude: set[str]) -> _Worker | None:
        """The least loaded live worker not in ``exclude``; waits for a replacement when
        there is none, up to ``replace_timeout_s`` (None: none came, or the pool closed)."""
        deadline = time.monotonic() + self.replace_timeout_s
        while True:
            if self._closed:
                return None
            live = [s.worker for s in self._slots if s.worker is not None and s.alive
                    and s.worker.worker_id not in exclude]
            if live:
                return min(live, key=lambda w: w.load)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return None

    def call_id(self) -> str:
        return f"{uuid.uuid4().hex[:8]}-{next(self._calls)}"

    def end_locally(self, item: AgentRolloutItem, status: Status, error: str) -> SampleResult:
        """A sample the driver ends itself (its worker died, or it was aborted before it
        could run again): a masked trainer view built here."""
        force_end(item, status, error)
        assert self._config is not None
        try:
            sample = fill_sample(item, Context(Resources(), self._config, item))
        except Exception:
            sample = minimal_sample(item, self._pad_token_id, error)
        return SampleResult(sample, item)

    # -- diagnostics and limits --------------------------------------------------------------

    def fleet_section(self) -> tuple[str, Any]:
        """Every worker's snapshot, rendered (the ``ray workers`` section of this process's
        dumps). Blocks up to ``dump_timeout_s``; run it off the event loop."""
        refs: dict[str, Any] = {}
        texts: list[str] = []
        data: dict[str, Any] = {}
        for slot in self._slots:
            worker = slot.worker
            if worker is not None and worker.alive:
                refs[worker.worker_id] = worker.handle.snapshot.remote("fleet dump")
            else:
                name = slot.info().worker_id
                texts.append(f"--- {name}: not running (being replaced) ---")
                data[name] = {"alive": False}
        ready: list[Any] = []
        if refs:
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs),
                                timeout=self.dump_timeout_s)
        for worker_id, ref in refs.items():
            if ref not in ready:
                texts.append(f"--- {worker_id}: no answer within {self.dump_timeout_s:g}s ---")
                data[worker_id] = {"alive": True, "error": "no answer"}
                continue
            try:
                snap = ray.get(ref)
            except Exception as exc:
                texts.append(f"--- {worker_id}: {type(exc).__name__}: {str(exc)[:200]} ---")
                data[worker_id] = {"alive": False, "error": str(exc)[:200]}
                continue
            texts.append(f"--- {worker_id} (pid {snap['pid']}) ---\n{snap['text'].rstrip()}")
            data[worker_id] = snap["data"]
        return "\n".join(texts), data

    async def dump(self, reason: str = "pool.dump()") -> str:
        """The driver's snapshot followed by every worker's, as text (what ``rollout dump
        <driver pid>`` prints)."""
        snap = capture_snapshot(reason=reason)
        text, _ = await asyncio.to_thread(self.fleet_section)
        return f"{render_text(snap)}\n== ray workers ==\n{text}\n"

    async def limiter_stats(self) -> dict[str, BucketStats]:
        """The fleet-wide figures of every limit (empty without ``fleet_limits``)."""
        if self._limiter is None:
            return {}
        stats: dict[str, BucketStats] = await self._limiter.stats.remote()
        return stats


class _BatchRun:
    """One batch (or stream) on the fleet: the worker calls it made, their results, retries."""

    def __init__(self, pool: RayRolloutPool, num_needed: int | None) -> None:
        self.pool = pool
        self.num_needed = num_needed
        self.completed = 0
        self.aborting = False
        self.results: asyncio.Queue[list[SampleResult]] = asyncio.Queue()
        self.calls: dict[str, _Worker] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.tries: dict[str, list[str]] = {}  # group id -> workers that lost it

    def send(self, worker: _Worker, items: list[AgentRolloutItem]) -> None:
        call = self.pool.call_id()
        self.calls[call] = worker
        task = asyncio.get_running_loop().create_task(self._consume(call, worker, items),
                                                      name=f"ray-call:{worker.worker_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _consume(self, call: str, worker: _Worker, items: list[AgentRolloutItem]) -> None:
        pending = {item.uid: item for item in items}
        error: Exception | None = None
        worker.load += len(items)  # lowered in the finally by whatever did not come back
        try:
            try:
                stream = worker.handle.run_items.options(num_returns="streaming").remote(
                    call, items)
            except Exception as exc:  # Ray could not send them: fail those that cannot go
                unsendable = _unsendable(items)
                if not unsendable:
                    raise
                for uid, why in unsendable.items():
                    self._end([pending.pop(uid)], Status.FAILED,
                              f"Ray could not send this sample to {worker.name()}: {why}")
                worker.load -= len(unsendable)
                _logger.error("ray_send_failed", worker=worker.worker_id,
                              samples=len(unsendable), error=describe(exc, first_line=True,
                                                                       limit=300))
                if pending:  # the others go on their own (a new call counts them again)
                    resend = list(pending.values())
                    pending.clear()
                    worker.load -= len(resend)
                    self.send(worker, resend)
                return
            if self.aborting:  # the worker remembers an abort that comes before its batch
                worker.handle.abort.remote(call)
            async for ref in stream:
                chunk: Chunk = await ref
                results = [r for entry in chunk
                           if (r := self._unpack(worker, entry, pending)) is not None]
                worker.load -= len(results)
                for result in results:
                    if result.sample.status is Status.COMPLETED:
                        self.completed += 1
                self.results.put_nowait(results)
                self._check_enough()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = exc
        finally:
            self.calls.pop(call, None)
            worker.load -= len(pending)
        if pending:
            await self._settle(worker, list(pending.values()), error)

    def _unpack(self, worker: _Worker, entry: Any, pending: dict[str, AgentRolloutItem]
                ) -> SampleResult | None:
        uid, payload, error = entry
        item = pending.pop(uid, None)
        if item is None:
            return None  # not ours (already ended): never twice
        if payload is None:
            return self.pool.end_locally(item, Status.FAILED, str(error))
        try:
            sample, returned = pickle.loads(payload)
        except KeyboardInterrupt:
            raise  # the driver's own Ctrl-C
        except BaseException as exc:  # a __reduce__ of the user's may raise anything
            return self.pool.end_locally(
                item, Status.FAILED, f"the sample came back from {worker.name()} but could "
                f"not be unpickled on the driver: {describe(exc)}")
        return SampleResult(sample, returned)

    async def _settle(self, worker: _Worker, items: list[AgentRolloutItem],
                      error: Exception | None) -> None:
        """Samples a call did not return: a lost worker's are retried; any other error ends
        them ``failed`` with its real cause."""
        lost = error is None or is_worker_loss(error)
        if not lost and not await self.pool.probe(worker):
            lost = True
        if self.pool.closed:
            self._end(items, Status.ABORTED, CLOSED_WHILE_RUNNING)
            return
        if lost:
            cause = error or WorkerBroken("its stream ended before every sample came back")
            self.pool.worker_lost(worker, cause)
            await self._retry(worker, items, cause)
            return
        assert error is not None
        _logger.error("ray_call_failed", worker=worker.worker_id, samples=len(items),
                      error=describe(error, limit=500))
        self._end(items, Status.FAILED,
                  f"{worker.name()} could not run it: {describe(error)}")

    def _check_enough(self) -> None:
        if (self.num_needed is not None and not self.aborting
                and self.completed >= self.num_needed):
            self.abort_all()

    def abort_all(self) -> None:
        self.aborting = True
        for call, worker in list(self.calls.items()):
            if not worker.lost:
                worker.handle.abort.remote(call)

    async def _retry(self, worker: _Worker, items: list[AgentRolloutItem],
                     error: BaseException) -> None:
        died = worker.name()
        reason = describe(error, first_line=True)
        groups: dict[str, list[AgentRolloutItem]] = {}
        for item in items:
            groups.setdefault(item.group_id, []).append(item)
        _logger.warning("ray_samples_lost", worker=worker.worker_id, samples=len(items),
                        groups=len(groups), error=reason)
        for gid, group in groups.items():
            tried = self.tries.setdefault(gid, [])
            tried.append(worker.worker_id)
            if self.aborting:
                self._end(group, Status.ABORTED, f"{ENOUGH} ({died} was lost before it ran)")
                continue
            target = None
            if len(tried) <= self.pool.max_retries:
                target = await self.pool.live_worker(set(tried))
            if self.pool.closed:
                self._end(group, Status.ABORTED, CLOSED_WHILE_RUNNING)
                continue
            if target is None or self.aborting:
                self._end(group, Status.FAILED,
                          f"lost with {died}: {reason}; workers tried: {', '.join(tried)}")
                continue
            _logger.info("ray_samples_retried", group=gid, samples=len(group),
                         lost_on=worker.worker_id, retry_on=target.worker_id)
            self.send(target, group)

    def _end(self, items: list[AgentRolloutItem], status: Status, error: str) -> None:
        self.results.put_nowait([self.pool.end_locally(item, status, error) for item in items])

    async def next_results(self) -> list[SampleResult]:
        return await self.results.get()

    async def close(self) -> None:
        """Abort what still runs and wait for the workers to hand it back."""
        if self.tasks:
            self.abort_all()
            _, pending = await asyncio.wait(list(self.tasks), timeout=60)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def _unsendable(items: list[AgentRolloutItem]) -> dict[str, str]:
    """``uid -> why`` for the items that cannot be pickled on their own."""
    found = {}
    for item in items:
        try:
            ray.cloudpickle.dumps(item)  # type: ignore[no-untyped-call]
        except Exception as exc:
            found[item.uid] = describe(exc, first_line=True, limit=500)
    return found


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def is_worker_loss(error: BaseException) -> bool:
    """Whether ``error`` (from a worker call) means the worker is dead or broken."""
    if isinstance(error, ray.exceptions.RayActorError | WorkerBroken):
        return True
    return isinstance(getattr(error, "cause", None), WorkerBroken)


def describe(error: BaseException, *, first_line: bool = False, limit: int = 2000) -> str:
    """``Type: message`` of the real cause: the worker's own exception for one Ray wrapped
    (not Ray's header line), colour codes removed, capped at ``limit`` characters."""
    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        error = cause
    text = _ANSI.sub("", str(error)).strip()
    if first_line and text:
        text = text.splitlines()[0]
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else f"{text[:limit]} [...]"


async def _await(ref: Any) -> Any:
    return await ref


def _kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # already gone
        _logger.debug("ray_kill_failed", error=str(exc))
