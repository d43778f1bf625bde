"""Flow control of one pipeline on one event loop: how many samples are admitted (fixed, or
following the engine's load) and the circuit breaker that stops admitting after a run of
engine errors.

The adaptive rule (``PipelineConfig.adaptive_concurrency``), applied to each reading of
``engine.load()`` (:class:`~pipeline.engines.EngineLoad`, every ``interval_s``):

- *shrink* by :data:`SHRINK` when the engine thrashes: it preempted more than
  ``preempt_high`` sequences per running one since the last reading (at most once per half a
  turnover, the running mean of a sample's running time: the engine's state changes only as
  admitted samples finish);
- *grow* while the engine has room (its KV cache below ``kv_high``, fewer running sequences
  than its cap) and the limit is in use (no free slot): by :data:`SLOW_START` per turnover
  until the engine is first full, by :data:`GROW` per turnover after that;
- once full, *steer* to a short queue: the limit moves by :data:`GAIN` times the gap
  between ``queue_target`` x running and the engine's waiting queue (both averaged over
  half a turnover) per turnover, so it settles where the engine is just full, without a
  sawtooth.

A sample waiting on a tool holds no KV and no engine slot, so the signals do not count it:
with tool waits the limit grows until the engine, not the number of samples, is the
bottleneck. An engine without ``load()``, or whose load has neither KV use nor a running
cap (the simulated engine's latency model, a server without metrics), keeps the fixed
``max_concurrency``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import structlog

from pipeline._concurrency.cancel import wait_through_cancellation
from pipeline._concurrency.slots import FifoSlots
from pipeline._data.config import AdaptiveConcurrency, PipelineConfig
from pipeline._data.models import AgentRolloutItem
from pipeline._exceptions import EngineCircuitOpen, EngineError

_logger = structlog.get_logger("pipeline")

SLOW_START = 2.0
"""Growth of the limit per turnover until the engine is first full."""
GROW = 1.1
"""Growth of the limit per turnover once it has been (gentle: it stays near the edge)."""
SHRINK = 0.9
"""Factor applied when the engine thrashes (preempts)."""
GAIN = 1.0
"""Share of the gap to the queue target closed per turnover once the engine is full."""
HISTORY = 4096
"""Limit changes the controller remembers (a long run steers every few readings)."""
LAST_ERRORS = 5
"""Errors the circuit breaker keeps to show (the newest)."""


class CircuitBreaker:
    """Counts samples that failed in a row on an engine error; open once there were
    ``limit`` of them (``PipelineConfig.max_consecutive_engine_errors``). A completed sample
    closes the run of errors; other failures (a tool, a judge) neither count nor close it."""

    __slots__ = ("count", "engine", "errors", "limit", "opened")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.count = 0
        self.errors: collections.deque[str] = collections.deque(maxlen=LAST_ERRORS)
        self.engine = "the engine"
        self.opened = False

    def reset(self) -> None:
        """Close the breaker (a new batch tries the engine again)."""
        self.count, self.opened = 0, False
        self.errors.clear()

    def completed(self) -> None:
        """A sample completed: the engine answers."""
        if not self.opened:
            self.count = 0

    def failed(self, item: AgentRolloutItem, exc: BaseException, engine: object) -> None:
        """A sample failed with ``exc``; counted when an :class:`EngineError` caused it."""
        if self.limit is None or self.opened:
            return
        error = engine_error_in(exc)
        if error is None:
            return
        self.count += 1
        self.errors.append(f"{item.uid}: {error}")
        url = getattr(error, "url", None)
        self.engine = type(engine).__name__ + (f" at {url}" if isinstance(url, str) else "")
        if self.count >= self.limit:
            self.opened = True
            _logger.error("circuit_breaker_open", engine=self.engine, errors=self.count,
                          last_errors=list(self.errors))

    def error(self, result: object = None) -> EngineCircuitOpen:
        """The breaker's error, for the samples it refused and for ``run_batch``."""
        return EngineCircuitOpen(self.engine, self.count, list(self.errors), result)


