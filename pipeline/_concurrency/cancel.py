"""Cancellation, told apart and contained.

Two rules of the runner live here:

* A ``CancelledError`` is a *real* cancellation only when somebody called ``cancel()`` on the
  task that sees it (``task.cancelling() > 0``). A stage that awaits a future someone else
  cancelled gets a *stray* one: that is a failure of the stage, never a reason to cancel the
  batch.
* Concurrent work inside a sample is owned by :func:`run_owned`, not ``asyncio.TaskGroup``:
  on Python 3.11 a task group whose child fails leaves a cancellation request counted on the
  task that owns it (``cancelling()`` stays 1), which would make a stage's plain error look
  like a cancellation of its sample.
* Cleanups run to their end with their own deadline, whatever cancels their caller meanwhile.
  anyio's ``CancelScope(shield=True)`` does not stop a native ``Task.cancel()`` (a cancelled
  ``run_batch``, an ``asyncio.timeout``), so the cleanup runs in a task of its own that the
  caller waits for, and the caller's cancellation is re-raised once it is done.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import structlog

T = TypeVar("T")

_logger = structlog.get_logger("pipeline")


def cancel_requested() -> bool:
    """Whether somebody asked to cancel the current task (a real, not a stray, cancellation)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


CANCEL_GRACE_S = 1.0
"""How long :func:`shielded` waits for work it cancelled at its timeout to end before it
abandons it (work that swallows its cancellation would otherwise hold its caller forever)."""



def stage_grace(cleanup_timeout_s: float) -> float:
    """How long cancelled stages may take to end before they are abandoned: their own
    cancellation path (an engine abort, bounded by ``cleanup_timeout_s`` plus
    :data:`CANCEL_GRACE_S`) with as much again to spare."""
    return 2 * cleanup_timeout_s + CANCEL_GRACE_S


_ABANDONED: dict[asyncio.Task[Any], str] = {}


def abandon(task: asyncio.Task[Any], what: str) -> None:
    """Own ``task``, which ignored its cancellation, until it ends on its own: logged now
    and when it ends (its exception retrieved), listed by :func:`abandoned_tasks`."""
    _ABANDONED[task] = what
    _logger.error("task_abandoned", task=task.get_name(), what=what)
    task.add_done_callback(_abandoned_done)


def _abandoned_done(task: asyncio.Task[Any]) -> None:
    what = _ABANDONED.pop(task, "")
    error = None if task.cancelled() else task.exception()
    _logger.warning("abandoned_task_ended", task=task.get_name(), what=what,
                    error=None if error is None else repr(error))


def abandoned_tasks() -> dict[asyncio.Task[Any], str]:
    """Tasks abandoned because they ignored their cancellation and still running, with what
    each was (diagnostics read it)."""
    return dict(_ABANDONED)


async def shielded(make: Callable[[], Awaitable[T]], timeout_s: float | None) -> T:
    """Run ``make()`` to its end in a task of its own, bounded by ``timeout_s`` (counted from
    its first step).

    A cancellation of the caller while it runs is deferred: ``CancelledError`` is raised once
    the work has ended, so a cleanup is never cut short and never runs twice. Work still
    running at ``timeout_s`` is cancelled; if it ignores that for :data:`CANCEL_GRACE_S`
    more, it is abandoned (:func:`abandon`) and the caller goes on.

    Raises:
        TimeoutError: the work did not end within ``timeout_s`` (the message says whether it
            was abandoned).
        asyncio.CancelledError: the caller was cancelled meanwhile.
        Exception: whatever the work raised (when the caller was not cancelled).
    """
    work = make()
    loop = asyncio.get_running_loop()
    began: asyncio.Future[None] = loop.create_future()
    inner = loop.create_task(_as_coroutine(work, began))
    # The bound counts from the work's first step, not from the task's creation: on a loaded
    # loop (a thousand samples cleaning up at once) a task can wait longer than a short
    # timeout to be scheduled, and work cancelled before it began would never run at all.
    cancelled = await wait_through_cancellation([began])
    cancelled = await wait_through_cancellation([inner], timeout_s) or cancelled
    timed_out = not inner.done()
    if timed_out:
        inner.cancel()
        cancelled = await wait_through_cancellation([inner], CANCEL_GRACE_S) or cancelled
    if inner.done():
        _close_unstarted(work)
    error: BaseException | None
    if not inner.done():
        abandon(inner, f"work still running {timeout_s}s after it started and "
                       f"{CANCEL_GRACE_S}s after its cancellation")
        error = TimeoutError(f"did not end within {timeout_s}s and ignored its cancellation "
                             "(abandoned)")
    else:
        # Retrieved in every case: the caller's cancellation, then the timeout, take precedence.
        exc = None if inner.cancelled() else inner.exception()
        error = TimeoutError(f"did not end within {timeout_s}s") if timed_out else exc
    if cancelled:
        raise asyncio.CancelledError
    if error is not None:
        raise error
    return inner.result()


