"""Time slices of the event loop for samples whose stages never wait.

A stage that does its work without awaiting anything real (a regex judge, a reward function,
a state fill) runs a whole sample in one go; a freed concurrency slot is taken by the next
sample in the same loop iteration, so a 4,000-sample judging batch ran in one iteration and
held the loop for 200 ms, starving timers, heartbeats, the proxy's HTTP handlers and the
watchdog. :func:`run_stage <pipeline.stages._base.run_stage>` asks :meth:`LoopSlice.spent`
before each stage and yields to the loop once the current iteration has run longer than
:data:`SLICE_S`; every sample that reaches a stage later in that iteration yields too, so the
iteration ends and the loop's timers run.

The first check of an iteration starts its clock and schedules a marker with ``call_soon``;
the marker runs early in the next iteration and lets the next check start a new clock. That
costs one loop callback per iteration that runs any stage, and one ``monotonic()`` per stage.
"""

from __future__ import annotations

import asyncio
import time
import weakref

SLICE_S = 0.005
"""How long one loop iteration may run stages before samples start yielding (seconds)."""


class LoopSlice:
    """The slice clock of one event loop (shared by every pipeline running on it)."""

    __slots__ = ("__weakref__", "_loop", "_marked", "_started")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._marked = False
        self._started = 0.0

    def spent(self) -> bool:
        """Whether this loop iteration has run stages for longer than :data:`SLICE_S`."""
        now = time.monotonic()
        if not self._marked:
            self._marked = True
            self._started = now
            self._loop.call_soon(self._next_iteration)
            return False
        return now - self._started > SLICE_S

    def _next_iteration(self) -> None:
        self._marked = False


_SLICES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSlice] = (
    weakref.WeakKeyDictionary())


def loop_slice(loop: asyncio.AbstractEventLoop) -> LoopSlice:
    """The slice clock of ``loop``."""
    found = _SLICES.get(loop)
    if found is None:
        found = _SLICES[loop] = LoopSlice(loop)
    return found
