"""One sample's run, from its task's first step to the sample handed to the trainer.

Waiting for a concurrency slot, running the stages under the sample's deadline, the one
place a stage's ending becomes a status (:func:`~pipeline._runner.outcome.settle`), the
cleanups, the trainer view and ``on_sample_done``; and the early end of a sample whose
stages ignore their cancellation. :class:`SampleRunner` is the base of
:class:`~pipeline.Pipeline`, which adds batches, streams and the public surface; it knows
nothing of that class (one dependency direction).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref

import structlog

from pipeline._concurrency.callables import plain_result
from pipeline._concurrency.cancel import EscapedBaseException
from pipeline._data.config import PipelineConfig
from pipeline._data.construct import set_fields
from pipeline._data.models import AgentRolloutItem, RolloutSample, Status
from pipeline._runner.cleanup import cleanup_steps, run_cleanups
from pipeline._runner.context import Context, Resources, Stage
from pipeline._runner.deadline import Window, disarm
from pipeline._runner.fill import SampleBuilder, build_sample, share_turn_lists
from pipeline._runner.loop_state import LoopState
from pipeline._runner.outcome import (
    BATCH_CANCELLED,
    ENOUGH,
    OUTSIDE_CANCEL,
    end,
    force_end,
    settle,
    uncancel,
)
from pipeline._runner.producer import Batch, SampleCallback, SampleRun
from pipeline._runner.stage import (
    must_wait_turn,
    stage_raised,
    stage_returned,
    start_stage,
)

_logger = structlog.get_logger("pipeline")


class SampleRunner:
    """Runs single samples of a stage list to a status (the base of ``Pipeline``, which
    sets every attribute below in its constructor)."""

    stages: list[Stage]
    resources: Resources
    config: PipelineConfig
    fill: SampleBuilder
    samples_done: int
    """Samples finished by this pipeline so far (any status)."""
    last_sample_done: float | None
    """``time.monotonic()`` when the last sample finished (stall detection reads it)."""
    _loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopState]
    _inflight: dict[str, Context]
    _lock: threading.Lock

    @property
    def pad_token_id(self) -> int:
        """Pad id for failure outputs: config, else the tokenizer's pad or eos id, else 0."""
        if self.config.pad_token_id is not None:
            return self.config.pad_token_id
        tok = self.resources.tokenizer
        for candidate in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
            if isinstance(candidate, int):
                return candidate
        return 0

    def _loop_state(self) -> LoopState:
        """The slots, flow control and deadlines of this pipeline on the running loop."""
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            state = self._loops[loop] = LoopState(loop, self.config)
        return state

    def sample_of(self, run: SampleRun) -> RolloutSample:
        """The sample a finished run produced; a task that ended without one (cancelled
        from outside, or raised through every guard) still yields a masked sample."""
        if run.sample is not None:
            return run.sample
        task = run.task
        if task is None:  # its batch was cancelled before its task was made
            force_end(run.item, Status.ABORTED, BATCH_CANCELLED)
            return self._build_sample(run.item, run.ctx)
        if task.done() and not task.cancelled():
            exc = task.exception()
            if exc is None:
                return task.result()
            error = f"the sample's task raised {type(exc).__name__}: {exc}"
        elif task.done() and run.item.status is Status.ABORTED:
            # The runner ended it as aborted, then let its batch's cancellation (a closed
            # stream) end the task: that status stands.
            return self._build_sample(run.item, run.ctx)
        else:
            error = "the sample's task was cancelled from outside the pipeline"
        force_end(run.item, Status.FAILED, error)
        return self._build_sample(run.item, run.ctx)

    async def _run_sample(
        self, run: SampleRun, batch: Batch, on_done: SampleCallback | None
    ) -> RolloutSample:
        """Run one sample to a status and build its trainer view: the coroutine of the
        sample's task (:class:`~pipeline._runner.producer.Producer` makes it). Raises only
        ``CancelledError`` when the batch itself is cancelled; any other ``BaseException``
        that got past every guard (``KeyboardInterrupt``) is raised as
        :class:`~pipeline._concurrency.cancel.EscapedBaseException`, never out of the loop.

        The stages run in this coroutine itself, each awaited directly (the steps of
        :func:`~pipeline._runner.stage.run_stage` written out), and the run is handed to its
        producer from this coroutine's last step (no done-callback: one loop handle less per
        sample): a sample in flight holds this frame and its stage's, not a frame per layer
        in between (the producer's own was one), for the collector to walk."""
        run.begun = True
        try:
            item = run.item
            set_fields(item, {"queued_at": time.monotonic()})
            state = self._loop_state()
            if run.abort_requested:  # over-sampling had enough before this task was made
                force_end(item, Status.ABORTED, ENOUGH)
            else:
                try:
                    if not state.slots.take_now():
                        await state.slots.wait()
                    try:
                        admission = state.slice.admit()
                        if state.slice.spent(item):
                            # The loop has more to run than its slice: the samples already
                            # running go first, and this one's deadline and latency start
                            # once it has its turn (as they start once it has a slot).
                            await state.slice.wait_turn(admission)
                        if state.flow.breaker.opened:  # admitted no more: the batch ends on it
                            force_end(item, Status.FAILED, f"not run: {state.flow.breaker.error()}")
                        else:
                            # Kept here: abandoning the run drops run.task, and the deadline's
                            # cancel must still be taken back from the task when the stages end.
                            task = run.task
                            ctx, window = self._enter_stages(run, state, admission)
                            try:
                                try:
                                    stages = self.stages
                                    # By index: a list iterator held across every await would be
                                    # one more object per sample in flight (a range's is untracked).
                                    loop_slice = state.slice
                                    for i in range(len(stages)):
                                        stage = stages[i]
                                        # The first stage's turn was had (and its deadline
                                        # armed) just before this loop.
                                        if i and must_wait_turn(stage, ctx):
                                            await loop_slice.wait_turn(admission)
                                        record, call = start_stage(stage, item, ctx)
                                        try:
                                            await call
                                            stage_returned(stage, item, ctx)
                                        except BaseException as exc:
                                            stage_raised(record, exc, ctx)
                                            raise
                                        finally:
                                            record.end = time.monotonic()
                                except BaseException as exc:  # SystemExit in a tool: one sample
                                    self._leave_stages(run, ctx, window, task)
                                    if not run.abandoned:
                                        settle(exc, run, batch, ctx.deadline_passed(),
                                               self.config.sample_timeout_s)
                                        if item.status is Status.FAILED:
                                            state.flow.breaker.failed(item, exc,
                                                                      self.resources.engine)
                                else:
                                    self._leave_stages(run, ctx, window, task)
                                    if not run.abandoned:
                                        end(item, Status.COMPLETED, None)
                                        state.flow.sample_completed(item)
                            finally:
                                try:
                                    steps = cleanup_steps(item, ctx)
                                    if steps:
                                        await run_cleanups(steps, item, ctx,
                                                           self.config.cleanup_timeout_s)
                                finally:
                                    set_fields(item, {"ended_at": time.monotonic()})
                                    self._inflight.pop(item.uid, None)
                            if item.status is not Status.COMPLETED and item.status is not None:
                                ctx.log.debug("sample_ended", status=item.status.value,
                                              error=item.error)
                    finally:
                        if not run.abandoned:  # an abandoned run gave its slot back already
                            state.slots.release()
                except asyncio.CancelledError:
                    # Cancelled while queued for a slot (no stage ran yet), or re-raised by settle
                    # because the batch itself was cancelled.
                    if batch.cancelled:
                        if item.status is None:
                            force_end(item, Status.ABORTED, BATCH_CANCELLED)
                        raise
                    uncancel()
                    if item.status is None:
                        force_end(item, Status.ABORTED,
                                   ENOUGH if run.abort_requested else OUTSIDE_CANCEL)
            if run.abandoned and run.sample is not None:  # handed over when it was abandoned
                sample = run.sample
            else:
                sample = self._finish(run, batch, on_done)
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:  # past every guard above: never out of the loop
            raise EscapedBaseException(f"{type(exc).__name__} escaped the sample runner: "
                                       f"{exc}") from exc
        else:
            run.sample = sample
            run.task = run.ctx = None
            return sample
        finally:
            owner = run.owner
            if not run.abandoned and owner is not None:  # an abandoned run was handed over
                owner.hand_over(run)

    def _enter_stages(self, run: SampleRun, state: LoopState,
                      admission: int) -> tuple[Context, Window | None]:
        """The sample's context (``admission``: its number on the loop's slice clock), its
        deadline armed (the window to disarm it from), the sample marked started and in
        flight."""
        item = run.item
        timeout = self.config.sample_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        ctx = run.ctx = Context(self.resources, self.config, item, deadline)
        ctx.abort_requested = run.abort_requested
        ctx.loop_slice = state.slice
        ctx._admission = admission
        set_fields(item, {"started_at": time.monotonic()})
        self._inflight[item.uid] = ctx
        window = None
        if deadline is not None and run.task is not None:
            window = state.deadlines.arm(ctx, run)
        run.in_stages = True
        return ctx, window

    @staticmethod
    def _leave_stages(run: SampleRun, ctx: Context, window: Window | None,
                      task: asyncio.Task[RolloutSample] | None) -> None:
        """The stages ended: the deadline withdrawn, and the deadline's cancel taken back
        from the sample's task once it fired (as ``asyncio.timeout`` does)."""
        run.in_stages = False
        if window is not None:
            disarm(window, ctx)
        if ctx.timed_out and task is not None:
            task.uncancel()

    def _finish(self, run: SampleRun, batch: Batch, on_done: SampleCallback | None,
                still_running: bool = False) -> RolloutSample:
        """Build the ended sample's trainer view, count it, and tell ``on_done``.

        ``still_running``: its stages run on (abandoned); the sample then gets copies of the
        item's lists, which the default builder otherwise shares, so that what those stages
        still write cannot change a sample already handed to the trainer."""
        item = run.item
        sample = self._build_sample(item, run.ctx)
        if still_running:
            sample = sample.model_copy(deep=True)
        else:
            share_turn_lists(item, sample)
        with self._lock:
            self.samples_done += 1
            self.last_sample_done = time.monotonic()
        if item.status is Status.COMPLETED and batch.num_needed is not None:
            batch.completed += 1
            if batch.completed >= batch.num_needed:
                batch.abort_rest()
        if on_done is not None:
            try:
                plain_result(on_done(item, sample), "on_sample_done")
            except BaseException as exc:  # a progress bar or writer must never cost the batch
                _logger.error("on_sample_done_failed", uid=item.uid, error=repr(exc))
        return sample

    def _give_up(self, run: SampleRun, batch: Batch, status: Status, error: str,
                 on_done: SampleCallback | None) -> RolloutSample:
        """End a sample whose stages ignore their cancellation now (the producer abandons
        its task): its slot is freed, its status set, its sample built and handed over."""
        state = self._loops.get(asyncio.get_running_loop())
        if state is not None:
            state.slots.release()
        self._inflight.pop(run.item.uid, None)
        force_end(run.item, status, error)
        return self._finish(run, batch, on_done, still_running=True)

    def _build_sample(self, item: AgentRolloutItem, ctx: Context | None) -> RolloutSample:
        return build_sample(self.fill, item, ctx or Context(self.resources, self.config, item),
                            lambda: self.pad_token_id)
