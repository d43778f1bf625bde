"""``Sandbox``: run untrusted Python in a subprocess with limits, as an unprivileged user.

Each run gets a fresh temporary directory, an empty environment, rlimits (CPU time, address
space, process count, file size, open files, no core dumps), a wall-clock limit, its own
session, no network (a new network namespace where the machine allows it: no interface, no
abstract Unix socket of the host), private empty ``/tmp``, ``/var/tmp``, ``/dev/shm``,
``/run`` and temp directory (a new mount namespace with a small tmpfs on each, where the
machine allows it: no pathname socket or file of the host under them is reachable) and, when
this process runs as root, its own unprivileged uid, so that process limits apply and every
process it leaves behind can be killed (see ``_launcher.py``). Sandbox uids are leased with
``flock`` under the temp directory, so pipelines in other processes never share one. Where a
namespace is not available the run goes on without it and a warning says so, unless
``require_isolation``.

What it does not protect against: reading world-readable files, reaching pathname sockets
and writing world-writable files outside the private directories (under home directories or
``/var/lib``, say), filling the disk of the run's directory with many small files, kernel
exploits, and side channels. There is no PID namespace and no seccomp filter. Run untrusted
code on machines you can afford to lose, or behind a container / VM boundary as well. The
rule for scoring what a program does in here is in docs/sandbox.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pipeline.judgers._base import JudgeError

_logger = structlog.get_logger("pipeline.judgers")
_LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
_PYTHON_PATH = "/usr/local/bin:/usr/bin:/bin"
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
"""Hidden behind an empty tmpfs in the program's mount namespace (plus the temp directory)."""
_STARTED = b'{"started": true}'
"""The launcher's first line once the program is exec'd: from then on, a launcher that
dies or hangs is the program's doing."""


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    """Limits of one sandboxed run.

    Attributes:
        wall_s: wall-clock limit; the process group and every process of the run's uid are
            killed at it.
        cpu_s: CPU-time limit (default: ``ceil(wall_s) + 1``); SIGXCPU, then SIGKILL.
        memory_mb: address-space limit per process (Python itself needs about 30 MB).
        max_processes: processes and threads of the sandbox uid (enforced only when the
            privileges were dropped: root ignores it).
        max_file_mb: largest file the program may write (stdout and stderr included).
        max_open_files: open file descriptors per process.
        max_output_bytes: how much of stdout/stderr is kept for the report.
    """

    wall_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 1024
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 64 * 1024


@dataclass(frozen=True, slots=True)
class SandboxFacts:
    """What isolation this machine gives (probed once per sandbox)."""

    privileges_dropped: bool
    network_isolated: bool
    python: str
    network_error: str | None = None
    mounts_isolated: bool = False
    """Private ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run`` (a mount namespace)."""
    mount_error: str | None = None


