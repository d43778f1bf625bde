"""The sample tasks of one ``run_batch`` or stream: owned, handed over as they finish.

Not a TaskGroup: a sample task never raises for a stage's error (its outcome is a status), and
a task group would cancel its owner's task for a child's error and, on Python 3.11, could leave
that cancellation pending on the owner. A ``BaseException`` raised in a sample (a tool calling
``sys.exit()``) fails that sample only, on every path: it never cancels the batch, and never
leaves the event loop (asyncio re-raises ``SystemExit`` and ``KeyboardInterrupt`` out of
``run_until_complete``).

A sample whose stages ignore their cancellation (the deadline's, or a cancelled batch's) for
longer than ``grace_s`` is *abandoned*: it is handed over with its status now, and its task is
left to end on its own, owned by :func:`pipeline._concurrency.cancel.abandon` (logged,
cancelled again, its cleanups run whenever its stage returns). Python cannot stop a
coroutine that swallows every cancellation; the batch does not wait for one.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from pipeline._concurrency.callables import check_callable
from pipeline._concurrency.cancel import abandon, wait_through_cancellation
from pipeline._data.models import AgentRolloutItem, RolloutSample, Status
from pipeline._runner.context import Context
from pipeline._runner.slice import loop_slice


class SampleRun:
    """One sample's task and what the runner knows of it."""

    __slots__ = ("abandoned", "abort_requested", "begun", "ctx", "in_stages", "item", "owner",
                 "sample", "task")

    def __init__(self, item: AgentRolloutItem, owner: Producer) -> None:
        self.item = item
        self.owner: Producer | None = owner
        """Dropped once the run was handed over: the producer holds every run (its batch's
        list), so a run that pointed back at it would make each finished sample part of a
        reference cycle the collector has to find."""
        self.ctx: Context | None = None
        self.task: asyncio.Task[RolloutSample] | None = None
        """The sample's task; dropped (with ``ctx``) once it returned its sample, so a big
        batch does not keep every finished task, coroutine and context alive."""
        self.sample: RolloutSample | None = None
        self.begun = False
        """Whether the task has taken its first step (a task cancelled before it never
        runs its coroutine, so it would never be handed over)."""
        self.abort_requested = False
        self.in_stages = False
        """Whether the sample's stages are running (its cleanups not begun yet)."""
        self.abandoned = False
        """Handed over while its stages still ran (they ignored their cancellation)."""


class Batch:
    """Book-keeping shared by the samples of one call (over-sampling, cancellation)."""

    __slots__ = ("cancelled", "completed", "num_needed", "runs")

    def __init__(self, num_needed: int | None) -> None:
        self.num_needed = num_needed
        self.completed = 0
        self.cancelled = False
        self.runs: dict[SampleRun, None] = {}
        """The runs not handed to the consumer yet, in starting order (a dict as an ordered
        set). A run leaves once the consumer took it (:meth:`Producer.next_finished`): the
        batch does not keep what its caller already has, or dropped. A stream, or an
        ``AsyncRollout`` that runs one producer for its whole life, would otherwise keep
        every sample it ever yielded, item included, for the collector to walk."""

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
"""The coroutine of a sample's task (``SampleRunner._run_sample``): it sets ``run.begun``
at its first step, ``run.sample`` (and drops ``run.task``, ``run.ctx``) when it returns, hands
the run to :meth:`Producer.hand_over` from its last step unless it was abandoned, and lets no
``BaseException`` but ``CancelledError`` out (asyncio re-raises ``SystemExit`` and
``KeyboardInterrupt`` out of the loop). The producer adds no frame of its own around it: a
sample in flight holds one coroutine less for the collector to walk."""
GiveUp = Callable[[SampleRun, Batch, Status, str], RolloutSample]
"""Ends an abandoned sample with a status and an error now, returning its sample."""

SampleCallback = Callable[[AgentRolloutItem, RolloutSample], None]
"""Called with ``(item, sample)`` as each sample ends (``run_batch(on_sample_done=...)``).

A plain function, called synchronously by the runner once the sample's status is final (the
rule for every user callable: :mod:`pipeline._concurrency.callables`): an ``async def`` is
refused when the call is made, since nothing would run it (for async work per sample, iterate
``Pipeline.stream``). One that raises, or returns an awaitable (closed, never run), is logged
as ``on_sample_done_failed``; it never changes the sample or costs the batch."""


def check_callback(on_sample_done: object) -> None:
    """Refuse a sample callback that is not a plain callable, before any sample starts.

    Raises:
        ConfigError: not callable, an ``async def`` (or a partial of one, or an object
            whose ``__call__`` is async), or a generator function; ``field="on_sample_done"``.
    """
    if on_sample_done is not None:
        check_callable(on_sample_done, "on_sample_done", "sync",
                       shape="(item, sample) -> None")


START_CHUNK = 128
"""Sample tasks a producer makes per event-loop iteration. A 10,000-sample batch then starts
over 40 iterations instead of making 10,000 tasks in one go: the loop's timers run in
between, and samples that only queue for a concurrency slot do not yet hold a task, its
coroutines and a waiter each (objects the collector would walk). No chunk is started while
the loop is saturated (samples parked by its slice clock, :mod:`pipeline._runner.slice`):
the samples already running finish first, instead of every sample of a large batch being
started, and held in flight, before any can finish."""


