"""The in-process vLLM engine's core noticed dead or hung, and the engine replaced.

A part of :class:`~pipeline.engines.vllm.VLLMEngine` (its base class, over the weights part),
apart because the two callables its :class:`~pipeline.engines._vllm_restart.CoreWatch` is
given are their own concern: why the core is dead (a hung one is killed here first) and how
a new engine takes the dead one's place with the current weights.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from pipeline.engines._vllm_compat import Features
from pipeline.engines._vllm_restart import StepClock, core_dead, kill_core, shut_down, why_dead
from pipeline.engines._vllm_stats import SchedulerReadings
from pipeline.engines._vllm_weights import VLLMWeights

_logger = structlog.get_logger("pipeline.engines.vllm")


class VLLMCore(VLLMWeights):
    """The core's watch callables of :class:`~pipeline.engines.vllm.VLLMEngine` (see its
    class doc, "Restart")."""

    name: str
    step_clock: StepClock
    _launch: Callable[[], Awaitable[Any]] | None
    _readings: SchedulerReadings | None

    def _why_dead(self) -> str | None:
        """Why the engine core is dead, or None while it lives (the watch asks); a hung one
        (see ``stall_s``) is killed here, so that vLLM tears it down as any dead core."""
        if core_dead(self.llm):
            return why_dead(self.llm)
        if self._readings is None:
            return None
        busy = bool(self._versions) and not self._paused
        waited = self.step_clock.stalled(self._readings.steps, busy, time.monotonic())
        if waited is None:
            return None
        pids = kill_core(self.llm)
        return (f"hung: no engine step for {waited:.1f} s with {len(self._versions)} "
                f"request(s) in flight (stall_s={self.step_clock.stall_s}); killed pid(s) {pids}")

    async def _replace(self) -> None:
        """The watch's restart: shut the dead engine down, start a new one with the same
        arguments, load the current weights into it and check its version."""
        assert self._launch is not None
        old = self.llm
        began = time.monotonic()
        await shut_down(old)  # its engine core is gone; this reaps it and frees the rest
        shut = time.monotonic()
        llm = await self._launch()
        started = time.monotonic()
        try:
            await self._restore(llm)
        except BaseException:
            await shut_down(llm)
            raise
        self.llm, self.features = llm, Features.detect(llm)
        del old
        gc.collect()
        _logger.info("vllm_engine_replaced", engine=self.name,
                     shutdown_s=round(shut - began, 3), start_s=round(started - shut, 3),
                     restore_s=round(time.monotonic() - started, 3))
