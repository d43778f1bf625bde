"""The pool's errors, and how the driver reads the error of a worker call.

A worker call that fails either means the worker is *lost* (:func:`is_worker_loss`: Ray
reports its death, or it says it is broken), or carries a real cause the driver reports
(:func:`describe`: the worker's own exception, not Ray's wrapping of it).
"""

from __future__ import annotations

import re

import ray

from pipeline._exceptions import PipelineError
from pipeline.distributed._worker import WorkerBroken

CLOSED_WHILE_RUNNING = "the pool was closed before this sample finished"


class PoolClosed(PipelineError, RuntimeError):
    """The :class:`RayRolloutPool` was closed (``aclose``); start a new one to run more."""


class PoolNotStarted(PipelineError, RuntimeError):
    """The :class:`RayRolloutPool` has not been started (``await pool.start()`` or
    ``async with pool``)."""


class WeightUpdateFailed(PipelineError, RuntimeError):
    """A pool-wide weight update failed on some worker(s); every worker was resumed.

    Attributes:
        failed: worker id -> why its update failed.
        updated: worker id -> the version it holds now, for the workers that did update.
    """

    def __init__(self, message: str, failed: dict[str, str], updated: dict[str, int]) -> None:
        super().__init__(message)
        self.failed = failed
        self.updated = updated


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def is_worker_loss(error: BaseException) -> bool:
    """Whether ``error`` (from a worker call) means the worker is dead or broken."""
    if isinstance(error, ray.exceptions.RayActorError | WorkerBroken):
        return True
    return isinstance(getattr(error, "cause", None), WorkerBroken)


def describe(error: BaseException, *, first_line: bool = False, limit: int = 2000) -> str:
    """``Type: message`` of the real cause: the worker's own exception for one Ray wrapped
    (not Ray's header line), colour codes removed, capped at ``limit`` characters."""
    cause = getattr(error, "cause", None)
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(cause, BaseException):
        error = cause
    text = _ANSI.sub("", str(error)).strip()
    if first_line and text:
        text = text.splitlines()[0]
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else f"{text[:limit]} [...]"
