"""How a sample ends: the status, finish and exit reasons and error, set in one place.

The runner decides *which* ending applies; these helpers write it onto the item without ever
raising, whatever a stage left on the item.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from pipeline import artifacts as A
from pipeline._concurrency.cancel import cancel_requested
from pipeline._data.construct import set_fields
from pipeline._data.models import AgentRolloutItem, ExitReason, FinishReason, Status
from pipeline._exceptions import ContractError, DeadlineExceeded, SampleAborted, StageTimeout

if TYPE_CHECKING:
    from pipeline._runner.producer import Batch, SampleRun

ENOUGH = "aborted: the batch had enough completed samples"
BATCH_CANCELLED = "aborted: run_batch was cancelled"
OUTSIDE_CANCEL = "aborted: the sample's task was cancelled from outside the pipeline"

_FINISH = {
    Status.FAILED: FinishReason.ERROR,
    Status.TIMEOUT: FinishReason.TIMEOUT,
    Status.ABORTED: FinishReason.ABORT,
}
_EXIT = {
    Status.FAILED: ExitReason.ERROR,
    Status.TIMEOUT: ExitReason.TIMEOUT,
    Status.ABORTED: ExitReason.ABORT,
}
_EXIT_TEXT = {status: reason.value for status, reason in _EXIT.items()}
_DONE = ExitReason.DONE.value  # read once: an Enum member's .value is a Python property

ERROR_CHARS = 4000
"""The longest error text kept on a sample or stage record; a longer one (an exception that
carries a whole 5 MB payload, say) keeps its head and tail around a note of what was cut,
so dumps, logs and the trainer's batch stay small while the cause and the innermost frame
of the message stay readable."""


def capped(text: str, limit: int = ERROR_CHARS) -> str:
    """``text`` cut to at most about ``limit`` characters: the first three quarters and the
    last quarter, with the number of characters left out between them."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    return f"{text[:head]} [... {len(text) - head - tail} characters cut ...] {text[-tail:]}"


def end(item: AgentRolloutItem, status: Status, error: str | None) -> None:
    """Record how the sample ended; falls back to :func:`_force_end` when a stage left the
    item in a state this cannot read (wrongly typed artifacts or records)."""
    if error is not None:
        error = capped(error)
    try:
        set_fields(item, {"status": status, "error": error})
        if not isinstance(item.records, list) or not isinstance(item.artifacts, dict):
            raise ContractError("a stage replaced item.records or item.artifacts")
        if status is Status.COMPLETED:
            set_fields(item, {"finish_reason": item.finish_reason or FinishReason.STOP,
                              "exit_reason": item.artifacts.get(A.EXIT_REASON) or _DONE})
        else:
            set_fields(item, {"finish_reason": _FINISH[status],
                              "exit_reason": _EXIT_TEXT[status],
                              "error_stage": failed_stage(item)})
    except Exception as exc:
        force_end(item, Status.FAILED, f"{error or 'ending the sample'}; the item is "
                   f"malformed: {type(exc).__name__}: {exc}")


def force_end(item: AgentRolloutItem, status: Status, error: str,
               exit_reason: ExitReason | None = None) -> None:
    """Set the end fields directly, reading nothing a stage could have broken; fields the
    dump and the trainer view read are reset when a stage replaced them with something else."""
    if not isinstance(item.records, list):
        item.records = []
    if not isinstance(item.artifacts, dict):
        item.artifacts = {}
    item.status = status
    item.finish_reason = _FINISH[status]
    item.exit_reason = (exit_reason or _EXIT[status]).value
    item.error = capped(error)


def failed_stage(item: AgentRolloutItem) -> str | None:
    """The innermost stage that did not complete (records are appended as stages start)."""
    try:
        for record in reversed(item.records):
            if record.phase == "run" and record.status is not Status.COMPLETED:
                return str(record.name)
    except Exception:  # a stage replaced the records with something else
        return None
    return None


def describe(exc: BaseException, item: AgentRolloutItem) -> str:
    return f"stage '{failed_stage(item)}' raised {type(exc).__name__}: {exc}"


def uncancel() -> None:
    """Take back a cancellation the pipeline asked for itself (an abort), keeping the
    task's cancellation count straight."""
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()


def settle(exc: BaseException, run: SampleRun, batch: Batch, deadline_expired: bool,
           timeout_s: float | None) -> None:
    """Turn how the stages ended into a status; re-raise only a cancelled batch.

    The pipeline's own cancellations (a cancelled batch, an over-sampling abort, the
    deadline) are known from its flags and clock, whatever the exception: a stage that
    turns a cancellation into another error (an engine abort that raised) still ends as
    the cancellation it was. Only for a bare ``CancelledError`` is the task's
    ``cancelling()`` asked whether somebody else cancelled the sample (aborted) or a
    future inside the stage was cancelled (a stray one: the stage failed).
    """
    item = run.item
    if batch.cancelled:
        force_end(item, Status.ABORTED, BATCH_CANCELLED)
        raise asyncio.CancelledError from (
            None if isinstance(exc, asyncio.CancelledError) else exc
        )
    if run.abort_requested:
        uncancel()
        end(item, Status.ABORTED, ENOUGH)
    elif deadline_expired:
        stage = failed_stage(item)
        where = "between stages" if stage is None else f"in stage '{stage}'"
        detail = f": {exc}" if isinstance(exc, DeadlineExceeded) else ""
        end(item, Status.TIMEOUT,
            f"sample timed out after {timeout_s}s {where}{detail}")
    elif isinstance(exc, StageTimeout):
        end(item, Status.TIMEOUT, str(exc))
    elif isinstance(exc, asyncio.CancelledError) and cancel_requested():
        uncancel()
        end(item, Status.ABORTED, OUTSIDE_CANCEL)
    elif isinstance(exc, asyncio.CancelledError):
        end(item, Status.FAILED, f"stage '{failed_stage(item)}' raised CancelledError "
             "from inside it: nobody cancelled the sample (a task or future it awaited "
             "was cancelled)")
    elif isinstance(exc, SampleAborted):
        end(item, Status.ABORTED, f"aborted in stage '{failed_stage(item)}': {exc}")
    else:
        end(item, Status.FAILED, describe(exc, item))
