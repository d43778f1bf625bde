"""The sample tasks of one ``run_batch`` or stream: owned, handed over as they finish.

Not a TaskGroup: a sample task never raises for a stage's error (its outcome is a status), and
a task group would cancel its owner's task for a child's error and, on Python 3.11, could leave
that cancellation pending on the owner. A ``BaseException`` that is not ours to stop (a stage
raising ``SystemExit``, say) cancels the batch and is raised in a ``BaseExceptionGroup``, as a
task group would.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from pipeline._cancel import wait_through_cancellation
from pipeline._context import Context
from pipeline._exceptions import ConfigError
from pipeline._models import AgentRolloutItem, RolloutSample


class SampleRun:
    """One sample's task and what the runner knows of it."""

    __slots__ = ("abort_requested", "begun", "ctx", "item", "sample", "task")

    def __init__(self, item: AgentRolloutItem) -> None:
        self.item = item
        self.ctx: Context | None = None
        self.task: asyncio.Task[RolloutSample] | None = None
        """The sample's task; dropped (with ``ctx``) once it returned its sample, so a big
        batch does not keep every finished task, coroutine and context alive."""
        self.sample: RolloutSample | None = None
        self.begun = False
        """Whether the task has taken its first step (a task cancelled before it never
        runs its coroutine, so it would never be handed over)."""
        self.abort_requested = False


class Batch:
    """Book-keeping shared by the samples of one call (over-sampling, cancellation)."""

    __slots__ = ("cancelled", "completed", "num_needed", "runs")

    def __init__(self, num_needed: int | None) -> None:
        self.num_needed = num_needed
        self.completed = 0
        self.cancelled = False
        self.runs: list[SampleRun] = []

    def abort_rest(self) -> None:
        """Abort every sample still running or queued (over-sampling had enough); one whose
        task has not been made or has not started yet ends as aborted as soon as it starts."""
        for run in self.runs:
            if run.abort_requested or run.item.status is not None:
                continue
            if not run.begun:  # its task, once made, sees the flag when it starts
                run.abort_requested = True
            elif run.task is not None and not run.task.done():
                run.abort_requested = True
                if run.ctx is not None:
                    run.ctx.abort_requested = True
                run.task.cancel()


RunSample = Callable[[SampleRun, Batch], Coroutine[Any, Any, RolloutSample]]

SampleCallback = Callable[[AgentRolloutItem, RolloutSample], None]
"""Called with ``(item, sample)`` as each sample ends (``run_batch(on_sample_done=...)``)."""


def check_callback(on_sample_done: object) -> None:
    """Refuse a sample callback that cannot be called, before any sample starts."""
    if on_sample_done is not None and not callable(on_sample_done):
        raise ConfigError(f"field 'on_sample_done': must be callable (item, sample) -> None, "
                          f"got {on_sample_done!r:.60}", field="on_sample_done")


START_CHUNK = 256
"""Sample tasks a producer makes per event-loop iteration. A 10,000-sample batch then starts
over 40 iterations instead of making 10,000 tasks in one go: the loop's timers run in
between, and samples that only queue for a concurrency slot do not yet hold a task, its
coroutines and a waiter each (objects the collector would walk)."""


class Producer:
    """Starts sample tasks and hands each back once it has finished, in finishing order."""

    def __init__(self, run_sample: RunSample, num_needed: int | None) -> None:
        self.run_sample = run_sample
        self.batch = Batch(num_needed)
        self.unfinished = 0
        self._finished: asyncio.Queue[SampleRun] = asyncio.Queue()
        self._running = 0
        self._all_done: asyncio.Future[None] | None = None
        self._unstarted: collections.deque[SampleRun] = collections.deque()

    def start(self, items: Iterable[AgentRolloutItem]) -> list[SampleRun]:
        """Start one task per item (the first :data:`START_CHUNK` now, the rest in later
        loop iterations); they run until done, aborted, or :meth:`cancel`."""
        runs = [SampleRun(item) for item in items]
        self.batch.runs.extend(runs)
        self.unfinished += len(runs)
        self._running += len(runs)
        idle = not self._unstarted
        self._unstarted.extend(runs)
        if idle:
            self._start_chunk()
        return runs

    def _start_chunk(self) -> None:
        loop = asyncio.get_running_loop()
        unstarted = self._unstarted
        for _ in range(min(START_CHUNK, len(unstarted))):
            run = unstarted.popleft()
            run.task = loop.create_task(self._run(run), name=f"sample:{run.item.uid}")
        if unstarted:
            loop.call_soon(self._start_chunk)

    async def _run(self, run: SampleRun) -> RolloutSample:
        # Handed over from the task's last step (no done-callback, one loop handle less per
        # sample): the task is done by the time the consumer wakes up to look at it.
        fatal = False
        run.begun = True
        try:
            sample = await self.run_sample(run, self.batch)
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException:
            fatal = True
            raise
        else:
            run.sample = sample
            run.task = run.ctx = None
            return sample
        finally:
            self._finished.put_nowait(run)
            self._running -= 1
            waiter = self._all_done
            if waiter is not None and not waiter.done() and (fatal or not self._running):
                waiter.set_result(None)

    async def next_finished(self) -> SampleRun:
        """The next run whose task has ended.

        Raises:
            BaseExceptionGroup: a sample raised a ``BaseException`` that is not ours to stop.
        """
        return await self._checked(await self._finished.get())

    async def _checked(self, run: SampleRun) -> SampleRun:
        self.unfinished -= 1
        task = run.task
        if task is not None:  # it ended without a sample: look at how
            if not task.done():  # only a run that raised past every guard gets here unfinished
                await asyncio.wait((task,))
            if not task.cancelled() and not isinstance(exc := task.exception(), Exception | None):
                raise BaseExceptionGroup("a sample raised a BaseException", [exc])
        return run

    async def wait_all(self) -> None:
        """Wait until every started run has finished, waking once (not once per sample).

        Raises:
            BaseExceptionGroup: as :meth:`next_finished`.
        """
        if self._running:
            self._all_done = asyncio.get_running_loop().create_future()
            try:
                await self._all_done
            finally:
                self._all_done = None
        while self.unfinished and not self._finished.empty():
            await self._checked(self._finished.get_nowait())
        if self.unfinished:  # woken early by a fatal error already handled above, or more runs
            await self.wait_all()

    async def cancel(self) -> None:
        """Cancel every unfinished sample and wait for all of them (cleanups run), even if
        the caller is cancelled meanwhile; re-raises that cancellation afterwards."""
        self.batch.cancelled = True
        never_started = len(self._unstarted)
        self._unstarted.clear()  # the scheduled _start_chunk then finds nothing to start
        self.unfinished -= never_started
        self._running -= never_started
        tasks = [run.task for run in self.batch.runs if run.task is not None]
        for task in tasks:
            task.cancel()
        cancelled = await wait_through_cancellation(tasks)
        for task in tasks:
            if not task.cancelled():
                task.exception()  # retrieved: the cancellation is what the caller sees
        if cancelled:
            raise asyncio.CancelledError
