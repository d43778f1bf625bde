"""Flow control of one pipeline on one event loop: how many samples are admitted (fixed, or
following the engine's load) and the circuit breaker that stops admitting after a run of
engine errors.

Adaptive concurrency (``PipelineConfig.adaptive_concurrency=AdaptiveConcurrency(...)``; opt-in
until it meets its goal on a real engine too, see :func:`adaptive_options`) follows
``engine.load()`` (:class:`~pipeline.engines.EngineLoad`) where it has a KV-cache use or a
running cap. An engine without ``load()``, or whose load has neither (the simulated engine's
latency model, a server without metrics), keeps the fixed ``max_concurrency``, as does
``adaptive_concurrency=None`` (the default) or ``False``.

The controller's rule is in :mod:`pipeline._runner.adaptive`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import structlog

from pipeline._concurrency.cancel import wait_through_cancellation
from pipeline._concurrency.slots import FifoSlots
from pipeline._data.config import AdaptiveConcurrency, PipelineConfig
from pipeline._data.models import AgentRolloutItem
from pipeline._exceptions import EngineCircuitOpen, EngineError
from pipeline._runner.adaptive import ConcurrencyController

_logger = structlog.get_logger("pipeline")

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


def adaptive_options(config: PipelineConfig) -> AdaptiveConcurrency | None:
    """The adaptive controller's options for ``config``, or None when the limit is fixed:
    ``False``, and for now ``None`` (the default) too. Adaptive becomes the default (None:
    adapt where the engine tells its load) once it meets its goal on a real engine as well.
    On the simulated engine (virtual time, benchmarks/results/flow_control.json) it does on
    every shape: within 5% of the best fixed setting, a swing under 10% over a run's second
    half. But that model charges nothing for samples queued past the engine's capacity, and
    on an H200 with vLLM's server the earlier controllers reached 0.82-0.84 of fixed 256
    (docs/vllm_gpu.md, item 3): the GPU run of this controller decides
    (docs/guides/flow-control.md)."""
    adaptive = config.adaptive_concurrency
    return adaptive if isinstance(adaptive, AdaptiveConcurrency) else None


class Flow:
    """What admits samples on one loop: the slots, their controller (adaptive
    concurrency, unless fixed) and the circuit breaker."""

    __slots__ = ("_task", "_users", "breaker", "config", "controller", "engine", "slots")

    def __init__(self, config: PipelineConfig, slots: FifoSlots) -> None:
        self.config = config
        self.slots = slots
        self.breaker = CircuitBreaker(config.max_consecutive_engine_errors)
        options = adaptive_options(config)
        self.controller = None if options is None else ConcurrencyController(slots, options)
        self.engine: object = None
        self._task: asyncio.Task[None] | None = None
        self._users = 0

    @contextlib.asynccontextmanager
    async def running(self, engine: object) -> AsyncIterator[None]:
        """Run the controller while a batch is in progress (shared by concurrent batches:
        its task is owned here, cancelled and awaited when the last batch leaves)."""
        if self._users == 0:
            self.breaker.reset()  # a new batch tries the engine again
        self._users += 1
        self.engine = engine
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
        """A sample completed: the breaker's run of errors ends, the controller counts it
        (completions per second give its turnover)."""
        self.breaker.completed()
        if self.controller is not None:
            self.controller.sample_done()

    def state(self) -> dict[str, Any]:
        """Flow-control state as plain data: the limit and, when adaptive, the controller;
        the circuit breaker when on; each server's health when the engine watches them."""
        out: dict[str, Any] = ({"limit": self.slots.size, "in_use": self.slots.in_use,
                                "decision": "fixed"}
                               if self.controller is None else self.controller.state())
        if self.breaker.limit is not None:
            out["breaker"] = {"open": self.breaker.opened, "errors_in_a_row": self.breaker.count,
                              "limit": self.breaker.limit}
        servers = server_states(self.engine)
        if servers:
            out["servers"] = servers
        return out


def server_states(engine: object) -> dict[str, dict[str, Any]]:
    """Each server's health, keyed by ``host:port``, when ``engine`` watches its servers
    (``engine.health``, :class:`~pipeline.engines.ServerHealth`): ``state`` (``up``,
    ``down``, ``held out``: back but refused until its weights match, ``re-admitted``: up
    again after being down), ``healthy``, ``downs`` and the last ``error``."""
    health = getattr(engine, "health", None)
    read = getattr(health, "state", None)
    if not callable(read):
        return {}
    try:
        states = read()
    except Exception as exc:  # a view for logs and dumps: never fail the caller
        return {"?": {"state": f"unreadable: {type(exc).__name__}: {exc}"}}
    if not isinstance(states, dict):
        return {}
    out = {}
    for url, s in states.items():
        name = str(url).split("://", 1)[-1].rstrip("/")
        state = ("held out" if s.get("held_out") else "down" if not s.get("healthy")
                 else "re-admitted" if s.get("downs") else "up")
        out[name] = {"state": state, "healthy": bool(s.get("healthy")),
                     "downs": int(s.get("downs") or 0), "error": s.get("error")}
    return out
