"""``rollout dump PID``: ask a running process for a task dump and print it.

The process's locator file (see :mod:`pipeline.diagnostics._paths`) says where it writes
dumps and how to ask. It is looked for in the bases the process may have used: its own
``$ROLLOUT_DUMP_DIR`` and ``$TMPDIR`` (read from ``/proc/<pid>/environ``), the default base,
and the private fallback bases of its uid; only a locator owned by the process's uid, in a
directory it owns, counts. The locator says how to ask: by signal when the process
installed one, else through its dump socket. The command refuses to send a signal the
process does not handle (SIGUSR1's default action would kill it). When no dump comes in
time, it prints what ``faulthandler`` wrote for the signal instead: the thread stacks of a
process stuck in C code that holds the GIL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from pipeline.diagnostics._paths import (
    DUMP_DIR_ENV,
    FALLBACK_PREFIX,
    FAULTHANDLER_FILE,
    SOCKET_FILE,
    dump_base_dir,
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
            ``<its $ROLLOUT_DUMP_DIR or the default base>/<pid>``).
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
    env = _environ(pid)
    locator = _find_locator(pid, uid, env)
    if directory is None:
        directory = Path(locator["directory"]) if locator else _bases(pid, uid, env)[0] / str(pid)
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


def _environ(pid: int) -> dict[str, str]:
    """The process's environment at its start (readable by its owner and root), else {}."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode("utf-8", "surrogateescape").partition("=")
             for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def _bases(pid: int, uid: int | None, env: dict[str, str]) -> list[Path]:
    """The dump bases process ``pid`` may have used, most likely first."""
    owner = os.geteuid() if uid is None else uid
    bases = [Path(env[DUMP_DIR_ENV])] if env.get(DUMP_DIR_ENV) else []
    temps = [Path(env["TMPDIR"])] if env.get("TMPDIR") else []
    temps.append(Path(tempfile.gettempdir()))
    for temp in temps:
        bases.append(temp / f"rollout-dumps-{owner}")
        with contextlib.suppress(OSError):
            bases.extend(sorted(temp.glob(FALLBACK_PREFIX.format(uid=owner) + "*")))
    bases.append(dump_base_dir(uid))
    return list(dict.fromkeys(bases))


def _find_locator(pid: int, uid: int | None, env: dict[str, str]) -> dict[str, Any] | None:
    """The newest locator of ``pid`` written since it started, owned by its uid."""
    owner = os.geteuid() if uid is None else uid
    started = _started_at(pid)
    best: tuple[float, dict[str, Any]] | None = None
    for base in _bases(pid, uid, env):
        found = _read_owned(base, f"{pid}.json", owner)
        if found is None:
            continue
        mtime, record = found
        if record.get("pid") != pid or (started is not None and mtime < started - 2.0):
            continue  # another process's, or one of an earlier process with this pid
        if best is None or mtime > best[0]:
            best = (mtime, record)
    return None if best is None else best[1]


def _read_owned(base: Path, name: str, owner: int) -> tuple[float, dict[str, Any]] | None:
    """``(mtime, record)`` of JSON file ``base/name`` if ``owner`` owns it and ``base``."""
    try:
        info = os.lstat(base)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != owner:
            return None
        fd = os.open(base / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, encoding="utf-8") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != owner:
                return None
            record = json.loads(fh.read(1 << 16))
    except (OSError, ValueError):
        return None
    return (info.st_mtime, record) if isinstance(record, dict) else None


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (wall clock, to about 10 ms), from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        with open("/proc/stat") as fh:
            boot = next(float(line.split()[1]) for line in fh if line.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
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
