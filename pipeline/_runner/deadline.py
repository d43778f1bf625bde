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

from pipeline._data.models import Status

if TYPE_CHECKING:
    from pipeline._runner.context import Context
    from pipeline._runner.producer import SampleRun

RESOLUTION_S = 0.005
"""Width of one window of deadlines sharing a loop timer (seconds)."""

Window = dict["Context", "SampleRun"]
"""The samples of one window still running: context -> its run."""


class DeadlineWheel:
    """The deadline windows of one pipeline's samples on one event loop (it holds no
    reference to the loop, so it goes with the loop's entry in the pipeline)."""

    __slots__ = ("_windows", "grace_s")

    def __init__(self, grace_s: float) -> None:
        self._windows: dict[int, Window] = {}
        self.grace_s = grace_s
        """How long stages may run on after their deadline fired before being abandoned."""

    def arm(self, ctx: Context, run: SampleRun) -> Window:
        """Cancel ``run``'s task once ``ctx.deadline`` has passed, setting ``ctx.timed_out``
        first; returns the window to :func:`disarm` it from when the sample's stages end."""
        assert ctx.deadline is not None
        key = int(ctx.deadline // RESOLUTION_S)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = {}
            # The window's end lies past every deadline in it (floor division).
            asyncio.get_running_loop().call_at((key + 1) * RESOLUTION_S, self._fire, key)
        window[ctx] = run
        return window

    def _fire(self, key: int) -> None:
        fired = list(self._windows.pop(key).items())
        for ctx, run in fired:
            ctx.timed_out = True
            if run.task is not None:
                run.task.cancel()
        asyncio.get_running_loop().call_later(self.grace_s, self._give_up, fired)

    def _give_up(self, fired: list[tuple[Context, SampleRun]]) -> None:
        for ctx, run in fired:
            # A stage swallowed the cancellation and went on (a run handed over already,
            # abandoned by its cancelled batch meanwhile, has no owner left to abandon it).
            if run.in_stages and run.owner is not None:
                run.owner.abandon(run, Status.TIMEOUT, (
                    f"sample timed out after {ctx.config.sample_timeout_s}s in stage "
                    f"'{ctx.stage}', which ignored the deadline's cancellation for "
                    f"{self.grace_s}s more (abandoned: it runs on, unawaited, its cleanups "
                    "run when it returns)"))


def disarm(window: Window, ctx: Context) -> None:
    """Withdraw ``ctx``'s deadline (its stages ended); a no-op once the window fired."""
    window.pop(ctx, None)
