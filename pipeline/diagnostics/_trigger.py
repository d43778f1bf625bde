"""How a dump is asked for: a signal whose handler only wakes a thread, a local socket, and the
dumper thread that serves both.

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

Signals can only be installed from the main thread, and one signal has one dumper per
process. Where the pipeline runs elsewhere (a Ray async actor, a trainer's thread), the
socket still serves. A forked child stands the inherited handlers down.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import selectors
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import structlog

from pipeline.diagnostics._errors import DiagnosticsError
from pipeline.diagnostics._frames import HIDDEN_CODES
from pipeline.diagnostics._paths import FAULTHANDLER_FILE, SOCKET_FILE

_MAX_UNIX_PATH = 100

_logger = structlog.get_logger("pipeline.diagnostics")
_by_signal: dict[int, DumpTrigger] = {}


class DumpTrigger:
    """The signal handler, the socket and the thread of one task dumper.

    Args:
        dump: called on the dumper thread with the reason; returns the file written, or
            None when it failed (and logged it).
    """

    def __init__(self, dump: Callable[[str], Path | None]) -> None:
        self._dump = dump
        self.socket_path: Path | None = None
        self.installed_signal: int | None = None
        self.fault_file: IO[str] | None = None
        """The file faulthandler writes to on the signal (open for C), when chained."""
        self._directory: Path | None = None
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1
        self._listener: socket.socket | None = None
        self._previous: Any = None
        self._stopping = False
        self._pid = os.getpid()
        self._socket_inode: int | None = None

    @property
    def started(self) -> bool:
        """Whether the dumper thread runs."""
        return self._thread is not None

    def open(self, directory: Path, dir_fd: int, *, signum: int | None, trigger_socket: bool,
             chain_faulthandler: bool) -> None:
        """Open the wake pipe, the socket in ``directory`` and (on the main thread) the signal
        handler; on failure everything opened is closed again.

        Raises:
            DiagnosticsError: another dumper holds the signal, or the socket cannot listen.
        """
        self._directory = directory
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        try:
            if trigger_socket:
                self._open_socket(directory, dir_fd)
            if signum is not None:
                self._install_signal(signum, dir_fd, chain_faulthandler)
        except BaseException:
            self.close_fds()
            raise

    def start(self) -> None:
        """Start the dumper thread."""
        self._thread = threading.Thread(target=self._serve, name="rollout-task-dumper",
                                        daemon=True)
        self._thread.start()

    def _install_signal(self, signum: int, dir_fd: int, chain_faulthandler: bool) -> None:
        if threading.current_thread() is not threading.main_thread():
            _logger.warning("task_dump_signal_skipped", signal=signal_name(signum),
                            reason="signals can only be installed from the main thread",
                            hint="use the dump socket (rollout dump) or diagnostics.dump()")
            return
        other = _by_signal.get(signum)
        if other is not None:
            raise DiagnosticsError(f"a task dumper already handles {signal_name(signum)} "
                                   f"(writing to {other._directory}); close it first")
        self._previous = signal.signal(signum, self._on_signal)
        if chain_faulthandler:
            fd = os.open(FAULTHANDLER_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT |
                         os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
            self.fault_file = open(fd, "a")  # kept open for C
            faulthandler.register(signum, file=self.fault_file, all_threads=True,
                                  chain=True)
        self.installed_signal = signum
        _by_signal[signum] = self

    def _open_socket(self, directory: Path, dir_fd: int) -> None:
        path = directory / SOCKET_FILE
        if len(os.fsencode(path)) > _MAX_UNIX_PATH:
            _logger.warning("task_dump_socket_skipped", path=str(path),
                            reason="path too long for a Unix socket")
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET_FILE, dir_fd=dir_fd)
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
                            self._dump(f"signal {signal_name(self.installed_signal)}")
                    else:
                        self._answer_socket()
        finally:
            sel.close()

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
            path = self._dump("socket request")
            reply = "error: see the process log\n" if path is None else f"{path}\n"
            with contextlib.suppress(OSError):
                conn.sendall(reply.encode())

    def close(self) -> None:
        """Restore the signal handler, stop the thread, close the pipe and the socket."""
        if self.installed_signal is not None:
            if self.fault_file is not None:
                faulthandler.unregister(self.installed_signal)
                self.fault_file.close()
                self.fault_file = None
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
        self.close_fds()

    def close_fds(self) -> None:
        """Close the socket (removing its file if it is still ours) and the wake pipe."""
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


HIDDEN_CODES.add(DumpTrigger._on_signal.__code__)


def _after_fork_in_child() -> None:
    """A forked child inherits the handlers but not the dumper thread: stand them down
    (faulthandler would write the child's stacks into the parent's file)."""
    for signum, trigger in list(_by_signal.items()):
        if trigger.fault_file is not None:
            faulthandler.unregister(signum)
    _by_signal.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def signal_name(signum: int | None) -> str | None:
    """``SIGUSR1`` for its number (the number itself for an unknown one; None for None)."""
    if signum is None:
        return None
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
