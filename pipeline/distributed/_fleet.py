"""The pool's workers: one slot per worker, its actor launched, watched and replaced.

Rules the fleet keeps:

- A worker is *lost* when Ray reports its death, when it says it is broken (its pipeline loop
  ended: :class:`~pipeline.distributed.WorkerBroken`), or when it leaves health checks
  unanswered for ``health_timeout_s``. A lost worker is marked dead at once (``pool.workers``
  says so), killed, its leases withdrawn, and replaced in its slot.
- A background health watch (one task, owned by the fleet, stopped by :meth:`Fleet.stop`) asks
  every worker every ``health_interval_s`` (each question bounded by ``health_probe_s``), so a
  worker that dies while the pool is idle is replaced within seconds, not found by the next
  batch.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import ray
import structlog

from pipeline._data.config import PipelineConfig
from pipeline.diagnostics import Watchdog
from pipeline.distributed._errors import describe
from pipeline.distributed._limiter import start_limiter
from pipeline.distributed._worker import RolloutWorker, WorkerBroken

_logger = structlog.get_logger("pipeline.distributed")


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


class SlotWorker:
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


class Slot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.generation = 0
        self.worker: SlotWorker | None = None
        self.replacing: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.worker is not None and self.worker.alive

    def info(self) -> WorkerInfo:
        w = self.worker
        if w is None:
            return WorkerInfo(self.index, f"worker-{self.index}", None, False, 0)
        return WorkerInfo(self.index, w.worker_id, w.pid, w.alive, w.load)


class HealthSettings(Protocol):
    """The timings the fleet reads at each use (the pool's attributes of these names)."""

    replace_timeout_s: float
    health_interval_s: float
    health_probe_s: float
    health_timeout_s: float


class Fleet:
    """``num_workers`` slots of :class:`~pipeline.distributed.RolloutWorker` actors.

    Args:
        num_workers: slots.
        factory: the workers' pipeline factory.
        options: Ray actor options per worker.
        watchdog: each worker loop's watchdog setting.
        fleet_limits: start a limiter actor whose leases the workers share.
        settings: the health timings, read at each use.
    """

    def __init__(self, num_workers: int, factory: Callable[[], Any], options: Mapping[str, Any],
                 watchdog: Watchdog | bool, fleet_limits: bool,
                 settings: HealthSettings) -> None:
        self.slots = [Slot(i) for i in range(num_workers)]
        self._factory = factory
        self._options = options
        self._watchdog = watchdog
        self._fleet_limits = fleet_limits
        self._settings = settings
        self.limiter: Any = None
        self.config: PipelineConfig | None = None
        """The workers' pipeline config (known once the first worker is up)."""
        self.pad_token_id = 0
        self.policy_version = 0
        """The workers' engines' version (the first worker's at start, then each update's)."""
        self.weight_sync = True
        """Whether the workers' engines have the weight sync hooks."""
        self.last_update: Any = None
        """The last weight update (``UpdateArgs``), replayed on a replacement worker before it
        takes work, so no worker samples with weights older than the pool's version."""
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._calls = itertools.count()
        self.closed = False
        self.replacements = 0

    # -- life cycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the limiter actor (with ``fleet_limits``) and every worker; on a failure
        kill whatever was started and raise."""
        if self._fleet_limits:
            self.limiter = start_limiter()
        launches = [asyncio.ensure_future(self._launch(slot, f"worker-{slot.index}"))
                    for slot in self.slots]
        try:
            await asyncio.gather(*launches)
        except BaseException:
            for launch in launches:  # a launch cancelled kills the actor it started
                launch.cancel()
            await asyncio.gather(*launches, return_exceptions=True)
            await self._kill_all()
            raise

    def watch(self) -> None:
        """Start the health watch."""
        self.spawn(self._health_watch(), name="ray-pool-health")

    async def _launch(self, slot: Slot, worker_id: str) -> None:
        handle: Any = ray.remote(RolloutWorker).options(max_restarts=0, **self._options).remote(
            worker_id, self._factory, self.limiter, self._watchdog)
        worker = SlotWorker(worker_id, handle)
        try:
            info = await handle.ready.remote()
            if self.last_update is not None:  # a replacement: the pool's weights first
                await self.last_update.send(worker)
        except BaseException:
            _kill(handle)  # never leave an actor behind that nobody holds
            raise
        worker.pid, worker.alive = info["pid"], True
        slot.worker = worker
        if self.config is None:
            self.config = info["config"]
            self.pad_token_id = info["pad_token_id"]
            self.policy_version = info["policy_version"]
            self.weight_sync = info["weight_sync"]
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        """Mark the fleet closed: nothing is replaced any more, and a retry waiting for a
        live worker gives up now."""
        self.closed = True
        self._changed.set()

    async def stop(self) -> None:
        """Stop the health watch and replacements, the workers and the limiter actor."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        live = [s.worker.handle for s in self.slots if s.worker is not None and s.alive]
        if live:
            await asyncio.wait([asyncio.ensure_future(_await(h.shutdown.remote())) for h in live],
                               timeout=15)
        await self._kill_all()

    async def _kill_all(self) -> None:
        for slot in self.slots:
            if slot.worker is not None:
                _kill(slot.worker.handle)
                slot.worker.alive = False
                slot.worker.lost = True  # on purpose: nothing to report or replace
        if self.limiter is not None:
            _kill(self.limiter)

    def spawn(self, coro: Any, name: str = "ray-pool") -> asyncio.Task[Any]:
        """A task owned by the fleet (cancelled and awaited by :meth:`stop`)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- health ------------------------------------------------------------------------------

    async def _health_watch(self) -> None:
        """Ask every live worker how it is, every ``health_interval_s``; replace the lost."""
        while not self.closed:
            probes = [asyncio.ensure_future(self.probe(s.worker)) for s in self.slots
                      if s.worker is not None and s.alive]
            try:
                if probes:
                    await asyncio.wait(probes)
            finally:
                for probe in probes:
                    probe.cancel()
            for slot in self.slots:  # a slot whose replacement gave up: try again
                if not slot.alive and slot.replacing is None and not self.closed:
                    slot.replacing = self.spawn(self._replace(slot), name="ray-pool-replace")
            await asyncio.sleep(self._settings.health_interval_s)

    async def probe(self, worker: SlotWorker) -> bool:
        """Ask ``worker`` how it is (bounded by ``health_probe_s``); mark it lost if it is
        dead, broken, or silent for ``health_timeout_s``.

        Returns:
            Whether it is alive after all (a silent one counts as alive until its timeout).
        """
        if worker.lost:
            return False
        try:
            problem = await asyncio.wait_for(_await(worker.handle.health.remote()),
                                             self._settings.health_probe_s)
        except TimeoutError:
            now = time.monotonic()
            if worker.unanswered_since is None:
                worker.unanswered_since = now
            silent = now - worker.unanswered_since
            _logger.warning("ray_worker_silent", worker=worker.worker_id, silent_s=round(silent, 1))
            if silent >= self._settings.health_timeout_s:
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

    def worker_lost(self, worker: SlotWorker, exc: BaseException) -> None:
        """Mark ``worker`` dead (once), withdraw its leases, kill it, start a replacement."""
        if worker.lost:
            return
        worker.lost = True
        worker.alive = False
        _logger.error("ray_worker_lost", worker=worker.worker_id, pid=worker.pid,
                      error=describe(exc, first_line=True, limit=300))
        if self.limiter is not None:
            self.limiter.release.remote(worker.worker_id)
        _kill(worker.handle)
        for slot in self.slots:
            if slot.worker is worker and slot.replacing is None and not self.closed:
                slot.replacing = self.spawn(self._replace(slot), name="ray-pool-replace")

    async def _replace(self, slot: Slot) -> None:
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

    # -- choosing workers --------------------------------------------------------------------

    def targets(self) -> list[SlotWorker]:
        """The live workers a new batch is sharded over (every started one if none is live:
        then every call fails and its retries wait for a replacement)."""
        live = [s.worker for s in self.slots if s.worker is not None and s.alive]
        if not live:
            live = [s.worker for s in self.slots if s.worker is not None]
        return live

    async def live_worker(self, exclude: set[str]) -> SlotWorker | None:
        """The least loaded live worker not in ``exclude``; waits for a replacement when
        there is none, up to ``replace_timeout_s`` (None: none came, or the fleet closed)."""
        deadline = time.monotonic() + self._settings.replace_timeout_s
        while True:
            if self.closed:
                return None
            live = [s.worker for s in self.slots if s.worker is not None and s.alive
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
        """A new id for a worker call (the worker aborts a call by its id)."""
        return f"{uuid.uuid4().hex[:8]}-{next(self._calls)}"


async def _await(ref: Any) -> Any:
    return await ref


def _kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception as exc:  # already gone
        _logger.debug("ray_kill_failed", error=str(exc))
