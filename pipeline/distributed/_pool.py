"""RayRolloutPool: rollout workers as Ray actors, driven like one ``Pipeline``.

The driver turns rows into items itself (with the workers' config, so uids, groups and seeds
are those one process would give), shards them by group (a prompt's ``n`` samples stay on one
worker, where the engine's prefix cache serves them) to the least loaded workers, and merges
what streams back. A worker that dies mid-batch loses nothing: the samples it had not
returned are run again once on another worker, then reported ``failed`` naming it; the pool
starts a replacement. The driver never waits on a dead worker: Ray reports the death to the
stream that was reading from it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
import structlog

from pipeline._config import PipelineConfig
from pipeline._context import Context, Resources
from pipeline._fill import fill_sample, minimal_sample
from pipeline._items import make_items
from pipeline._models import AgentRolloutItem, ProduceBatchResult, RolloutSample, Status
from pipeline._outcome import ENOUGH, force_end
from pipeline._stats import safe_stats
from pipeline._stream import GroupResult, RolloutStream, SampleResult, check_num_needed
from pipeline.diagnostics import Watchdog, add_dump_section, capture_snapshot, render_text
from pipeline.distributed._limiter import LimiterActor
from pipeline.distributed._worker import RolloutWorker
from pipeline.ratelimit import BucketStats

_logger = structlog.get_logger("pipeline.distributed")

DEFAULT_WORKER_OPTIONS: Mapping[str, Any] = {"num_cpus": 0.5}
"""Per-worker Ray resources: four workers fit a ``num_cpus=2`` cluster."""


@dataclass
class WorkerInfo:
    """A pool slot as the driver sees it."""

    slot: int
    worker_id: str
    pid: int | None
    alive: bool
    load: int
    """Samples sent to it and not yet returned."""


class _Slot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.generation = 0
        self.worker_id = f"worker-{index}"
        self.handle: Any = None
        self.pid: int | None = None
        self.alive = False
        self.load = 0

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.index, self.worker_id, self.pid, self.alive, self.load)


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
        ray_init: keyword arguments for ``ray.init`` when the pool starts Ray itself.
    """

    def __init__(self, num_workers: int, pipeline_factory: Callable[[], Any], *,
                 ray_address: str | None = None,
                 worker_options: Mapping[str, Any] | None = None, max_retries: int = 1,
                 fleet_limits: bool = True, watchdog: Watchdog | bool = True,
                 dump_timeout_s: float = 5.0, replace_timeout_s: float = 120.0,
                 ray_init: Mapping[str, Any] | None = None) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not callable(pipeline_factory):
            raise TypeError(f"pipeline_factory must be callable, got {pipeline_factory!r}")
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
        self._ray_init = dict(ray_init or {})
        self._slots = [_Slot(i) for i in range(num_workers)]
        self._limiter: Any = None
        self._config: PipelineConfig | None = None
        self._pad_token_id = 0
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._remove_section: Callable[[], None] | None = None
        self._calls = itertools.count()
        self._started = False
        self._closed = False
        self.replacements = 0
        """Workers started to replace dead ones."""

    # -- life cycle --------------------------------------------------------------------------

    async def start(self) -> RayRolloutPool:
        """Connect to Ray and start every worker (idempotent).

        Raises:
            Whatever a worker's pipeline factory raised.
        """
        if self._started:
            return self
        if self._closed:
            raise RuntimeError("this RayRolloutPool is closed")
        if not ray.is_initialized():
            options = {"include_dashboard": False, **self._ray_init}
            if self._address is not None:
                options["address"] = self._address
            ray.init(**options)
        if self._fleet_limits:
            self._limiter = ray.remote(LimiterActor).options(num_cpus=0).remote()
        try:
            await asyncio.gather(*(self._launch(slot) for slot in self._slots))
        except BaseException:
            await self._kill_all()
            raise
        self._started = True
        self._remove_section = add_dump_section("ray workers", self.fleet_section)
        _logger.info("ray_pool_started", workers=[s.worker_id for s in self._slots])
        return self

    async def _launch(self, slot: _Slot) -> None:
        handle: Any = ray.remote(RolloutWorker).options(max_restarts=0, **self._options).remote(
            slot.worker_id, self._factory, self._limiter, self._watchdog)
        info = await handle.ready.remote()
        slot.handle, slot.pid, slot.alive = handle, info["pid"], True
        if self._config is None:
            self._config = info["config"]
            self._pad_token_id = info["pad_token_id"]
        self._changed.set()
        self._changed = asyncio.Event()

    async def aclose(self) -> None:
        """Stop the workers and the limiter actor (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._remove_section is not None:
            self._remove_section()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        live = [s.handle for s in self._slots if s.alive]
        if live:
            await asyncio.wait([asyncio.ensure_future(_await(h.shutdown.remote())) for h in live],
                               timeout=15)
        await self._kill_all()

    async def _kill_all(self) -> None:
        for slot in self._slots:
            if slot.handle is not None:
                _kill(slot.handle)
            slot.alive = False
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

    # -- running -----------------------------------------------------------------------------

    async def run_batch(self, rows: Iterable[Any], *, n: int | None = None,
                        num_needed: int | None = None) -> ProduceBatchResult:
        """Run a batch across the workers; one sample per item, in input order, exactly as
        :meth:`pipeline.Pipeline.run_batch` returns it.

        Raises:
            RowError, ConfigError: bad input, before any work starts.
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
        what still runs on the workers and waits for it."""
        return RolloutStream(self._run(self._items(rows, n, num_needed), num_needed))

    def stream_groups(self, rows: Iterable[Any], *, n: int | None = None,
                      num_needed: int | None = None) -> RolloutStream[GroupResult]:
        """Yield each prompt's group once all its samples are back (a group runs on one
        worker, so a group is complete as soon as that worker has finished it)."""
        items = self._items(rows, n, num_needed)
        return RolloutStream(self._groups(items, num_needed))

    def _items(self, rows: Iterable[Any], n: int | None,
               num_needed: int | None) -> list[AgentRolloutItem]:
        if self._config is None:
            raise RuntimeError("start the pool first: await pool.start() or async with pool")
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
        run = _BatchRun(self, num_needed)
        groups: dict[str, list[AgentRolloutItem]] = {}
        for item in items:
            groups.setdefault(item.group_id, []).append(item)
        for slot, chunk in self._shard(list(groups.values())):
            run.send(slot, chunk)
        left = len(items)
        try:
            while left:
                for result in await run.next_results():
                    left -= 1
                    yield result
        finally:
            await run.close()

    def _shard(self, groups: list[list[AgentRolloutItem]]
               ) -> list[tuple[_Slot, list[AgentRolloutItem]]]:
        live = [s for s in self._slots if s.alive] or self._slots
        load = {s.index: s.load for s in live}
        batches: dict[int, list[AgentRolloutItem]] = {s.index: [] for s in live}
        for group in groups:
            target = min(live, key=lambda s: (load[s.index], s.index))
            batches[target.index].extend(group)
            load[target.index] += len(group)
        return [(s, batches[s.index]) for s in live if batches[s.index]]

    async def live_slot(self, exclude: set[str]) -> _Slot | None:
        """The least loaded live worker not in ``exclude``; waits for a replacement when
        there is none, up to ``replace_timeout_s``."""
        deadline = time.monotonic() + self.replace_timeout_s
        while True:
            live = [s for s in self._slots if s.alive and s.worker_id not in exclude]
            if live:
                return min(live, key=lambda s: (s.load, s.index))
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return None

    def worker_lost(self, slot: _Slot, handle: Any, exc: BaseException) -> None:
        """Mark a slot's worker dead (once), withdraw its leases, start a replacement."""
        if slot.handle is not handle or not slot.alive:
            return
        slot.alive = False
        slot.load = 0
        _logger.error("ray_worker_lost", worker=slot.worker_id, pid=slot.pid,
                      error=f"{type(exc).__name__}: {str(exc)[:300]}")
        if self._limiter is not None:
            self._limiter.release.remote(slot.worker_id)
        _kill(handle)
        if not self._closed:
            self.spawn(self._replace(slot))

    async def _replace(self, slot: _Slot) -> None:
        for attempt in range(3):
            slot.generation += 1
            slot.worker_id = f"worker-{slot.index}.{slot.generation}"
            try:
                await self._launch(slot)
            except Exception as exc:
                _logger.error("ray_worker_replace_failed", worker=slot.worker_id,
                              attempt=attempt + 1, error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0 * (attempt + 1))
                continue
            self.replacements += 1
            _logger.info("ray_worker_replaced", worker=slot.worker_id, pid=slot.pid)
            return

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """A task owned by the pool (cancelled and awaited by :meth:`aclose`)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

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
            if slot.alive:
                refs[slot.worker_id] = slot.handle.snapshot.remote("fleet dump")
            else:
                texts.append(f"--- {slot.worker_id}: not running (being replaced) ---")
                data[slot.worker_id] = {"alive": False}
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
        self.calls: dict[str, tuple[_Slot, Any]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.tries: dict[str, list[str]] = {}  # group id -> workers that lost it

    def send(self, slot: _Slot, items: list[AgentRolloutItem]) -> None:
        call = self.pool.call_id()
        handle = slot.handle
        self.calls[call] = (slot, handle)
        slot.load += len(items)
        task = asyncio.get_running_loop().create_task(self._consume(call, slot, handle, items),
                                                      name=f"ray-call:{slot.worker_id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if self.aborting:
            handle.abort.remote(call)

    async def _consume(self, call: str, slot: _Slot, handle: Any,
                       items: list[AgentRolloutItem]) -> None:
        pending = {item.uid: item for item in items}
        error: BaseException | None = None
        try:
            stream = handle.run_items.options(num_returns="streaming").remote(call, items)
            async for ref in stream:
                chunk = await ref
                results = []
                for sample, item in chunk:
                    if pending.pop(item.uid, None) is not None:
                        results.append(SampleResult(sample, item))
                        if sample.status is Status.COMPLETED:
                            self.completed += 1
                if handle is slot.handle:
                    slot.load -= len(results)
                self.results.put_nowait(results)
                self._check_enough()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = exc
        finally:
            self.calls.pop(call, None)
        if pending:
            lost = error or RuntimeError("the worker's stream ended early")
            if isinstance(lost, ray.exceptions.RayActorError) or error is None:
                self.pool.worker_lost(slot, handle, lost)
            await self._retry(slot, list(pending.values()), lost)

    def _check_enough(self) -> None:
        if (self.num_needed is not None and not self.aborting
                and self.completed >= self.num_needed):
            self.abort_all()

    def abort_all(self) -> None:
        self.aborting = True
        for call, (_, handle) in list(self.calls.items()):
            handle.abort.remote(call)

    async def _retry(self, slot: _Slot, items: list[AgentRolloutItem],
                     error: BaseException) -> None:
        died = f"worker {slot.worker_id} (pid {slot.pid})"
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        groups: dict[str, list[AgentRolloutItem]] = {}
        for item in items:
            groups.setdefault(item.group_id, []).append(item)
        _logger.warning("ray_samples_lost", worker=slot.worker_id, samples=len(items),
                        groups=len(groups), error=reason)
        for gid, group in groups.items():
            tried = self.tries.setdefault(gid, [])
            tried.append(slot.worker_id)
            if self.aborting:
                self._end(group, Status.ABORTED, f"{ENOUGH} ({died} was lost before it ran)")
                continue
            target = None
            if len(tried) <= self.pool.max_retries:
                target = await self.pool.live_slot(set(tried))
            if target is None or self.aborting:
                self._end(group, Status.FAILED,
                          f"lost with {died}: {reason}; workers tried: {', '.join(tried)}")
                continue
            _logger.info("ray_samples_retried", group=gid, samples=len(group),
                         lost_on=slot.worker_id, retry_on=target.worker_id)
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


async def _await(ref: Any) -> Any:
    return await ref


def _kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # already gone
        _logger.debug("ray_kill_failed", error=str(exc))