class Producer:
    """Starts sample tasks and hands each back once it has finished, in finishing order."""

    def __init__(self, run_sample: RunSample, num_needed: int | None, give_up: GiveUp,
                 grace_s: float, enter: Callable[[], object] | None = None) -> None:
        self.run_sample = run_sample
        self.enter = enter
        """Run once per :meth:`start` in the context its sample tasks start from (to set
        context variables every sample sees), instead of once in each sample's task."""
        self._context: contextvars.Context | None = None
        self.give_up = give_up
        self.grace_s = grace_s
        """How long stages may take to end once cancelled before they are abandoned."""
        self.batch = Batch(num_needed)
        self.unfinished = 0
        self._finished: asyncio.Queue[SampleRun] = asyncio.Queue()
        self._running = 0
        self._all_done: asyncio.Future[None] | None = None
        self._unstarted: collections.deque[SampleRun] = collections.deque()

    def start(self, items: Iterable[AgentRolloutItem]) -> list[SampleRun]:
        """Start one task per item (the first :data:`START_CHUNK` now, the rest in later
        loop iterations); they run until done, aborted, or :meth:`cancel`."""
        runs = [SampleRun(item, self) for item in items]
        # Each task gets a copy of this context: a copy shares the variables' map, where a
        # variable set inside each task would make a new map (and node) per sample.
        self._context = contextvars.copy_context()
        if self.enter is not None:
            self._context.run(self.enter)
        self.batch.runs.update(dict.fromkeys(runs))
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
        context = self._context
        assert context is not None  # set by start(), which schedules this
        if unstarted:
            clock = loop_slice(loop)
            if clock.saturated:
                clock.when_unsaturated(self._start_chunk)  # the parked samples run first
                return
        for _ in range(min(START_CHUNK, len(unstarted))):
            run = unstarted.popleft()
            run.task = loop.create_task(self.run_sample(run, self.batch),
                                        name=f"sample:{run.item.uid}", context=context.copy())
        if unstarted:
            loop.call_soon(self._start_chunk)

    def hand_over(self, run: SampleRun) -> None:
        """Queue ``run`` for the consumer: its task is ending (called from its last step),
        or it was abandoned."""
        self._finished.put_nowait(run)
        self._running -= 1
        waiter = self._all_done
        if waiter is not None and not waiter.done() and not self._running:
            waiter.set_result(None)

    def abandon(self, run: SampleRun, status: Status, error: str) -> None:
        """Hand ``run`` over now, ended with ``status`` and ``error``, although its stages
        still run (they ignored their cancellation for ``grace_s``); its task is cancelled
        once more and left to :func:`pipeline._concurrency.cancel.abandon`."""
        task = run.task
        if task is None or task.done() or run.abandoned or not run.in_stages:
            return
        run.abandoned = True
        run.sample = self.give_up(run, self.batch, status, error)
        run.task = run.ctx = None
        task.cancel()
        abandon(task, f"sample {run.item.uid}: {error}")
        self.hand_over(run)

    async def next_finished(self) -> SampleRun:
        """The next run whose task has ended (or that was abandoned)."""
        return await self._checked(await self._finished.get())

    async def _checked(self, run: SampleRun) -> SampleRun:
        self.unfinished -= 1
        run.owner = None
        task = run.task
        if task is not None and not task.done():  # handed over from its last step
            await asyncio.wait((task,))
        # Only once it reaches the consumer: a run whose wait was cancelled, or whose
        # task raised past the runner, stays where cancel() and the consumer look for it.
        self.batch.runs.pop(run, None)
        return run

    async def wait_all(self) -> None:
        """Wait until every started run has finished, waking once (not once per sample)."""
        if self._running:
            self._all_done = asyncio.get_running_loop().create_future()
            try:
                await self._all_done
            finally:
                self._all_done = None
        while self.unfinished and not self._finished.empty():
            await self._checked(self._finished.get_nowait())
        if self.unfinished:  # more runs were started meanwhile
            await self.wait_all()

    async def cancel(self) -> None:
        """Cancel every unfinished sample and wait for all of them (cleanups run), even if
        the caller is cancelled meanwhile; re-raises that cancellation afterwards. Samples
        whose stages ignore the cancellation for ``grace_s`` are abandoned, not waited for."""
        self.batch.cancelled = True
        never_started = len(self._unstarted)
        self._unstarted.clear()  # the scheduled _start_chunk then finds nothing to start
        self.unfinished -= never_started
        self._running -= never_started
        tasks = [run.task for run in self.batch.runs if run.task is not None]
        for task in tasks:
            task.cancel()
        cancelled = await wait_through_cancellation(tasks, self.grace_s)
        for run in list(self.batch.runs):  # abandon() calls user callbacks (on_done)
            self.abandon(run, Status.ABORTED, "aborted: the batch was cancelled and a stage "
                         f"ignored its cancellation for {self.grace_s}s (abandoned)")
        rest = [run.task for run in self.batch.runs if run.task is not None]
        if await wait_through_cancellation(rest):  # in their cleanups: each one bounded
            cancelled = True
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the cancellation is what the caller sees
        if cancelled:
            raise asyncio.CancelledError
