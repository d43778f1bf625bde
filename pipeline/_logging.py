"""Logging for programs that use the library: one call sets the level and the format.

The library logs through structlog with user text passed as values (never formatted into the
event name), under the logger name ``pipeline``. It never configures logging itself: a program
calls :func:`configure_logging` once at its edge (the ``rollout`` command does), or configures
structlog its own way.

What each level prints, per batch of any size:

- ``error``: what lost data or needs a person (a trajectory line not written, a sample whose
  trainer view could not be built, a stalled pipeline, a failing ``on_sample_done``);
- ``warning``: one ``batch_failures`` line per batch that had samples not completing (counts
  by status, stage and error type, a few example uids), a blocked event loop, torn dump lines;
- ``info``: one ``batch_done`` line per batch, the engine chosen, the ``batch_heartbeat``
  progress line of long batches, servers started;
- ``debug``: one line per sample that did not complete (``sample_ended``), with its error.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

import structlog

from pipeline._data.models import AgentRolloutItem, BatchStats, Status
from pipeline._exceptions import ConfigError

LogFormat = Literal["kv", "json"]

_LEVELS = ("debug", "info", "warning", "error", "critical")


def configure_logging(level: str | int = "info", *, format: LogFormat = "kv",
                      stream: TextIO | None = None) -> None:
    """Set the level and format of the library's log lines (and any other structlog user's).

    Args:
        level: ``"debug"``, ``"info"``, ``"warning"``, ``"error"``, ``"critical"`` (any case)
            or a :mod:`logging` level number; lines below it are dropped at no cost.
        format: ``"kv"`` — ``timestamp=... level=warning event=batch_failures failed=3 ...``
            — or ``"json"``, one JSON object per line.
        stream: where lines go (default: standard error).

    Raises:
        ConfigError: an unknown level or format, naming it and the choices.
    """
    number = _level_number(level)
    if format not in ("kv", "json"):
        raise ConfigError(f"format must be 'kv' or 'json', got {format!r}", field="format")
    renderer: Any = (structlog.processors.JSONRenderer() if format == "json" else
                     structlog.processors.KeyValueRenderer(
                         key_order=["timestamp", "level", "event"], drop_missing=True))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        logger_factory=structlog.PrintLoggerFactory(stream if stream is not None else sys.stderr),
        cache_logger_on_first_use=False,
    )


def _level_number(level: str | int) -> int:
    if isinstance(level, bool) or not isinstance(level, str | int):
        raise ConfigError(f"level must be a name or a number, got {level!r}", field="level")
    if isinstance(level, int):
        if level < 0:
            raise ConfigError(f"level must be >= 0, got {level}", field="level")
        return level
    if level.lower() not in _LEVELS:
        raise ConfigError(f"level {level!r} is not one of {', '.join(_LEVELS)}", field="level")
    return logging.getLevelNamesMapping()[level.upper()]


def failure_summary(items: Iterable[AgentRolloutItem], *, top: int = 5,
                    examples: int = 3) -> dict[str, Any] | None:
    """One line's worth of why samples did not complete, or None when all did.

    Returns:
        ``failed`` (count), ``by_cause`` (the ``top`` most common ``status:stage:error type``
        with their counts, the rest summed under ``other``) and ``examples`` (a few uids with
        their error, cut to 200 characters).
    """
    causes: Counter[str] = Counter()
    shown: list[dict[str, str]] = []
    for item in items:
        if item.status is Status.COMPLETED or item.status is None:
            continue
        error_type = next((r.error_type for r in reversed(item.records) if r.error_type), None)
        causes[f"{item.status.value}:{item.error_stage or '-'}:{error_type or '-'}"] += 1
        if len(shown) < examples:
            shown.append({"uid": str(item.uid), "error": str(item.error or "")[:200]})
    if not causes:
        return None
    by_cause = dict(causes.most_common(top))
    rest = sum(causes.values()) - sum(by_cause.values())
    if rest:
        by_cause["other"] = rest
    return {"failed": sum(causes.values()), "by_cause": by_cause, "examples": shown}


def log_batch_done(logger: Any, stats: BatchStats, items: Iterable[AgentRolloutItem]) -> None:
    """The batch-level lines: ``batch_done`` at info, ``batch_failures`` at warning when some
    samples did not complete (one line, whatever the batch size: per-sample lines are debug)."""
    logger.info("batch_done", samples=stats.num_samples, by_status=stats.by_status,
                wall_time_s=round(stats.wall_time_s, 3))
    try:
        summary = failure_summary(items)
    except Exception as exc:  # a stage left odd values on an item: the batch still returns
        logger.error("batch_failures_unreadable", error=repr(exc))
        return
    if summary is not None:
        logger.warning("batch_failures", samples=stats.num_samples, **summary)


@dataclass(frozen=True)
class Console:
    """The terminal's standard output and error while :func:`output_to_file` holds fds 1 and 2."""

    out: TextIO
    err: TextIO


@contextlib.contextmanager
def output_to_file(path: Path) -> Iterator[Console]:
    """Send everything written to file descriptors 1 and 2 into ``path`` while the block runs.

    That is the whole process's output at the OS level: Python's own ``print``, logging
    handlers bound to ``sys.stdout``/``sys.stderr`` (vLLM's), warnings, C++ and tqdm lines, and
    every child process started inside the block (they inherit the descriptors, so an engine
    process keeps writing into the file after the block). The block writes to the terminal
    through the yielded :class:`Console`. On the way out the descriptors are restored, so an
    error raised by the block is printed where the user sees it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = (os.dup(1), os.dup(2))
    console = Console(
        out=io.TextIOWrapper(io.FileIO(saved[0], "w", closefd=False), line_buffering=True),
        err=io.TextIOWrapper(io.FileIO(saved[1], "w", closefd=False), line_buffering=True))
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        yield console
    finally:
        for stream in (sys.stdout, sys.stderr, console.out, console.err):
            with contextlib.suppress(Exception):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)


def tail_lines(path: Path, count: int = 20, *, max_bytes: int = 64_000) -> list[str]:
    """The last ``count`` non-empty lines of a log file (read from its last ``max_bytes``);
    empty when it cannot be read."""
    try:
        with path.open("rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - max_bytes))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()][-count:]
