"""A rollout worker: a Ray actor that runs its own ``Pipeline`` on its own event loop.

The pipeline's loop runs in a thread of its own (uvloop, a watchdog, the task dumper's socket),
apart from the loop Ray serves the actor's calls on. So a worker whose pipeline loop is blocked
still answers: ``snapshot`` is served by Ray's loop and reads the blocked loop from outside,
with the watchdog's lag.

Samples go back to the driver as a Ray streaming generator of chunks (all that finished since
the driver last read), so 20,000 samples cost far fewer than 20,000 messages under load.

Whatever a batch raises, the worker stays usable, and every item of a batch comes back:

- A ``BaseException`` that leaves asyncio's loop (``SystemExit`` or ``KeyboardInterrupt``
  from a task nobody owns, or from a callback: asyncio re-raises those two out of
  ``run_until_complete``) is logged and the loop goes on; its tasks are intact. More than
  :data:`MAX_ESCAPES` within :data:`ESCAPE_WINDOW_S` seconds, and the worker gives up.
- A sample whose task raised past the sample runner ends ``failed`` on its own; the rest of
  its batch goes on. Anything else the batch runner raises ends the batch's remaining
  samples ``failed`` with that cause.
- Each ``(sample, item)`` is pickled here, one by one: a sample that cannot be (an
  unpicklable artifact) ends ``failed`` naming the artifacts and the cause, its artifacts
  replaced by a note; the driver unpickles each on its own, so one it cannot rebuild fails
  alone too.
- A worker whose pipeline loop has ended (shut down, or given up) is *broken*: ``health``
  says why, and ``run_items`` raises :class:`WorkerBroken` for the items it could not run,
  so the pool replaces it and runs them elsewhere.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from pipeline._data.models import AgentRolloutItem, RolloutSample, Status
from pipeline._exceptions import PipelineError
from pipeline._gc import gc_tuning_enabled, rollout_gc
from pipeline._runner.group_runner import WEIGHT_SYNC_HOOKS, update_paused
from pipeline._runner.outcome import force_end
from pipeline._runner.pipeline import Pipeline
from pipeline._runner.producer import Producer, SampleRun
from pipeline.diagnostics import (
    Watchdog,
    capture_snapshot,
    diagnosed_loop,
    render_json,
    render_text,
)
from pipeline.distributed._leases import FleetLimiterRegistry
from pipeline.distributed._packing import Chunk, failed_sample, pack

_logger = structlog.get_logger("pipeline.distributed")

_END = object()

MAX_ESCAPES = 100
"""Exceptions that may leave the worker's loop within :data:`ESCAPE_WINDOW_S` before it gives
up (a callback re-raising ``SystemExit`` in a tight loop would otherwise spin forever)."""
ESCAPE_WINDOW_S = 10.0

class WorkerBroken(PipelineError):
    """A rollout worker cannot run samples any more (its pipeline loop has ended)."""


class RolloutWorker:
    """One worker of a :class:`~pipeline.distributed.RayRolloutPool` (a Ray actor).

    Args:
        worker_id: its name in logs, dumps and failure messages.
        factory: builds the worker's ``Pipeline`` (sync or async), called on its loop.
        limiter: the fleet's limiter actor, or None to keep the pipeline's own limiters.
        watchdog: the worker loop's watchdog (True: the defaults; False: none).
    """

    def __init__(self, worker_id: str, factory: Callable[[], Any], limiter: Any,
                 watchdog: Watchdog | bool = True) -> None:
        self.worker_id = worker_id
        self._watchdog = Watchdog(1.0, stall_after_s=300.0) if watchdog is True else (
            watchdog or None)
        self._started: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._pipeline: Pipeline | None = None
        self._batches: dict[str, Producer] = {}
        self._aborted: collections.deque[str] = collections.deque(maxlen=1024)
        """Aborts that came before their batch had started (a bounded memory of them)."""
        self._broken: str | None = None
        self.escapes = 0
        """Exceptions that left the pipeline loop and were contained."""
        self._thread = threading.Thread(target=self._run_loop, args=(factory, limiter),
                                        name=f"rollout-worker-{worker_id}", daemon=True)
        self._thread.start()

    # -- the worker's own loop ---------------------------------------------------------------

    def _run_loop(self, factory: Callable[[], Any], limiter: Any) -> None:
        why = "its event loop ended"
        try:
            with rollout_gc(gc_tuning_enabled(None)), \
                    asyncio.Runner(loop_factory=_loop_factory()) as runner:
                loop = runner.get_loop()
                with diagnosed_loop(loop, self._watchdog):
                    self._drive(loop, loop.create_task(self._main(factory, limiter),
                                                       name=f"rollout-worker:{self.worker_id}"))
        except BaseException as exc:
            why = f"its event loop ended: {type(exc).__name__}: {exc}"
            if not self._started.done():
                self._started.set_exception(exc)
            _logger.error("worker_loop_ended", worker=self.worker_id,
                          error=f"{type(exc).__name__}: {exc}")
        finally:
            if self._broken is None:
                self._broken = why
            if not self._started.done():
                self._started.set_exception(WorkerBroken(f"worker {self.worker_id}: {why}"))

    def _drive(self, loop: asyncio.AbstractEventLoop, main: asyncio.Task[None]) -> None:
        """Run ``main`` to its end; an exception that leaves the loop from anywhere else
        (asyncio lets ``SystemExit``/``KeyboardInterrupt`` out of any task or callback) is
        logged and the loop resumed, its other tasks untouched."""
        escapes: collections.deque[float] = collections.deque()
        while True:
            try:
                loop.run_until_complete(main)
                return
            except BaseException as exc:
                if main.done():
                    raise
                now = time.monotonic()
                escapes.append(now)
                while escapes[0] < now - ESCAPE_WINDOW_S:
                    escapes.popleft()
                self.escapes += 1
                _logger.error("worker_loop_exception_contained", worker=self.worker_id,
                              error=f"{type(exc).__name__}: {exc}", escapes=self.escapes)
                if len(escapes) > MAX_ESCAPES:
                    self._broken = (f"{len(escapes)} exceptions left its event loop within "
                                    f"{ESCAPE_WINDOW_S:g}s (last: {type(exc).__name__}: {exc})")
                    main.cancel()
                    with contextlib.suppress(BaseException):
                        loop.run_until_complete(main)
                    raise WorkerBroken(self._broken) from exc

    async def _main(self, factory: Callable[[], Any], limiter: Any) -> None:
        structlog.contextvars.bind_contextvars(worker=self.worker_id)
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._watchdog is not None:
            self._watchdog.start()
        try:
            try:
                pipeline = factory()
                if inspect.isawaitable(pipeline):
                    pipeline = await pipeline
                if not isinstance(pipeline, Pipeline):
                    raise TypeError(f"the pipeline factory returned {type(pipeline).__name__},"
                                    " not a Pipeline")
                if limiter is not None:
                    pipeline.resources.limiters = FleetLimiterRegistry(limiter, self.worker_id)
            except BaseException as exc:
                self._started.set_exception(exc)
                return
            self._pipeline = pipeline
            engine = pipeline.resources.engine
            self._started.set_result({
                "worker": self.worker_id, "pid": os.getpid(), "config": pipeline.config,
                "pad_token_id": pipeline.pad_token_id,
                "policy_version": int(getattr(engine, "policy_version", None) or 0),
                "weight_sync": all(callable(getattr(engine, hook, None))
                                   for hook in WEIGHT_SYNC_HOOKS)})
            _logger.info("worker_started", pid=os.getpid())
            try:
                await self._stop.wait()
            finally:
                await pipeline.resources.limiters.aclose()
        finally:
            if self._watchdog is not None:
                self._watchdog.stop()

    async def _run_batch(self, batch_id: str, items: list[AgentRolloutItem],
                         emit: Callable[[Any], None]) -> None:
        """Run ``items``, emitting each ``(sample, item)`` once; whatever is raised here
        (other than this batch's own cancellation) ends the unsent ones ``failed``."""
        pipeline = self._pipeline
        assert pipeline is not None
        sent: set[str] = set()

        def send(sample: RolloutSample, item: AgentRolloutItem) -> None:
            if item.uid not in sent:
                sent.add(item.uid)
                emit((sample, item))

        error: BaseException | None = None
        try:
            producer = pipeline.producer(None, None)
            self._batches[batch_id] = producer
            async with pipeline.batch_scope(len(items)):
                producer.start(items)
                if batch_id in self._aborted:
                    producer.batch.abort_rest()
                try:
                    while producer.unfinished:
                        try:
                            run = await producer.next_finished()
                        except asyncio.CancelledError:
                            raise
                        except BaseException as exc:  # a sample raised past the runner
                            escaped = _escaped(producer, sent)
                            if not escaped:
                                raise
                            _logger.error("worker_sample_escaped", samples=len(escaped),
                                          error=f"{type(exc).__name__}: {exc}")
                            for bad in escaped:
                                send(pipeline.sample_of(bad), bad.item)
                            continue
                        send(pipeline.sample_of(run), run.item)
                finally:
                    if producer.unfinished:
                        await producer.cancel()
        except asyncio.CancelledError:
            raise  # the driver went away, or the loop is ending: run_items says what is lost
        except BaseException as exc:
            error = exc
            _logger.error("worker_batch_failed", batch=batch_id,
                          error=f"{type(exc).__name__}: {exc}")
        finally:
            self._batches.pop(batch_id, None)
            if error is not None:
                why = (f"worker {self.worker_id}'s batch runner raised "
                       f"{type(error).__name__}: {error}")
                for item in items:
                    if item.uid not in sent:
                        force_end(item, Status.FAILED, why)
                        send(failed_sample(pipeline, item, why), item)
            emit(_END)

    # -- the actor's methods (on Ray's loop) -------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        """Wait until the pipeline is built: ``{"worker", "pid", "config", "pad_token_id"}``.

        Raises:
            Whatever the factory raised; :class:`WorkerBroken` if the loop ended first.
        """
        return await asyncio.wrap_future(self._started)

    async def health(self) -> str | None:
        """None while this worker can run batches (or is still starting); else why not."""
        if self._broken is not None:
            return self._broken
        if not self._thread.is_alive():
            return "its event loop thread has ended"
        return None

    async def run_items(self, batch_id: str, items: list[AgentRolloutItem]
                        ) -> AsyncIterator[Chunk]:
        """Run ``items`` (called with ``num_returns="streaming"``); yields chunks of packed
        ``(uid, payload, error)`` entries as samples finish, every item exactly once.

        Raises:
            WorkerBroken: the pipeline loop has ended (before or during the batch); the
                items not yielded did not run to their end here.
        """
        await self.ready()
        loop = self._loop
        if self._broken is not None or loop is None:
            raise WorkerBroken(f"worker {self.worker_id} cannot run samples: {self._broken}")
        pipeline = self._pipeline
        assert pipeline is not None  # built before ready() returned
        here = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def emit(entry: Any) -> None:
            here.call_soon_threadsafe(queue.put_nowait, entry)

        try:
            future = asyncio.run_coroutine_threadsafe(self._run_batch(batch_id, items, emit),
                                                      loop)
        except RuntimeError as exc:  # the loop closed meanwhile
            raise WorkerBroken(f"worker {self.worker_id} cannot run samples: {exc}") from None
        watch = here.create_task(_ended(future, queue))  # wakes us if the loop dies mid-batch
        sent = 0
        try:
            done = False
            while not done:
                chunk: Chunk = []
                entry = await queue.get()
                while True:
                    if entry is _END:
                        done = True
                        break
                    chunk.append(pack(self.worker_id, pipeline, *entry))
                    if queue.empty():
                        break
                    entry = queue.get_nowait()
                if chunk:
                    sent += len(chunk)
                    yield chunk
        finally:
            watch.cancel()
            if not future.done():
                future.cancel()
        if sent < len(items):
            why = self._broken or "its batch ended before every sample came back"
            raise WorkerBroken(f"worker {self.worker_id} returned {sent} of {len(items)} "
                               f"samples: {why}")

    async def abort(self, batch_id: str) -> None:
        """Abort what still runs of a batch (over-sampling had enough): those samples end
        ``aborted`` and are still streamed back."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing runs there
                loop.call_soon_threadsafe(self._abort, batch_id)

    def _abort(self, batch_id: str) -> None:
        producer = self._batches.get(batch_id)
        if producer is not None:
            producer.batch.abort_rest()
        else:  # its run_items has not started it yet
            self._aborted.append(batch_id)

    async def update_weights(self, mode: str, state: list[Any] | None, path: str | None,
                             version: int | None, load: Callable[[Any], Any] | None
                             ) -> dict[str, Any]:
        """Pause this worker's engine (``mode``), load new weights, resume it however the
        load ends (the batches it runs go on across the update).

        Args:
            mode: the engine's pause mode (``"keep"``: requests in flight go on afterwards).
            state: ``[ref]`` of a state dict in Ray's object store, fetched here before the
                pause (so the pause covers the load only), or None.
            path: a checkpoint path for ``engine.update_weights``.
            version: the version to set (the same on every worker).
            load: called with the engine while it is paused instead of
                ``engine.update_weights`` (may be async); returns the new version or None.

        Returns:
            ``{"worker", "version", "stall_s"}``: the new version and the seconds paused.
        """
        await self.ready()
        loop, pipeline = self._loop, self._pipeline
        if self._broken is not None or loop is None or pipeline is None:
            raise WorkerBroken(f"worker {self.worker_id} cannot update weights: {self._broken}")
        state_dict = await state[0] if state else None
        engine = pipeline.resources.engine

        async def by_load() -> int | None:
            assert load is not None
            loaded = load(engine)
            new: int | None = await loaded if inspect.isawaitable(loaded) else loaded
            return new

        update = update_paused(engine, mode, state_dict, path, version,
                               by_load if load is not None else None)
        try:
            future = asyncio.run_coroutine_threadsafe(update, loop)
        except RuntimeError as exc:  # the loop closed meanwhile
            update.close()
            raise WorkerBroken(f"worker {self.worker_id} cannot update weights: {exc}") from None
        new, stall = await asyncio.wrap_future(future)
        _logger.info("worker_weights_updated", version=new, stall_s=round(stall, 4))
        return {"worker": self.worker_id, "version": new, "stall_s": stall}

    async def snapshot(self, reason: str) -> dict[str, Any]:
        """This worker's diagnostics snapshot, rendered: served even while the pipeline's
        loop is blocked."""
        lags = self._watchdog.lags() if self._watchdog is not None else None
        loops = [self._loop] if self._loop is not None else []
        snap = await asyncio.to_thread(capture_snapshot, reason=reason, loops=loops, lags=lags)
        return {"worker": self.worker_id, "pid": os.getpid(),
                "text": render_text(snap), "data": json.loads(render_json(snap))}

    async def shutdown(self) -> None:
        """Stop the worker's loop (its limiters closed) and wait for it; the worker is
        broken from here on (``health`` says so)."""
        if self._broken is None:
            self._broken = "it was shut down"
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stop.set)
        await asyncio.to_thread(self._thread.join, 10.0)


async def _ended(future: concurrent.futures.Future[None], queue: asyncio.Queue[Any]) -> None:
    """Put the end marker on ``queue`` once ``future`` is done, however it ended (a batch
    cancelled by its loop closing never emits one itself)."""
    with contextlib.suppress(BaseException):
        await asyncio.wrap_future(future)
    queue.put_nowait(_END)


def _escaped(producer: Producer, sent: set[str]) -> list[SampleRun]:
    """The runs not sent yet whose task ended by a ``BaseException`` that is not an
    ``Exception`` (a sample runner that let one through raises it from ``next_finished``)."""
    found = []
    for run in producer.batch.runs:
        task = run.task
        if (run.item.uid in sent or task is None or not task.done() or task.cancelled()):
            continue
        if not isinstance(task.exception(), Exception | None):
            found.append(run)
    return found


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory
