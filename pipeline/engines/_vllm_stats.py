"""The in-process vLLM engine's load, read from vLLM's own scheduler statistics.

vLLM's V1 engine core sends a ``SchedulerStats`` (running and waiting requests, KV-cache use)
with its outputs, and ``AsyncLLM`` hands it, with the step's ``IterationStats`` (preempted
requests, generated tokens), to every stat logger it was given (``stat_loggers=`` of
``AsyncLLM.from_engine_args``). :class:`SchedulerReadings` is such a logger: it keeps the
latest figures and the cumulative counters, which ``VLLMEngine.load()`` turns into the same
:class:`~pipeline.engines.EngineLoad` an OpenAI server's ``/metrics`` gives
(:mod:`pipeline.engines._health`). The engine core computes the statistics only when asked
(``log_stats``), which the logger does; the counters survive an engine restart (one readings
object outlives the engines it reads).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pipeline.engines._base import EngineLoad


@dataclass
class SchedulerReadings:
    """The newest scheduler figures of one in-process engine, written by vLLM's output
    handler (on the event loop) through :meth:`logger_factory`'s loggers.

    Attributes:
        running: requests running at the last engine step.
        waiting: requests waiting at the last engine step.
        kv_usage: KV-cache use at the last step, 0..1.
        preemptions: requests preempted so far (cumulative, across restarts).
        sampled_tokens: tokens generated so far (cumulative, across restarts).
        steps: statistics received so far.
    """

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    preemptions: int = 0
    sampled_tokens: int = 0
    steps: int = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Take one engine step's statistics (either may be None)."""
        if scheduler_stats is not None:
            self.steps += 1
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_usage = float(scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))
            self.sampled_tokens += int(getattr(iteration_stats, "num_generation_tokens", 0))

    def load(self, *, in_flight: int, max_running: int | None) -> EngineLoad:
        """The readings as an :class:`EngineLoad`; ``in_flight``: requests the engine holds
        now. With none, running and waiting read 0: the engine core sends no statistics
        while idle, so its last figures would still count the requests that just ended."""
        idle = in_flight == 0
        return EngineLoad(running=0 if idle else self.running,
                          waiting=0 if idle else self.waiting,
                          kv_usage=self.kv_usage, preemptions=self.preemptions,
                          sampled_tokens=self.sampled_tokens, max_running=max_running)

    def logger_factory(self) -> Any:
        """A per-engine stat logger factory for ``AsyncLLM(stat_loggers=[...])`` that
        records into this object (vLLM's ``StatLoggerBase`` subclass, built here so that
        importing this module does not import vLLM)."""
        base: Any = importlib.import_module("vllm.v1.metrics.loggers").StatLoggerBase
        readings = self

        class _Logger(base):  # type: ignore[misc]
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats: Any, iteration_stats: Any,
                       mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
                readings.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                """Nothing to log: the readings are read, not printed."""

        return _Logger
