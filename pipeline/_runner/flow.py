"""Flow control of one pipeline on one event loop: how many samples are admitted (fixed, or
following the engine's load) and the circuit breaker that stops admitting after a run of
engine errors.

The adaptive rule (``PipelineConfig.adaptive_concurrency``), read every ``interval_s`` from
``engine.load()`` (:class:`~pipeline.engines.EngineLoad`):

- *shrink* by :data:`SHRINK` when the engine preempted a sequence since the last read or its
  KV cache is fuller than ``kv_high``; at most once per half a turnover (the running mean of
  a sample's running time), since KV use falls only as admitted samples finish;
- *grow* by :data:`GROW` per turnover (continuously, pro rata) while the limit is in use (no
  free slot), the KV cache is below ``kv_low`` and the engine queues nothing: more samples
  could run, and the engine has room for them;
- *hold* otherwise (the dead band keeps the limit still once the KV cache is in it).

A sample waiting on a tool holds no KV, so the KV signal does not count it: with tool waits
the limit grows until the engine, not the number of samples, is the bottleneck. An engine
without ``load()``, or whose load has neither KV use nor a running cap (the simulated
engine's latency model, a server without metrics), keeps the fixed ``max_concurrency``.
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

GROW = 1.25
"""Growth of the limit per turnover while the engine has room (prime-rl's step)."""
SHRINK = 0.9
"""Factor applied on a preemption or a KV cache above ``kv_high``."""
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
        decision: what the last read decided: ``grow``, ``shrink``, ``hold`` or ``fixed``
            (the engine gives no load signal; the limit stays ``max_concurrency``).
        history: ``(monotonic time, limit)`` at each change, for benchmarks and tests.
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
        self.history: list[tuple[float, int]] = [(time.monotonic(), int(self.limit))]

    def sample_ran(self, seconds: float) -> None:
        """A sample ran ``seconds`` (the turnover is their running mean)."""
        if self.turnover_s is None:
            self.turnover_s = seconds
        else:
            self.turnover_s += 0.05 * (seconds - self.turnover_s)

    def update(self, load: Any, now: float) -> None:
        """Apply the rule to one reading of the engine's load."""
        dt = 0.0 if self._last_read is None else now - self._last_read
        self._last_read = now
        kv = getattr(load, "kv_usage", None)
        if load is None or (kv is None and getattr(load, "max_running", None) is None):
            self.decision = "fixed"
            return
        self.kv_usage, self.waiting = kv, int(getattr(load, "waiting", 0) or 0)
        total = getattr(load, "preemptions", None)
        preempted = (0 if total is None or self._preemptions is None
                     else max(0, total - self._preemptions))
        if total is not None:
            self._preemptions = total
            self.preemptions += preempted
        turnover = self.turnover_s or 10 * self.options.interval_s
        options = self.options
        if preempted or (kv is not None and kv > options.kv_high):
            if now - self._last_shrink < turnover / 2:
                self.decision = "hold"
                return
            self._last_shrink = now
            self.decision = "shrink"
            self._set(self.limit * SHRINK)
        elif (self.slots.free <= 0 and self.waiting == 0
              and (kv is None or kv < options.kv_low)):
            self.decision = "grow"
            self._set(self.limit * GROW ** (dt / turnover))
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
