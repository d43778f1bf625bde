"""Stage cleanups and the sample's exit stack: run once each, shielded, never raising."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline._concurrency.cancel import shielded
from pipeline._data.models import AgentRolloutItem, StageRecord, Status
from pipeline._runner.context import Context
from pipeline._runner.outcome import capped

Steps = list[tuple[str, Callable[[], Awaitable[Any]]]]


def cleanup_steps(item: AgentRolloutItem, ctx: Context) -> Steps:
    """The cleanups a finished sample needs: each started stage's ``cleanup`` (last started
    first), then the exit stack if a stage used it. Usually none, and then nothing is awaited."""
    steps: Steps = [
        (stage.name, functools.partial(cleanup, item, ctx))
        for stage in reversed(ctx.cleanup_stages)
        if (cleanup := getattr(stage, "cleanup", None)) is not None
    ]
    if ctx.has_exit_stack:
        steps.append(("exit_stack", ctx.exit_stack.aclose))
    return steps


async def run_cleanups(steps: Steps, item: AgentRolloutItem, ctx: Context,
                       limit: float | None) -> None:
    """Run ``steps`` (see :func:`cleanup_steps`) once each, shielded: whatever cancels the
    sample meanwhile waits until they are done. Never raises for them."""
    await shielded(lambda: _run_steps(steps, item, ctx, limit), None)


async def _run_steps(steps: Steps, item: AgentRolloutItem, ctx: Context,
                     limit: float | None) -> None:
    for name, step in steps:
        record = StageRecord(
            name=name,
            phase="cleanup",
            turn=None,
            start=time.monotonic(),
            end=None,
            start_wall=time.time(),
            status=Status.COMPLETED,
            error_type=None,
            error_message=None,
        )
        with contextlib.suppress(Exception):  # a stage may have replaced the list
            item.records.append(record)
        try:
            await shielded(step, limit)  # a step that swallows its cancellation is abandoned
        except TimeoutError as exc:
            record.status, record.error_type = Status.TIMEOUT, "TimeoutError"
            record.error_message = f"cleanup {exc}"
        except (Exception, asyncio.CancelledError) as exc:
            # Shielded: a CancelledError here came from inside the cleanup.
            record.status, record.error_type = Status.FAILED, type(exc).__name__
            record.error_message = capped(str(exc) or repr(exc))
        except BaseException as exc:  # a cleanup's SystemExit fails the cleanup, not the batch
            record.status, record.error_type = Status.FAILED, type(exc).__name__
            record.error_message = capped(str(exc) or repr(exc))
        finally:
            record.end = time.monotonic()
        if record.status is not Status.COMPLETED:
            ctx.log.warning("cleanup_failed", cleanup=name, error=record.error_message)