async def wait_through_cancellation(tasks: Sequence[asyncio.Future[Any]],
                                    timeout_s: float | None = None) -> bool:
    """Wait until every task is done (or ``timeout_s`` passed), even if the caller is
    cancelled meanwhile.

    Returns:
        Whether the caller was cancelled while waiting (it should re-raise
        ``CancelledError`` once it has looked at the tasks).
    """
    loop = asyncio.get_running_loop()
    until = None if timeout_s is None else loop.time() + timeout_s
    cancelled = False
    while not all(task.done() for task in tasks):
        left = None if until is None else until - loop.time()
        if left is not None and left <= 0:
            break
        try:
            await asyncio.wait(tasks, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled


async def run_owned(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Run ``awaitables`` concurrently; their results in order.

    The tasks are owned here: on the first error, or when the caller is cancelled, the
    others are cancelled and awaited before this raises, so none is left running. Unlike
    ``asyncio.TaskGroup`` on Python 3.11, no cancellation request is left pending on the
    caller's task.

    Raises:
        Exception: the first error, in input order, of a task that failed.
        asyncio.CancelledError: the caller was cancelled.
    """
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_as_coroutine(a)) for a in awaitables]
    cancelled = False
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        cancelled = True
    rest = [task for task in tasks if not task.done()]
    for task in rest:
        task.cancel()
    cancelled = await wait_through_cancellation(rest) or cancelled
    for awaitable in awaitables:
        _close_unstarted(awaitable)
    errors = [exc for task in tasks if not task.cancelled()
              and (exc := task.exception()) is not None]  # every one retrieved
    if cancelled:
        raise asyncio.CancelledError
    if errors:
        raise errors[0]
    return [task.result() for task in tasks]


class EscapedBaseException(Exception):
    """A ``SystemExit``, ``KeyboardInterrupt`` or other ``BaseException`` raised by work in a
    task of its own, as an ordinary error (its ``__cause__``): asyncio re-raises the first two
    out of the event loop itself, which would end every sample and the caller's program."""


def _close_unstarted(awaitable: Awaitable[Any]) -> None:
    """Close a coroutine whose task was cancelled before its first step (a timeout shorter
    than the event loop's lag), so it is not reported as "never awaited" when collected."""
    if inspect.iscoroutine(awaitable) and \
            inspect.getcoroutinestate(awaitable) == inspect.CORO_CREATED:
        awaitable.close()


async def _as_coroutine(awaitable: Awaitable[T],
                        began: asyncio.Future[None] | None = None) -> T:
    if began is not None and not began.done():
        began.set_result(None)
    try:
        return await awaitable
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise EscapedBaseException(f"{type(exc).__name__}: {exc}") from exc


class _Aborting(Protocol):
    async def abort(self, request_id: str) -> None: ...


async def abort_request(engine: _Aborting, request_id: str, timeout_s: float | None,
                        **log: Any) -> str | None:
    """Abort an engine request on a cancellation path: bounded, shielded, never raising.

    Returns:
        None when the abort went through, else why it did not (also logged as
        ``engine_abort_failed``); the caller records it and keeps its own outcome.
    """
    try:
        await shielded(lambda: engine.abort(request_id), timeout_s)
        return None
    except TimeoutError:
        error = f"engine abort of {request_id} took longer than {timeout_s}s"
    except asyncio.CancelledError:
        if cancel_requested():
            raise
        error = f"engine abort of {request_id} raised CancelledError"
    except Exception as exc:
        error = f"engine abort of {request_id} failed: {type(exc).__name__}: {exc}"
    _logger.warning("engine_abort_failed", request_id=request_id, error=error, **log)
    return error
