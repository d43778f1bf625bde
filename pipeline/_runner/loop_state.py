"""What a pipeline's samples on one event loop share, looked up once per loop and not per
sample: concurrency slots, deadline windows and the loop's slice clock."""

from __future__ import annotations

import asyncio

from pipeline._concurrency.cancel import stage_grace
from pipeline._concurrency.slots import FifoSlots
from pipeline._data.config import PipelineConfig
from pipeline._runner.deadline import DeadlineWheel
from pipeline._runner.slice import loop_slice


class LoopState:
    """The slots, deadline windows and slice clock of one pipeline on one loop."""

    __slots__ = ("deadlines", "slice", "slots")

    def __init__(self, loop: asyncio.AbstractEventLoop, config: PipelineConfig) -> None:
        self.slots = FifoSlots(config.max_concurrency)
        self.slice = loop_slice(loop)
        self.deadlines = DeadlineWheel(grace_s=stage_grace(config.cleanup_timeout_s))