def engine_error_in(exc: BaseException) -> EngineError | None:
    """The :class:`EngineError` that ``exc`` is or was raised from (a bounded walk of its
    causes), or None."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, EngineError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def read_load(engine: object) -> Any:
    """``engine.load()`` (awaited when it is a coroutine: servers read ``/metrics``), or None
    when the engine has no such method or it failed."""
    load = getattr(engine, "load", None)
    if not callable(load):
        return None
    try:
        value = load()
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:  # a metrics scrape that failed is no signal, never an error
        _logger.debug("engine_load_failed", error=repr(exc))
        return None
    return value


class ConcurrencyController:
    """The adaptive limit of one pipeline's slots (the module doc has the rule).

    Attributes:
        limit: the limit now (the slots' size).
        decision: what the last reading decided: ``grow``, ``steer``, ``shrink``, ``hold``
            or ``fixed`` (the engine gives no load signal; the limit stays
            ``max_concurrency``).
        history: ``(monotonic time, limit)`` at each change, the last :data:`HISTORY` of
            them, for benchmarks and tests.
    """

    def __init__(self, slots: FifoSlots, options: AdaptiveConcurrency, initial: int) -> None:
        self.slots = slots
        self.options = options
        self.limit = float(min(max(initial, options.min_concurrency), options.max_concurrency))
        slots.resize(int(self.limit))
        self.decision = "hold"
        self.kv_usage: float | None = None
        self.waiting = 0
        self.preemptions = 0
        self._preemptions: int | None = None
        self.turnover_s: float | None = None
        self._last_read: float | None = None
        self._last_shrink = -math.inf
        self._pushed_back = False
        self._avg: tuple[float, float] | None = None
        self.history: collections.deque[tuple[float, int]] = collections.deque(
            [(time.monotonic(), int(self.limit))], maxlen=HISTORY)

    def sample_ran(self, seconds: float) -> None:
        """A sample ran ``seconds`` (the turnover is their running mean)."""
        if self.turnover_s is None:
            self.turnover_s = seconds
        else:
            self.turnover_s += 0.05 * (seconds - self.turnover_s)

    def update(self, load: Any, now: float) -> None:
        """Apply the rule (module doc) to one reading of the engine's load."""
        dt = 0.0 if self._last_read is None else now - self._last_read
        self._last_read = now
        kv = getattr(load, "kv_usage", None)
        if load is None or (kv is None and getattr(load, "max_running", None) is None):
            self.decision = "fixed"
            return
        self.kv_usage, self.waiting = kv, int(getattr(load, "waiting", 0) or 0)
        running = int(getattr(load, "running", 0) or 0)
        total = getattr(load, "preemptions", None)
        preempted = (0 if total is None or self._preemptions is None
                     else max(0, total - self._preemptions))
        if total is not None:
            self._preemptions = total
            self.preemptions += preempted
        turnover = self.turnover_s or 10 * self.options.interval_s
        options = self.options
        # Averages over about half a turnover: one reading between two scheduler steps (a
        # sequence just finished, its successor not admitted yet) is not a trend.
        weight = 1.0 if self._avg is None else min(1.0, dt / (turnover / 2))
        now_values = (float(self.waiting), float(running))
        self._avg = now_values if self._avg is None else (
            self._avg[0] + weight * (now_values[0] - self._avg[0]),
            self._avg[1] + weight * (now_values[1] - self._avg[1]))
        waiting_avg, running_avg = self._avg
        cap = getattr(load, "max_running", None)
        # Full: no room for one more sequence now, or a queue longer than the target (the
        # head of the queue does not fit the KV left: the engine is backed up all the same).
        full = ((kv is not None and kv >= options.kv_high)
                or (cap is not None and running >= cap)
                or waiting_avg > options.queue_target * max(1.0, running_avg))
        # The share of a turnover since the last reading, at most half: a late reading (a
        # stalled loop) or a short first estimate of the turnover cannot move the limit by
        # more than half a turnover's worth at once.
        step = min(dt / turnover, 0.5)
        if running == 0 and not preempted:
            self.decision = "hold"  # nothing runs yet: a queue now is requests in transit
            return
        if preempted > options.preempt_high * max(1, running):
            if now - self._last_shrink < turnover / 2:
                self.decision = "hold"
                return
            self._last_shrink = now
            self._pushed_back = True
            self.decision = "shrink"
            self._set(self.limit * SHRINK)
        elif full or (self._pushed_back and waiting_avg > 0):
            self._pushed_back = True
            gap = options.queue_target * max(1.0, running_avg) - waiting_avg
            if gap > 0 and self.slots.free > 0:
                self.decision = "hold"  # room to spare already: the demand is the limit
                return
            self.decision = "steer"
            self._set(self.limit + GAIN * gap * step)
        elif self.slots.free <= 0:
            self.decision = "grow"
            self._set(self.limit * (GROW if self._pushed_back else SLOW_START) ** step)
        else:
            self.decision = "hold"

    def _set(self, limit: float) -> None:
        self.limit = min(max(limit, self.options.min_concurrency), self.options.max_concurrency)
        size = int(self.limit)
        if size != self.slots.size:
            self.slots.resize(size)
            self.history.append((time.monotonic(), size))

    def state(self) -> dict[str, Any]:
        """The controller's state as plain data (progress line, dumps)."""
        return {"limit": int(self.limit), "min": self.options.min_concurrency,
                "max": self.options.max_concurrency, "in_use": self.slots.in_use,
                "decision": self.decision,
                "kv_usage": None if self.kv_usage is None else round(self.kv_usage, 3),
                "engine_waiting": self.waiting, "preemptions": self.preemptions}

    def summary(self, since: float) -> dict[str, float]:
        """The limit's mean, min and max since ``since`` (time-weighted), and preemptions."""
        points = [(t, n) for t, n in self.history if t >= since]
        before = [n for t, n in self.history if t < since]
        if before:
            points.insert(0, (since, before[-1]))
        end = time.monotonic()
        spans = [(n, (points[i + 1][0] if i + 1 < len(points) else end) - t)
                 for i, (t, n) in enumerate(points)]
        total = sum(w for _, w in spans)
        mean = (sum(n * w for n, w in spans) / total) if total > 0 else float(self.slots.size)
        values = [n for n, _ in spans] or [self.slots.size]
        return {"limit_mean": mean, "limit_min": float(min(values)),
                "limit_max": float(max(values)), "limit_final": float(self.slots.size),
                "preemptions": float(self.preemptions)}

    async def run(self, engine: object) -> None:
        """Read the engine's load every ``interval_s`` and apply the rule, until cancelled."""
        while True:
            load = await read_load(engine)
            self.update(load, time.monotonic())
            await asyncio.sleep(self.options.interval_s)


class Flow:
    """What admits samples on one loop: the slots, their controller (adaptive
    concurrency, when configured) and the circuit breaker."""

    __slots__ = ("_task", "_users", "breaker", "config", "controller", "slots")

    def __init__(self, config: PipelineConfig, slots: FifoSlots) -> None:
        self.config = config
        self.slots = slots
        self.breaker = CircuitBreaker(config.max_consecutive_engine_errors)
        adaptive = config.adaptive_concurrency
        self.controller = (None if adaptive is None
                           else ConcurrencyController(slots, adaptive, config.max_concurrency))
        self._task: asyncio.Task[None] | None = None
        self._users = 0

    @contextlib.asynccontextmanager
    async def running(self, engine: object) -> AsyncIterator[None]:
        """Run the controller while a batch is in progress (shared by concurrent batches:
        its task is owned here, cancelled and awaited when the last batch leaves)."""
        if self._users == 0:
            self.breaker.reset()  # a new batch tries the engine again
        self._users += 1
        if self.controller is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self.controller.run(engine), name="pipeline-flow-control")
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0 and self._task is not None:
                task, self._task = self._task, None
                task.cancel()
                if await wait_through_cancellation([task]):
                    raise asyncio.CancelledError

    def sample_completed(self, item: AgentRolloutItem) -> None:
        """A sample completed: the breaker's run of errors ends, the controller learns how
        long a sample runs."""
        self.breaker.completed()
        if self.controller is not None and item.started_at is not None:
            self.controller.sample_ran(time.monotonic() - item.started_at)

    def state(self) -> dict[str, Any]:
        """Flow-control state as plain data: the limit and, when adaptive, the controller."""
        out: dict[str, Any] = ({"limit": self.slots.size, "in_use": self.slots.in_use}
                               if self.controller is None else self.controller.state())
        if self.breaker.limit is not None:
            out["breaker"] = {"open": self.breaker.opened, "errors_in_a_row": self.breaker.count,
                              "limit": self.breaker.limit}
        return out
