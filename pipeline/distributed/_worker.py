"""A rollout worker: a Ray actor that runs its own ``Pipeline`` on its own event loop.

The pipeline's loop runs in a thread of its own under :func:`pipeline.diagnostics.asyncio_run`
(uvloop, a watchdog, the task dumper's socket), apart from the loop Ray serves the actor's
calls on. So a worker whose pipeline loop is blocked still answers: ``snapshot`` is served by
Ray's loop and reads the blocked loop from outside, with the watchdog's lag.

Samples go back to the driver as a Ray streaming generator of chunks (all that finished since
the driver last read), so 20,000 samples cost far fewer than 20,000 messages under load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from pipeline._models import AgentRolloutItem, RolloutSample
from pipeline._pipeline import Pipeline
from pipeline._producer import Producer
from pipeline.diagnostics import Watchdog, asyncio_run, capture_snapshot, render_json, render_text
from pipeline.distributed._limiter import FleetLimiterRegistry

_logger = structlog.get_logger("pipeline.distributed")

_END = object()

Chunk = list[tuple[RolloutSample, AgentRolloutItem]]


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
        self._thread = threading.Thread(target=self._run_loop, args=(factory, limiter),
                                        name=f"rollout-worker-{worker_id}", daemon=True)
        self._thread.start()

    # -- the worker's own loop ---------------------------------------------------------------

    def _run_loop(self, factory: Callable[[], Any], limiter: Any) -> None:
        try:
            asyncio_run(self._main(factory, limiter), watchdog=self._watchdog or False,
                        dump_signal=None)
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            _logger.error("worker_loop_ended", worker=self.worker_id,
                          error=f"{type(exc).__name__}: {exc}")

    async def _main(self, factory: Callable[[], Any], limiter: Any) -> None:
        structlog.contextvars.bind_contextvars(worker=self.worker_id)
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            pipeline = factory()
            if inspect.isawaitable(pipeline):
                pipeline = await pipeline
            if not isinstance(pipeline, Pipeline):
                raise TypeError(f"the pipeline factory returned {type(pipeline).__name__}, "
                                "not a Pipeline")
            if limiter is not None:
                pipeline.resources.limiters = FleetLimiterRegistry(limiter, self.worker_id)
        except BaseException as exc:
            self._started.set_exception(exc)
            return
        self._pipeline = pipeline
        self._started.set_result({"worker": self.worker_id, "pid": os.getpid(),
                                  "config": pipeline.config,
                                  "pad_token_id": pipeline.pad_token_id})
        _logger.info("worker_started", pid=os.getpid())
        try:
            await self._stop.wait()
        finally:
            await pipeline.resources.limiters.aclose()

    async def _run_batch(self, batch_id: str, items: list[AgentRolloutItem],
                         emit: Callable[[Any], None]) -> None:
        pipeline = self._pipeline
        assert pipeline is not None
        producer = pipeline.producer(None, None)
        self._batches[batch_id] = producer
        try:
            async with pipeline.batch_scope(len(items)):
                producer.start(items)
                try:
                    while producer.unfinished:
                        run = await producer.next_finished()
                        emit((pipeline.sample_of(run), run.item))
                finally:
                    if producer.unfinished:
                        await producer.cancel()
        finally:
            self._batches.pop(batch_id, None)
            emit(_END)

    # -- the actor's methods (on Ray's loop) -------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        """Wait until the pipeline is built: ``{"worker", "pid", "config"}``.

        Raises:
            Whatever the factory raised.
        """
        return await asyncio.wrap_future(self._started)

    async def run_items(self, batch_id: str, items: list[AgentRolloutItem]
                        ) -> AsyncIterator[Chunk]:
        """Run ``items`` (called with ``num_returns="streaming"``); yields chunks of
        ``(sample, item)`` as they finish, every item exactly once."""
        await self.ready()
        assert self._loop is not None
        here = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def emit(entry: Any) -> None:
            here.call_soon_threadsafe(queue.put_nowait, entry)

        future = asyncio.run_coroutine_threadsafe(self._run_batch(batch_id, items, emit),
                                                  self._loop)
        try:
            done = False
            while not done:
                chunk: Chunk = []
                entry = await queue.get()
                while True:
                    if entry is _END:
                        done = True
                        break
                    chunk.append(entry)
                    if queue.empty():
                        break
                    entry = queue.get_nowait()
                if chunk:
                    yield chunk
            await asyncio.wrap_future(future)  # its error, if any, is the driver's to see
        finally:
            if not future.done():
                future.cancel()

    async def abort(self, batch_id: str) -> None:
        """Abort what still runs of a batch (over-sampling had enough): those samples end
        ``aborted`` and are still streamed back."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._abort, batch_id)

    def _abort(self, batch_id: str) -> None:
        producer = self._batches.get(batch_id)
        if producer is not None:
            producer.batch.abort_rest()

    async def snapshot(self, reason: str) -> dict[str, Any]:
        """This worker's diagnostics snapshot, rendered: served even while the pipeline's
        loop is blocked."""
        lags = self._watchdog.lags() if self._watchdog is not None else None
        loops = [self._loop] if self._loop is not None else []
        snap = await asyncio.to_thread(capture_snapshot, reason=reason, loops=loops, lags=lags)
        return {"worker": self.worker_id, "pid": os.getpid(),
                "text": render_text(snap), "data": json.loads(render_json(snap))}

    async def shutdown(self) -> None:
        """Stop the worker's loop (its limiters closed) and wait for it."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(stop.set)
        await asyncio.to_thread(self._thread.join, 10.0)

