"""The task dumper: a snapshot written to a file on SIGUSR1, a local socket, or ``dump()``.

How it works when the event loop is stuck
-----------------------------------------
The signal handler does no work itself: it writes one byte to a pipe and returns (a handler
that took the snapshot itself would run inside whatever the main thread was interrupted in,
a held logging lock included). A dedicated dumper thread sleeps on that pipe (and on a Unix
socket), takes the snapshot and writes the file. So the dump never waits for the loop:

- loop idle in ``epoll``: the signal interrupts the wait, Python runs the handler at once;
- loop thread blocked in ``time.sleep``, a blocking lock or a pure-Python loop: Python runs
  the handler between bytecodes (sleep and lock waits are interrupted and resumed), the
  dumper thread wakes and gets the GIL at the next switch interval (5 ms);
- loop thread inside C code that holds the GIL: no Python code can run anywhere, so
  ``faulthandler`` is chained on the same signal; its C-level handler writes every thread's
  stack to ``faulthandler.txt`` in the dump directory right away.

Task state is read from the dumper thread while the loop thread may be running: the task
registry is copied with retries on a concurrent change, and await chains are read link by
link (see :mod:`pipeline.diagnostics._snapshot`).

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
import faulthandler
import json
import os
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import structlog

from pipeline.diagnostics._errors import DiagnosticsError
from pipeline.diagnostics._frames import HIDDEN_CODES
from pipeline.diagnostics._paths import (
    FAULTHANDLER_FILE,
    SOCKET_FILE,
    default_dump_dir,
    open_dump_base,
    open_private_child,
    open_private_dir,
    write_atomic,
)
from pipeline.diagnostics._render import render_json, render_text
from pipeline.diagnostics._snapshot import capture_snapshot, note_loop_thread, track_task_ages

_MAX_UNIX_PATH = 100

_logger = structlog.get_logger("pipeline.diagnostics")
_by_signal: dict[int, TaskDumper] = {}
_latest: list[TaskDumper] = []
_sections: dict[str, Callable[[], tuple[str, Any]]] = {}


def add_dump_section(name: str, provider: Callable[[], tuple[str, Any]]) -> Callable[[], None]:
    """Add a section to every dump this process writes, for state that lives elsewhere (the
    Ray workers of a driver's ``RayRolloutPool``).

    ``provider()`` runs on the dumper's thread at each dump and returns ``(text, data)``:
    the text is appended to the text dump, the data (JSON-able) goes under
    ``"sections": {name: data}`` in the JSON dump. It must bound its own time; if it raises,
    the error is written in its place.

    Returns:
        A function that removes the section.
    """
    _sections[name] = provider

    def remove() -> None:
        if _sections.get(name) is provider:
            del _sections[name]

    return remove


def _extra_sections() -> tuple[str, dict[str, Any]]:
    texts: list[str] = []
    data: dict[str, Any] = {}
    for name, provider in list(_sections.items()):
        try:
            text, data[name] = provider()
        except Exception as exc:  # a section must never cost the dump
            text = f"(section failed: {type(exc).__name__}: {exc})"
            data[name] = {"error": text}
        texts.append(f"\n== {name} ==\n{text.rstrip()}\n")
    return "".join(texts), data


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
        self.socket_path: Path | None = None
        self.installed_signal: int | None = None
        self._loops: list[asyncio.AbstractEventLoop] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._listener: socket.socket | None = None
        self._previous: Any = None
        self._fault_file: IO[str] | None = None
        self._stopping = False
        self._pid = os.getpid()
        self._token = f"{os.getpid()}-{id(self):x}-{time.time_ns()}"
        self._socket_inode: int | None = None

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
        if self._thread is not None:
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
            self._open_directory()
        except OSError as exc:
            raise DiagnosticsError(f"cannot use dump directory {self.directory}: {exc}") from exc
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        try:
            self._open_socket()
            self._install_signal()
        except BaseException:
            self._close_fds()
            self._close_directory()
            raise
        self._thread = threading.Thread(target=self._serve, name="rollout-task-dumper",
                                        daemon=True)
        self._thread.start()
        _latest.append(self)
        self._write_locator()
        _logger.info("task_dumper_installed", directory=str(self.directory),
                     signal=_signal_name(self.installed_signal),
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

    def _install_signal(self) -> None:
        if self.signum is None:
            return
        if threading.current_thread() is not threading.main_thread():
            _logger.warning("task_dump_signal_skipped", signal=_signal_name(self.signum),
                            reason="signals can only be installed from the main thread",
                            hint="use the dump socket (rollout dump) or diagnostics.dump()")
            return
        other = _by_signal.get(self.signum)
        if other is not None:
            raise DiagnosticsError(f"a task dumper already handles {_signal_name(self.signum)} "
                                   f"(writing to {other.directory}); close it first")
        self._previous = signal.signal(self.signum, self._on_signal)
        if self.chain_faulthandler:
            fd = os.open(FAULTHANDLER_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT |
                         os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._open_directory())
            self._fault_file = open(fd, "a")  # kept open for C
            faulthandler.register(self.signum, file=self._fault_file, all_threads=True,
                                  chain=True)
        self.installed_signal = self.signum
        _by_signal[self.signum] = self

    def _open_socket(self) -> None:
        if not self.trigger_socket:
            return
        path = self.directory / SOCKET_FILE
        if len(os.fsencode(path)) > _MAX_UNIX_PATH:
            _logger.warning("task_dump_socket_skipped", path=str(path),
                            reason="path too long for a Unix socket")
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET_FILE, dir_fd=self._open_directory())
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(os.fspath(path))
            listener.listen(4)
        except OSError as exc:
            listener.close()
            raise DiagnosticsError(f"cannot listen on {path}: {exc}") from exc
        self._listener = listener
        self.socket_path = path
        self._socket_inode = path.stat().st_ino

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Runs in the main thread between bytecodes: only wakes the dumper thread."""
        # A forked child shares the pipe but not the thread; after close() the fd is gone
        # (and its number may belong to another file by now).
        if os.getpid() == self._pid and self._wake_w >= 0:
            try:
                os.write(self._wake_w, bytes([signum & 0xFF]))
            except OSError:  # pipe full: a dump is already pending
                pass
        previous = self._previous
        if callable(previous):
            previous(signum, frame)

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if self._listener is not None:
            sel.register(self._listener, selectors.EVENT_READ, "socket")
        try:
            while not self._stopping:
                for key, _ in sel.select():
                    if key.data == "wake":
                        data = os.read(self._wake_r, 512)
                        if not self._stopping and any(b != 0 for b in data):
                            self._dump_logged(f"signal {_signal_name(self.installed_signal)}")
                    else:
                        self._answer_socket()
        finally:
            sel.close()

    def _dump_logged(self, reason: str) -> Path | None:
        try:
            return self.dump(reason)
        except Exception as exc:  # keep serving: the next request may succeed
            _logger.error("task_dump_failed", reason=reason, error=f"{type(exc).__name__}: {exc}")
            return None

    def _answer_socket(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(2.0)
            try:
                request = conn.recv(64).decode("ascii", "replace").strip()
            except OSError:
                return
            if request != "dump":
                conn.sendall(b"error: send 'dump'\n")
                return
            path = self._dump_logged("socket request")
            reply = "error: see the process log\n" if path is None else f"{path}\n"
            with contextlib.suppress(OSError):
                conn.sendall(reply.encode())

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
            extra_text, extra_data = _extra_sections()
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
                  "faulthandler": (str(self.faulthandler_path) if self._fault_file else None)}
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
        if self.installed_signal is not None:
            if self._fault_file is not None:
                faulthandler.unregister(self.installed_signal)
                self._fault_file.close()
                self._fault_file = None
            if threading.current_thread() is threading.main_thread():
                signal.signal(self.installed_signal, self._previous or signal.SIG_DFL)
            _by_signal.pop(self.installed_signal, None)
            self.installed_signal = None
        if self._thread is not None:
            self._stopping = True
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"\0")
            self._thread.join(timeout=10.0)
            self._thread = None
        self._close_fds()
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

    def _close_fds(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self.socket_path is not None:
                with contextlib.suppress(OSError):  # only ours: another may have replaced it
                    if self.socket_path.stat().st_ino == self._socket_inode:
                        self.socket_path.unlink()
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> TaskDumper:
        return self.install() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()


HIDDEN_CODES.add(TaskDumper._on_signal.__code__)


def _after_fork_in_child() -> None:
    """A forked child inherits the handlers but not the dumper thread: stand them down
    (faulthandler would write the child's stacks into the parent's file)."""
    for signum, dumper in list(_by_signal.items()):
        if dumper._fault_file is not None:
            faulthandler.unregister(signum)
    _by_signal.clear()
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


def _signal_name(signum: int | None) -> str | None:
    if signum is None:
        return None
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
