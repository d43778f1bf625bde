"""What a pipeline's samples on one event loop share, looked up once per loop and not per
sample: concurrency slots and their flow control, deadline windows and the loop's slice
clock."""

from __future__ import annotations

import asyncio

from pipeline._concurrency.cancel import stage_grace
from pipeline._concurrency.slots import FifoSlots
from pipeline._data.config import PipelineConfig
from pipeline._runner.deadline import DeadlineWheel
from pipeline._runner.flow import Flow
from pipeline._runner.slice import loop_slice


class LoopState:
    """The slots (and their flow control), deadline windows and slice clock of one pipeline
    on one loop."""

    __slots__ = ("deadlines", "flow", "slice", "slots")

    def __init__(self, loop: asyncio.AbstractEventLoop, config: PipelineConfig) -> None:
        self.slots = FifoSlots(config.max_concurrency)
        self.flow = Flow(config, self.slots)
        self.slice = loop_slice(loop)
        self.deadlines = DeadlineWheel(grace_s=stage_grace(config.cleanup_timeout_s))
