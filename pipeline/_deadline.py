"""Sample deadlines: one loop timer per short window of deadlines, not one per sample.

``asyncio.timeout_at`` per sample costs a ``Timeout``, a ``TimerHandle`` and a copy of the
task's context (about 5 µs, and three objects the collector walks for every sample in
flight); with 10,000 samples the loop's timer heap also holds 10,000 entries, most of them
cancelled when their samples end early. Here deadlines falling in the same
:data:`RESOLUTION_S` window share one timer; when it fires it cancels the tasks of the
window's samples that are still running, as ``asyncio.timeout`` would (one ``cancel()``
each, which the runner takes back with ``uncancel()`` once it has seen the timeout). A
deadline therefore fires at most :data:`RESOLUTION_S` late, never early.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline._context import Context

RESOLUTION_S = 0.005
"""Width of one window of deadlines sharing a loop timer (seconds)."""

Window = dict["Context", "asyncio.Task[object]"]
"""The samples of one window still running: context -> its task."""


class DeadlineWheel:
    """The deadline windows of one pipeline's samples on one event loop (it holds no
    reference to the loop, so it goes with the loop's entry in the pipeline)."""

    __slots__ = ("_windows",)

    def __init__(self) -> None:
        self._windows: dict[int, Window] = {}

    def arm(self, ctx: Context, task: asyncio.Task[object]) -> Window:
        """Cancel ``task`` once ``ctx.deadline`` has passed, setting ``ctx.timed_out``
        first; returns the window to :func:`disarm` it from when the sample's stages end."""
        assert ctx.deadline is not None
        key = int(ctx.deadline // RESOLUTION_S)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = {}
            # The window's end lies past every deadline in it (floor division).
            asyncio.get_running_loop().call_at((key + 1) * RESOLUTION_S, self._fire, key)
        window[ctx] = task
        return window

    def _fire(self, key: int) -> None:
        for ctx, task in self._windows.pop(key).items():
            ctx.timed_out = True
            task.cancel()


def disarm(window: Window, ctx: Context) -> None:
    """Withdraw ``ctx``'s deadline (its stages ended); a no-op once the window fired."""
    window.pop(ctx, None)
