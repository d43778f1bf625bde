"""``rollout dump PID``: ask a running process for a task dump and print it.

The process's locator file (see :mod:`pipeline.diagnostics._dumper`) says where it writes
dumps and how to ask: by signal when it installed one, else through its dump socket. The
command refuses to send a signal the process does not handle (SIGUSR1's default action
would kill it). When no dump comes in time, it prints what ``faulthandler`` wrote for the
signal instead: the thread stacks of a process stuck in C code that holds the GIL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from pipeline.diagnostics._paths import (
    FAULTHANDLER_FILE,
    SOCKET_FILE,
    default_dump_dir,
    locator_path,
)

EXIT_OK = 0
EXIT_NO_DUMP = 1
EXIT_REFUSED = 2


def dump_command(pid: int, *, directory: Path | None = None, timeout: float = 10.0,
                 out: TextIO | None = None) -> int:
    """Ask process ``pid`` for a dump, wait for the new file and print it.

    Args:
        pid: the process.
        directory: its dump directory (default: from its locator file, else
            :func:`default_dump_dir` for that pid and its owner).
        timeout: seconds to wait for the new dump.
        out: where to print the dump (default: stdout); messages go to stderr.

    Returns:
        0 when a dump was printed; 1 when none came (faulthandler's thread stacks are
        printed if it wrote any) or the process does not exist; 2 when the process has no
        dumper to ask.
    """
    stream = out if out is not None else sys.stdout
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        _say(f"rollout dump: no process {pid}")
        return EXIT_NO_DUMP
    except PermissionError:
        _say(f"rollout dump: not allowed to signal process {pid} (another user's process)")
        return EXIT_NO_DUMP
    uid = _owner(pid)
    locator = _read_locator(pid, uid)
    if directory is None:
        directory = Path(locator["directory"]) if locator else default_dump_dir(pid, uid)
    before = _dumps(directory)
    fault_file = directory / FAULTHANDLER_FILE
    fault_size = fault_file.stat().st_size if fault_file.exists() else 0
    signum = locator.get("signal") if locator else signal.SIGUSR1
    sock_path = locator.get("socket") if locator else None
    if sock_path is None and (directory / SOCKET_FILE).exists():
        sock_path = str(directory / SOCKET_FILE)
    deadline = time.monotonic() + timeout
    if isinstance(signum, int) and _may_signal(pid, signum, trusted=locator is not None):
        os.kill(pid, signum)
        path = _wait_new_dump(directory, before, deadline)
    elif sock_path is not None:
        path = _ask_socket(Path(sock_path), deadline)
    else:
        _say(f"rollout dump: process {pid} has no task dumper (no handler for SIGUSR1 and no "
             f"dump socket in {directory}); sending SIGUSR1 would kill it. Run it under "
             f"pipeline.asyncio_run() or call pipeline.diagnostics.install_task_dumper().")
        return EXIT_REFUSED
    if path is not None:
        stream.write(path.read_text(encoding="utf-8"))
        stream.flush()
        _say(f"rollout dump: written to {path}")
        return EXIT_OK
    _say(f"rollout dump: no dump from process {pid} within {timeout:g}s")
    if fault_file.exists() and fault_file.stat().st_size > fault_size:
        with open(fault_file, encoding="utf-8", errors="replace") as fh:
            fh.seek(fault_size)
            stacks = fh.read()
        _say("its thread stacks, written by faulthandler (the process may be stuck in C code "
             "that holds the GIL):")
        stream.write(stacks)
        stream.flush()
    return EXIT_NO_DUMP


def add_dump_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``rollout dump``'s arguments to ``parser`` (see :func:`run_dump`)."""
    parser.add_argument("pid", type=int, help="the process to dump")
    parser.add_argument("--dir", type=Path, default=None, dest="directory",
                        help="its dump directory (default: found from the process's locator "
                             "file, or $ROLLOUT_DUMP_DIR/<pid>)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the dump (default 10)")


def run_dump(args: argparse.Namespace) -> int:
    """Run ``rollout dump`` with arguments parsed by :func:`add_dump_arguments`."""
    return dump_command(args.pid, directory=args.directory, timeout=args.timeout)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _read_locator(pid: int, uid: int | None) -> dict[str, Any] | None:
    for path in {locator_path(pid, uid), locator_path(pid)}:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("pid") == pid:
            return record
    return None


def _may_signal(pid: int, signum: int, *, trusted: bool) -> bool:
    """Send only a signal the process handles: known from /proc, or from its locator file."""
    catches = _catches(pid, signum)
    return catches is True or (trusted and catches is None)


def _catches(pid: int, signum: int) -> bool | None:
    """Whether ``pid`` has a handler for ``signum`` (Linux ``SigCgt``); None if unknown."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        return None
    return None


def _dumps(directory: Path) -> set[str]:
    try:
        return {p.name for p in directory.glob("tasks-*.txt")}
    except OSError:
        return set()


def _wait_new_dump(directory: Path, before: set[str], deadline: float) -> Path | None:
    while time.monotonic() < deadline:
        new = sorted(_dumps(directory) - before)
        if new:
            return directory / new[-1]
        time.sleep(0.05)
    return None


def _ask_socket(path: Path, deadline: float) -> Path | None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            conn.connect(os.fspath(path))
            conn.sendall(b"dump\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError as exc:
        _say(f"rollout dump: the dump socket {path} did not answer: {exc}")
        return None
    text = reply.decode("utf-8", "replace").strip()
    if not text or text.startswith("error"):
        _say(f"rollout dump: the process answered: {text or 'nothing'}")
        return None
    return Path(text)