@dataclass(slots=True)
class SandboxRun:
    """The outcome of one sandboxed run.

    Attributes:
        exit_code: the program's exit code, or None when a signal ended it.
        signal: the signal that ended it (9 = killed, 24 = CPU limit, 25 = file size limit).
        timed_out: it ran past the wall limit and was killed.
        stdout / stderr: the first ``max_output_bytes`` of each (UTF-8, errors replaced).
        results: what the program wrote to fd 3, when ``results=True`` was asked.
        duration_s / cpu_s: wall and CPU time of the run.
        stragglers: processes of the run's uid still alive after the program ended, killed.
        uid: the uid it ran as (None: this process's own).
        network_isolated / mounts_isolated / privileges_dropped: the isolation that
            actually applied.
    """

    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: str
    stderr: str
    results: str | None
    duration_s: float
    cpu_s: float
    stragglers: int
    uid: int | None
    network_isolated: bool
    privileges_dropped: bool
    mounts_isolated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Exited with code 0 within its limits."""
        return self.exit_code == 0 and not self.timed_out


class Sandbox:
    """Runs Python programs under :class:`SandboxLimits`; see the module doc.

    Args:
        limits: default limits of a run.
        concurrency: runs at once (default: CPU count); each holds one uid.
        uids: the uids to lease for runs when running as root (never give ones in use).
        network: allow network access (default: none, via a new network namespace).
        require_isolation: fail runs instead of running without a network or mount
            namespace when the machine does not allow one.
        private_mounts: give the program private ``/tmp``, ``/var/tmp``, ``/dev/shm``,
            ``/run`` and temp directory (turn off only if the interpreter lives there).
        python: the interpreter for programs (default: the first of this interpreter and
            the system's ``python3`` that the sandbox user may execute).
        env: environment of the program (default: empty).
        directory: where run directories are made (default: the temp directory); the
            sandbox user must be able to traverse it.
    """

    def __init__(self, limits: SandboxLimits | None = None, *, concurrency: int | None = None,
                 uids: Sequence[int] = range(61000, 62000), network: bool = False,
                 require_isolation: bool = False, python: str | None = None,
                 env: Mapping[str, str] | None = None,
                 directory: str | Path | None = None, private_mounts: bool = True) -> None:
        self.limits = limits or SandboxLimits()
        self.concurrency = concurrency or max(1, os.cpu_count() or 1)
        self.uids = list(uids)
        self.network = network
        self.require_isolation = require_isolation
        self.python = python
        self.env = dict(env or {})
        self.directory = None if directory is None else Path(directory)
        self.private_mounts = private_mounts
        self._facts: SandboxFacts | None = None
        self._probe_lock: asyncio.Lock | None = None
        self._slots: asyncio.Semaphore | None = None
        self._free: list[int | None] = []
        self._leases: list[int] = []  # open lock-file descriptors
        self._cleanups: set[asyncio.Task[None]] = set()
        self._closed = False

    async def facts(self) -> SandboxFacts:
        """Probe (once) whether privileges can be dropped and the network isolated.

        Raises:
            JudgeError: the probe failed, no interpreter is usable by the sandbox user, or
                ``require_isolation`` and the machine gives no network namespace.
        """
        if self._facts is not None:
            return self._facts
        if self._probe_lock is None:
            self._probe_lock = asyncio.Lock()
        async with self._probe_lock:
            if self._facts is None:
                self._facts = await self._probe()
        return self._facts

    async def _probe(self) -> SandboxFacts:
        drop = os.geteuid() == 0
        probe_uid = self.uids[0] if drop and self.uids else None
        if drop and probe_uid is None:
            raise JudgeError("Sandbox: running as root needs at least one uid in 'uids'")
        candidates = [self.python] if self.python else _python_candidates()
        report = await _launch({"probe": candidates, "uid": probe_uid, "gid": probe_uid,
                                "unshare_net": not self.network,
                                "private_dirs": _private_dirs() if self.private_mounts else []},
                               limit_s=30.0)
        if not report.get("ok"):
            raise JudgeError(f"sandbox probe failed: {report.get('error')}")
        if not report.get("python"):
            raise JudgeError(f"no Python interpreter the sandbox user can execute among "
                             f"{candidates}; pass Sandbox(python=...)")
        isolated = bool(report.get("network_isolation"))
        if not self.network and not isolated:
            if self.require_isolation:
                raise JudgeError(f"no network namespace on this machine "
                                 f"({report.get('network_error')}) and require_isolation=True")
            _logger.warning("sandbox_network_not_isolated", reason=report.get("network_error"))
        mounts = bool(report.get("mount_isolation"))
        if self.private_mounts and not mounts:
            if self.require_isolation:
                raise JudgeError(f"no mount namespace on this machine "
                                 f"({report.get('mount_error')}) and require_isolation=True")
            _logger.warning("sandbox_mounts_not_isolated", reason=report.get("mount_error"),
                            reachable="pathname sockets and files of the host under /tmp, "
                                      "/var/tmp, /dev/shm and /run")
        if drop:
            self._free = self._lease(self.concurrency)
        else:
            self._free = [None] * self.concurrency
        self._slots = asyncio.Semaphore(len(self._free))
        return SandboxFacts(privileges_dropped=drop, network_isolated=isolated,
                            python=report["python"], network_error=report.get("network_error"),
                            mounts_isolated=mounts, mount_error=report.get("mount_error"))

    def _lease(self, count: int) -> list[int | None]:
        """Lock ``count`` uids (flock on files under the temp dir) for this sandbox's life."""
        directory = Path(tempfile.gettempdir()) / "pipeline-sandbox-uids"
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        info = directory.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise JudgeError(f"sandbox uid lock directory {directory} is not a directory "
                             f"owned by this user; refusing to use it")
        leased: list[int | None] = []
        for uid in self.uids:
            if len(leased) == count:
                break
            fd = os.open(directory / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    continue
                raise
            self._leases.append(fd)
            leased.append(uid)
        if not leased:
            raise JudgeError(f"every sandbox uid in {self.uids[0]}..{self.uids[-1]} is leased "
                             f"by other sandboxes; pass Sandbox(uids=...)")
        return leased

    async def run(self, files: Mapping[str, str], argv: Sequence[str], *, stdin: str = "",
                  results: bool = False, limits: SandboxLimits | None = None) -> SandboxRun:
        """Run ``python -I argv...`` in a fresh directory holding ``files``.

        Args:
            files: file name -> text, written into the working directory.
            argv: arguments after the interpreter, e.g. ``["solution.py"]``.
            stdin: the program's standard input.
            results: give the program a fd 3 to write a report to (returned as ``results``).
            limits: this run's limits (default: the sandbox's).

        Raises:
            JudgeError: the sandbox itself failed (not the program: its failures are in the
                returned :class:`SandboxRun`).
        """
        if self._closed:
            raise JudgeError("the sandbox is closed")
        facts = await self.facts()
        limits = limits or self.limits
        assert self._slots is not None
        async with self._slots:
            uid = self._free.pop()
            root = Path(tempfile.mkdtemp(prefix="pipeline-sandbox-", dir=self.directory))
            try:
                cfg = _prepare(root, files, stdin, results, uid, limits, facts, self.env, argv)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", "-S", _LAUNCHER, json.dumps(cfg),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True)
            except BaseException:
                await self._release(uid, root)
                raise
            started = False
            try:
                async with asyncio.timeout(limits.wall_s + 30.0):
                    assert proc.stdout is not None
                    first = await proc.stdout.readline()
                    started = first.strip() == _STARTED
                    out, err = await proc.communicate()
            except TimeoutError:
                # The launcher hung. Once the program runs, only it can be the cause (it may
                # have stopped its supervisor when it shares our uid): a failed run, not ours.
                await self._stop(proc, uid, root)
                if not started:
                    raise JudgeError("the sandbox launcher hung before starting the program"
                                     ) from None
                return _lost(uid, limits, facts, "the launcher stopped answering",
                             timed_out=True)
            except BaseException:
                # Cancelled: stop it in a task the sandbox owns; the uid is reused only after
                # the launcher has killed everything it started.
                task = asyncio.get_running_loop().create_task(self._stop(proc, uid, root))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)
                raise
            try:
                if started and not out.strip():
                    # It died after the exec: the program (sharing our uid) killed it.
                    if uid is not None:
                        await _launch({"sweep": uid}, limit_s=30.0)
                    return _lost(uid, limits, facts, f"the launcher died "
                                 f"(exit {proc.returncode}) after starting the program")
                return _report(root, first + out, err, uid, limits, results)
            finally:
                await self._release(uid, root)

    async def _stop(self, proc: asyncio.subprocess.Process, uid: int | None, root: Path) -> None:
        try:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                async with asyncio.timeout(10.0):
                    await proc.communicate()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                await proc.communicate()
                if uid is not None:
                    await _launch({"sweep": uid}, limit_s=30.0)
        finally:
            await self._release(uid, root)

    async def _release(self, uid: int | None, root: Path) -> None:
        """Give the uid back and remove the run's directory; never raises: whatever the
        program left there is its own business, not a reason to fail the judge."""
        self._free.append(uid)
        try:  # in a thread: a program may have left thousands of files behind
            problem = await asyncio.to_thread(remove_tree, root)
        except Exception as exc:  # remove_tree catches OSError; this is a bug guard
            problem = f"{type(exc).__name__}: {exc}"
        if problem is not None:
            _logger.error("sandbox_cleanup_incomplete", directory=str(root), error=problem)

    async def aclose(self) -> None:
        """Wait for stopped runs to be cleaned up and release the leased uids."""
        self._closed = True
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        for fd in self._leases:
            os.close(fd)
        self._leases.clear()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _private_dirs() -> list[str]:
    return list(dict.fromkeys([*_PRIVATE_DIRS, os.path.realpath(tempfile.gettempdir())]))


def _python_candidates() -> list[str]:
    found = [sys.executable, os.path.realpath(sys.executable),
             getattr(sys, "_base_executable", ""), shutil.which("python3", path=_PYTHON_PATH)]
    return list(dict.fromkeys(p for p in found if p))


def _prepare(root: Path, files: Mapping[str, str], stdin: str, results: bool, uid: int | None,
             limits: SandboxLimits, facts: SandboxFacts, env: dict[str, str],
             argv: Sequence[str]) -> dict[str, Any]:
    """Lay out ``root``: ``work/`` (the program's, its cwd) and ``io/`` (ours, 0700)."""
    work, io = root / "work", root / "io"
    work.mkdir()
    io.mkdir(mode=0o700)
    for name, text in files.items():
        path = work / name
        if path.parent != work:
            raise JudgeError(f"sandbox file name {name!r} must be a plain name")
        path.write_text(text, encoding="utf-8")
    (io / "stdin").write_text(stdin, encoding="utf-8")
    for name in ("stdout", "stderr", "results"):
        (io / name).touch(mode=0o600)
    if uid is not None:
        os.chmod(root, 0o711)
        for path in (work, *work.iterdir()):
            os.chown(path, uid, uid)
        os.chmod(work, 0o700)
    cpu = limits.cpu_s if limits.cpu_s is not None else math.ceil(limits.wall_s) + 1
    return {
        "uid": uid, "gid": uid, "unshare_net": facts.network_isolated, "wall_s": limits.wall_s,
        "private_dirs": _private_dirs() if facts.mounts_isolated else [],
        "private_mb": max(16, 4 * limits.max_file_mb),
        "cwd": str(work), "argv": [facts.python, "-I", "-X", "utf8", *argv], "env": env,
        "stdin": str(io / "stdin"), "stdout": str(io / "stdout"), "stderr": str(io / "stderr"),
        "results": str(io / "results") if results else None,
        "limits": {"cpu_s": max(1, math.ceil(cpu)), "as_bytes": limits.memory_mb << 20,
                   "nproc": limits.max_processes, "fsize": limits.max_file_mb << 20,
                   "nofile": limits.max_open_files},
    }


def _head(path: Path, limit: int) -> str:
    """The first ``limit`` bytes of a regular file; "" for anything else (a program sharing
    our uid may have swapped it for a fifo or a symlink)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        try:
            return fh.read(limit).decode("utf-8", errors="replace")
        except OSError:
            return ""


def _lost(uid: int | None, limits: SandboxLimits, facts: SandboxFacts, why: str, *,
          timed_out: bool = False) -> SandboxRun:
    """A run whose supervisor the program took down: a failed run, with no outcome."""
    return SandboxRun(exit_code=None, signal=None, timed_out=timed_out, stdout="",
                      stderr=f"sandbox: {why}", results="", duration_s=limits.wall_s, cpu_s=0.0,
                      stragglers=0, uid=uid, network_isolated=facts.network_isolated,
                      privileges_dropped=facts.privileges_dropped,
                      mounts_isolated=facts.mounts_isolated, extra={"supervisor_lost": why})


def remove_tree(root: Path) -> str | None:
    """Remove ``root`` and everything in it, whatever a program made of it.

    Iterative and descriptor-based, so depth is no limit (no recursion, no path longer than
    one name); symlinks are unlinked, never followed; fifos, sockets and devices are just
    names; directories made unreadable (mode 000) are opened again after a chmod.

    Returns:
        None when ``root`` is gone, else what stopped it (it never raises).
    """
    try:
        fd = _open_dir(str(root), None)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot open {root}: {exc}"
    problem: str | None = None
    stack: list[tuple[str, list[str]]] = [("", _clear_files(fd))]
    try:
        while True:
            name, subdirs = stack[-1]
            if subdirs:
                child = subdirs.pop()
                try:
                    child_fd = _open_dir(child, fd)
                except OSError:
                    with contextlib.suppress(OSError):  # it changed under us: a plain name
                        os.unlink(child, dir_fd=fd)
                    continue
                os.close(fd)
                fd = child_fd
                stack.append((child, _clear_files(fd)))
                continue
            stack.pop()
            if not stack:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as exc:
                problem = problem or f"{name}: {exc}"
    except OSError as exc:
        problem = f"{type(exc).__name__}: {exc}"
    finally:
        os.close(fd)
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return problem or f"{root}: {exc}"
    return None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, dir_fd: int | None) -> int:
    """Open directory ``name`` without following a symlink; make it ours to read first if
    its mode shuts us out (as root that never happens)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            raise
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _clear_files(fd: int) -> list[str]:
    """Unlink every non-directory in the open directory; return its subdirectories."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o700)  # a directory the program made read-only (ours when not root)
    subdirs: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append(entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)
            except OSError:
                continue
    return subdirs


def _report(root: Path, out: bytes, err: bytes, uid: int | None, limits: SandboxLimits,
            results: bool) -> SandboxRun:
    try:
        report = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise JudgeError(f"sandbox launcher failed: {err.decode(errors='replace')[-2000:]}"
                         ) from None
    if not report.get("ok"):
        raise JudgeError(f"sandbox launcher failed: {report.get('error')}")
    if report.get("setup_error"):
        raise JudgeError(f"sandbox could not start the program: {report['setup_error']}")
    io = root / "io"
    return SandboxRun(
        exit_code=report["exit_code"], signal=report["signal"], timed_out=report["timed_out"],
        stdout=_head(io / "stdout", limits.max_output_bytes),
        stderr=_head(io / "stderr", limits.max_output_bytes),
        results=_head(io / "results", 1 << 20) if results else None,
        duration_s=report["wall_s"], cpu_s=report["cpu_s"], stragglers=report["stragglers"],
        uid=uid, network_isolated=report["network_isolated"],
        privileges_dropped=report["privileges_dropped"],
        mounts_isolated=bool(report.get("mounts_isolated")),
        extra={"max_rss_kb": report.get("max_rss_kb"), "stopped": report.get("stopped")})


async def _launch(cfg: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """Run the launcher for a probe or a sweep and return its report."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", _LAUNCHER, json.dumps(cfg), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        raise
    try:
        report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "error": err.decode(errors="replace")[-2000:]}
    return report
