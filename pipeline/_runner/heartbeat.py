"""``ProgressHeartbeat``: a progress line in the logs every so often while a batch runs.

A long batch (thousands of samples, minutes to hours) is otherwise silent until it ends. The
heartbeat reads the pipeline's own counters and in-flight view, so it costs nothing per
sample::

    async with ProgressHeartbeat(pipeline, interval_s=30, total=len(rows) * n):
        result = await pipeline.run_batch(rows, n=n)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import structlog

from pipeline._exceptions import ConfigError

if TYPE_CHECKING:
    from pipeline._runner.host import BatchHost, InflightSample

_logger = structlog.get_logger("pipeline")


def stuck_by_stage(inflight: list[InflightSample], threshold_s: float | None) -> dict[str, int]:
    """How many running samples have been in their current stage longer than
    ``threshold_s``, per stage (empty without a threshold)."""
    if threshold_s is None:
        return {}
    return dict(Counter(s.stage or "-" for s in inflight
                        if s.in_stage_s is not None and s.in_stage_s > threshold_s))


class ProgressHeartbeat:
    """Logs ``batch_heartbeat`` every ``interval_s`` while the ``async with`` body runs.

    Each line has ``done`` (samples finished since entering), ``total`` (if given),
    ``running``, ``by_stage`` (running samples per stage), ``oldest_running_s``, ``stuck``
    (samples longer than the config's ``stuck_stage_s`` in their current stage, per stage),
    ``concurrency`` (the pipeline's flow control: limit, admitted, the adaptive controller's
    decision and the engine's KV use, the circuit breaker), ``rate_per_s`` and ``eta_s``.
    The logging task is owned by the context manager: cancelled and awaited on exit.

    Args:
        pipeline: the pipeline to watch.
        interval_s: seconds between lines.
        total: samples the batch will produce (enables ``eta_s``).
        logger: a structlog logger (default: ``pipeline``).

    Raises:
        ConfigError: ``interval_s`` is not positive.
    """

    def __init__(self, pipeline: BatchHost, *, interval_s: float = 30.0,
                 total: int | None = None, logger: Any = None) -> None:
        if not interval_s > 0:
            raise ConfigError(f"ProgressHeartbeat: interval_s must be > 0, got {interval_s!r}")
        self.pipeline = pipeline
        self.interval_s = interval_s
        self.total = total
        self.log = logger if logger is not None else _logger
        self._task: asyncio.Task[None] | None = None
        self._start_done = 0
        self._started = 0.0

    async def __aenter__(self) -> ProgressHeartbeat:
        self._start_done = self.pipeline.samples_done
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._beat(), name="progress-heartbeat")
        return self

    async def __aexit__(self, *exc: object) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                # Leaving with an exception already (a TaskGroup's error, a cancellation):
                # returning lets that one through. Otherwise a pending cancellation of our
                # own task must not be swallowed.
                current = asyncio.current_task()
                if exc[0] is None and current is not None and current.cancelling():
                    raise

    def fields(self) -> dict[str, Any]:
        """The figures of one progress line, now."""
        done = self.pipeline.samples_done - self._start_done
        elapsed = time.monotonic() - self._started
        inflight = self.pipeline.inflight()
        rate = done / elapsed if elapsed > 0 else 0.0
        out: dict[str, Any] = {
            "done": done, "total": self.total, "running": len(inflight),
            "by_stage": dict(Counter(s.stage or "-" for s in inflight).most_common()),
            "oldest_running_s": round(max((s.running_s for s in inflight), default=0.0), 1),
            "stuck": stuck_by_stage(inflight, self.pipeline.config.stuck_stage_s),
            "rate_per_s": round(rate, 2), "elapsed_s": round(elapsed, 1),
        }
        flow = getattr(self.pipeline, "flow_state", None)
        if callable(flow):
            out["concurrency"] = flow()
        if self.total is not None and rate > 0:
            out["eta_s"] = round(max(0, self.total - done) / rate, 1)
        return out

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.log.info("batch_heartbeat", **self.fields())
