"""``asyncio_run``: the library's one sync entry point, with diagnostics built in."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import structlog

from pipeline._gc import gc_tuning_enabled, rollout_gc
from pipeline.diagnostics._dumper import TaskDumper, active_dumper
from pipeline.diagnostics._snapshot import note_loop_thread, task_infos, track_task_ages
from pipeline.diagnostics._watchdog import Watchdog

T = TypeVar("T")
_logger = structlog.get_logger("pipeline")


def asyncio_run(main: Coroutine[Any, Any, T], *, watchdog: Watchdog | bool = True,
                dump_signal: int | None = signal.SIGUSR1, dump_dir: str | Path | None = None,
                use_uvloop: bool = True, debug: bool | None = None,
                gc_tuning: bool | None = None) -> T:
    """Run ``main`` to completion on a new event loop, with the task dumper and a watchdog.

    Installs uvloop when available, a :class:`TaskDumper` (``kill -USR1 <pid>`` or
    ``rollout dump <pid>`` writes a snapshot of every task, thread and in-flight sample) and
    a :class:`Watchdog` (logs ``event_loop_blocked`` with the blocking code when the loop
    stops answering for a second; ``pipeline_stalled`` plus a snapshot when no sample finished
    for five minutes). Tasks still running when ``main`` returns are reported as a leak
    (something started a task nobody owns), then cancelled by ``asyncio.Runner`` as usual.

    Args:
        main: the coroutine to run.
        watchdog: a configured :class:`Watchdog`, True for the defaults
            (``Watchdog(1.0, stall_after_s=300)``), or False for none.
        dump_signal: the signal that writes a dump; None for no signal handler (the dump
            socket and :func:`pipeline.diagnostics.dump` still work). Only the main thread can
            install one; elsewhere it is skipped with a warning.
        dump_dir: where dumps go (default: :func:`default_dump_dir`).
        use_uvloop: use uvloop when it is installed.
        debug: asyncio debug mode (None: the interpreter's default).
        gc_tuning: raise the collector's first-generation threshold and freeze what exists
            at start-up while ``main`` runs, restoring both after (full collections over
            thousands of live samples otherwise pause the loop); None: on unless
            ``ROLLOUT_GC_TUNING=0``. Only this entry point and the CLI do this; the library
            never changes a host process's collector.

    Returns:
        What ``main`` returns.

    When a task dumper is already installed in this process (``install_task_dumper``, or an
    enclosing ``asyncio_run`` in another thread), it is used instead of a new one.

    Raises:
        Exception: whatever ``main`` raises.
        DiagnosticsError: the dump directory cannot be created.
    """
    loop_factory = _uvloop_factory() if use_uvloop else None
    dog = Watchdog(1.0, stall_after_s=300.0) if watchdog is True else (watchdog or None)
    if threading.current_thread() is not threading.main_thread():
        dump_signal = None  # signals belong to the main thread; the socket still serves

    async def wrapper() -> T:
        me = asyncio.current_task()
        if dog is not None:
            dog.start()
        try:
            result = await main
        finally:
            if dog is not None:
                dog.stop()
        leaked = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if leaked:
            _report_leaks(leaked)
        return result

    with rollout_gc(gc_tuning_enabled(gc_tuning)), \
            asyncio.Runner(loop_factory=loop_factory, debug=debug) as runner, \
            diagnosed_loop(runner.get_loop(), dog, dump_dir=dump_dir, dump_signal=dump_signal):
        return runner.run(wrapper())


@contextlib.contextmanager
def diagnosed_loop(loop: asyncio.AbstractEventLoop, watchdog: Watchdog | None, *,
                   dump_dir: str | Path | None = None,
                   dump_signal: int | None = None) -> Iterator[None]:
    """Diagnostics for a loop the caller runs itself (what :func:`asyncio_run` installs):
    the loop's thread and task ages noted, a :class:`TaskDumper` installed unless one already
    serves the process (closed on exit), and ``watchdog`` dumping through it. The watchdog
    itself is started and stopped by the caller."""
    note_loop_thread(loop)
    track_task_ages(loop)
    dumper: TaskDumper | None = None
    if active_dumper() is None:  # else the one already installed serves this loop too
        dumper = TaskDumper(dump_dir, signum=dump_signal,
                            lag_source=None if watchdog is None else watchdog.lags)
        dumper.install(loop)
    if watchdog is not None and watchdog.dump is None and dumper is not None:
        watchdog.dump = dumper.dump
    try:
        yield
    finally:
        if dumper is not None:
            dumper.close()


def _report_leaks(leaked: list[asyncio.Task[Any]]) -> None:
    groups: dict[tuple[Any, ...], list[str]] = {}
    where: dict[tuple[Any, ...], str] = {}
    for info in task_infos(leaked):
        groups.setdefault(info.group_key, []).append(info.name)
        where[info.group_key] = f"{info.location} awaiting {info.awaiting}"
    _logger.warning("tasks_left_running", count=len(leaked),
                    tasks=[t.get_name() for t in leaked[:20]],
                    groups=[f"{len(names)} x {where[key]} (e.g. {names[0]})"
                            for key, names in groups.items()])


def _uvloop_factory() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
