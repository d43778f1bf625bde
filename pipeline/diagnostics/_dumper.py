"""The task dumper: a snapshot written to a file on SIGUSR1, a local socket, or ``dump()``.

A :class:`TaskDumper` owns the dump directory and writes the dumps; how a dump is asked for
(the signal handler that only wakes a thread, the socket, the thread that serves both, and
why that works while the event loop is stuck) is ``_trigger``. Task state is read from the
dumper thread while the loop thread may be running: the task registry is copied with retries
on a concurrent change, and await chains are read link by link (see
:mod:`pipeline.diagnostics._snapshot`). Sections registered with :func:`add_dump_section`
(``_sections``) are appended to every dump.

Where dumps go
--------------
``$ROLLOUT_DUMP_DIR/<pid>/``, else ``<tempdir>/rollout-dumps-<uid>/<pid>/``, with a locator
file for ``rollout dump``; a base that another user could tamper with is replaced by a
private fallback (see :mod:`pipeline.diagnostics._paths`). Each dump is
``tasks-<UTC time>-<n>.txt``, then its ``.json``, each written atomically through the
directory's descriptor, never following a symlink.

Signals can only be installed from the main thread. Where the pipeline runs elsewhere (a
Ray async actor, a trainer's thread), the dumper still serves the socket and :func:`dump`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from pipeline.diagnostics._errors import DiagnosticsError
from pipeline.diagnostics._paths import (
    FAULTHANDLER_FILE,
    default_dump_dir,
    open_dump_base,
    open_private_child,
    open_private_dir,
    write_atomic,
)
from pipeline.diagnostics._render import render_json, render_text
from pipeline.diagnostics._sections import collect_sections
from pipeline.diagnostics._snapshot import capture_snapshot, note_loop_thread, track_task_ages
from pipeline.diagnostics._trigger import DumpTrigger, signal_name

_logger = structlog.get_logger("pipeline.diagnostics")
_latest: list[TaskDumper] = []


class TaskDumper:
    """Writes snapshots on a signal, on a local-socket request, or when :meth:`dump` is called.

    Args:
        directory: where dump files go (default: :func:`default_dump_dir`, or a private
            fallback when its base is unsafe). It must be ours and writable by nobody else.
        signum: the signal to handle (default SIGUSR1); None for no signal. Ignored, with a
            warning, when :meth:`install` runs outside the main thread.
        trigger_socket: serve ``<directory>/dump.sock``: a client sends ``dump\\n`` and reads
            back the new file's path. Works from any thread.
        chain_faulthandler: also write every thread's C-level stack on the signal.
        write_json: write a ``.json`` beside each ``.txt`` dump.
        echo_stderr: also write the text dump to file descriptor 2.
        max_samples: in-flight samples listed one per line in the text dump.
        lag_source: returns ``id(loop) -> seconds without a heartbeat`` (a watchdog's lags).
    """

    def __init__(self, directory: str | Path | None = None, *,
                 signum: int | None = signal.SIGUSR1, trigger_socket: bool = True,
                 chain_faulthandler: bool = True, write_json: bool = True,
                 echo_stderr: bool = False, max_samples: int = 100,
                 lag_source: Callable[[], dict[int, float]] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_dump_dir()
        """Where dumps go; for the default, known for sure once installed (or dumped)."""
        self._explicit = directory is not None
        self._dir_fd: int | None = None
        self._base_fd: int | None = None  # the locator's directory
        self.signum = signum
        self.trigger_socket = trigger_socket
        self.chain_faulthandler = chain_faulthandler
        self.write_json = write_json
        self.echo_stderr = echo_stderr
        self.max_samples = max_samples
        self.lag_source = lag_source
        self._loops: list[asyncio.AbstractEventLoop] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._trigger = DumpTrigger(self._dump_logged)
        self._token = f"{os.getpid()}-{id(self):x}-{time.time_ns()}"

    @property
    def socket_path(self) -> Path | None:
        """The socket serving dump requests, once installed (None without one)."""
        return self._trigger.socket_path

    @property
    def installed_signal(self) -> int | None:
        """The signal handled, once installed (None: none, or installed off the main
        thread)."""
        return self._trigger.installed_signal

    @property
    def faulthandler_path(self) -> Path:
        """The file faulthandler appends thread stacks to on each signal."""
        return self.directory / FAULTHANDLER_FILE

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> TaskDumper:
        """Start the dumper thread, the socket and (on the main thread) the signal handler.

        Args:
            loop: the loop whose tasks matter most (default: the running loop, if any); its
                thread is remembered and task ages are recorded on it.

        Returns:
            self.

        Raises:
            DiagnosticsError: already installed, another dumper holds the signal, or the
                directory cannot be created.
        """
        if self._trigger.started:
            raise DiagnosticsError("this TaskDumper is already installed")
        if loop is None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        if loop is not None:
            self._loops.append(loop)
            if loop.is_running():
                note_loop_thread(loop)
                track_task_ages(loop)
        try:
            dir_fd = self._open_directory()
        except OSError as exc:
            raise DiagnosticsError(f"cannot use dump directory {self.directory}: {exc}") from exc
        try:
            self._trigger.open(self.directory, dir_fd, signum=self.signum,
                               trigger_socket=self.trigger_socket,
                               chain_faulthandler=self.chain_faulthandler)
        except BaseException:
            self._close_directory()
            raise
        self._trigger.start()
        _latest.append(self)
        self._write_locator()
        _logger.info("task_dumper_installed", directory=str(self.directory),
                     signal=signal_name(self.installed_signal),
                     socket=None if self.socket_path is None else str(self.socket_path))
        return self

    def _open_directory(self) -> int:
        """Open (once) the checked dump directory; see :mod:`pipeline.diagnostics._paths`."""
        if self._dir_fd is not None:
            return self._dir_fd
        if self._explicit:
            self._dir_fd = open_private_dir(self.directory)
            return self._dir_fd
        base, base_fd = open_dump_base()
        try:
            self._dir_fd = open_private_child(base_fd, str(os.getpid()))
        finally:
            os.close(base_fd)
        self.directory = base / str(os.getpid())
        return self._dir_fd

    def _dump_logged(self, reason: str) -> Path | None:
        try:
            return self.dump(reason)
        except Exception as exc:  # keep serving: the next request may succeed
            _logger.error("task_dump_failed", reason=reason, error=f"{type(exc).__name__}: {exc}")
            return None

    def dump(self, reason: str = "dump() call") -> Path:
        """Take a snapshot now and write it; callable from any thread.

        Returns:
            The text dump's path.

        Raises:
            OSError: the file could not be written.
        """
        with self._lock:
            lags = self.lag_source() if self.lag_source is not None else None
            snap = capture_snapshot(reason=reason, loops=self._loops, lags=lags)
            text = render_text(snap, max_samples=self.max_samples)
            extra_text, extra_data = collect_sections()
            text += extra_text
            self._seq += 1
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(snap.taken_at))
            micros = int((snap.taken_at % 1) * 1e6)
            base = f"tasks-{stamp}.{micros:06d}Z-{self._seq}"
            dir_fd = self._open_directory()
            path = self.directory / f"{base}.txt"
            write_atomic(dir_fd, path.name, text)  # first: it is what a person waits for
            if self.write_json:
                rendered = render_json(snap)
                if extra_data:
                    rendered = json.dumps({**json.loads(rendered), "sections": extra_data})
                write_atomic(dir_fd, f"{base}.json", rendered)
        if self.echo_stderr:
            with contextlib.suppress(OSError):
                os.write(2, text.encode("utf-8", "replace"))
        _logger.warning("task_dump_written", path=str(path), reason=reason,
                        tasks=len(snap.tasks), samples=len(snap.samples),
                        capture_s=round(snap.capture_s, 4))
        return path

    def _write_locator(self) -> None:
        record = {"pid": os.getpid(), "token": self._token,
                  "directory": str(self.directory.resolve()), "signal": self.installed_signal,
                  "socket": None if self.socket_path is None else str(self.socket_path),
                  "faulthandler": (str(self.faulthandler_path) if self._trigger.fault_file
                                   else None)}
        name = f"{os.getpid()}.json"
        try:
            _, self._base_fd = open_dump_base()
            write_atomic(self._base_fd, name, json.dumps(record))
        except OSError as exc:
            _logger.warning("task_dump_locator_failed", name=name, error=str(exc))

    def close(self) -> None:
        """Restore the signal handler, stop the thread, remove the socket and locator.

        The dump directory is removed too when nothing was written to it.
        """
        self._trigger.close()
        if self in _latest:
            _latest.remove(self)
        if self._base_fd is not None:
            name = f"{os.getpid()}.json"
            with contextlib.suppress(OSError, ValueError):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=self._base_fd)
                with open(fd, encoding="utf-8") as fh:
                    mine = json.loads(fh.read()).get("token") == self._token
                if mine:
                    os.unlink(name, dir_fd=self._base_fd)
            os.close(self._base_fd)
            self._base_fd = None
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):  # leave no empty directory behind
                if os.stat(FAULTHANDLER_FILE, dir_fd=self._dir_fd,
                           follow_symlinks=False).st_size == 0:
                    os.unlink(FAULTHANDLER_FILE, dir_fd=self._dir_fd)
            with contextlib.suppress(OSError):
                self.directory.rmdir()
        self._close_directory()

    def _close_directory(self) -> None:
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self) -> TaskDumper:
        return self.install() if not self._trigger.started else self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _after_fork_in_child() -> None:
    """A forked child inherits no dumper thread: none of the parent's dumpers is active there
    (``_trigger`` stands their signal handlers down)."""
    _latest.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def active_dumper() -> TaskDumper | None:
    """The most recently installed dumper that is still open, if any."""
    return _latest[-1] if _latest else None


def install_task_dumper(signum: int | None = signal.SIGUSR1, *,
                        directory: str | Path | None = None, **options: Any) -> TaskDumper:
    """Install a :class:`TaskDumper` on ``signum`` (and its socket); close it when done.

    Call it from the main thread (inside the running loop, so that loop's thread and task
    ages are known). ``options`` are :class:`TaskDumper`'s keywords.

    Raises:
        DiagnosticsError: see :meth:`TaskDumper.install`.
    """
    return TaskDumper(directory, signum=signum, **options).install()


def dump(directory: str | Path | None = None, *, reason: str = "dump() call") -> Path:
    """Write a snapshot now, from any thread; returns the text file's path.

    Uses the most recently installed dumper (its directory), unless ``directory`` is given or
    none is installed, in which case the file goes to ``directory`` or the default directory.
    """
    if _latest and directory is None:
        return _latest[-1].dump(reason)
    once = TaskDumper(directory, signum=None, trigger_socket=False)
    try:
        return once.dump(reason)
    finally:
        once._close_directory()
