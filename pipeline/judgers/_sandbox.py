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
import os
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from pipeline.judgers._base import JudgeError
from pipeline.judgers._launch import (
    LAUNCHER,
    STARTED,
    launch,
    lost_run,
    prepare_run,
    private_dirs,
    python_candidates,
    read_report,
)
from pipeline.judgers._rmtree import remove_tree
from pipeline.judgers._sandbox_run import SandboxFacts, SandboxLimits, SandboxRun

_logger = structlog.get_logger("pipeline.judgers")


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
        candidates = [self.python] if self.python else python_candidates()
        report = await launch({"probe": candidates, "uid": probe_uid, "gid": probe_uid,
                               "unshare_net": not self.network,
                               "private_dirs": private_dirs() if self.private_mounts else []},
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
                cfg = prepare_run(root, files, stdin, results, uid, limits, facts, self.env, argv)
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True)
            except BaseException:
                await self._release(uid, root)
                raise
            return await self._supervise(proc, uid, root, limits, facts, results)

    async def _supervise(self, proc: asyncio.subprocess.Process, uid: int | None, root: Path,
                         limits: SandboxLimits, facts: SandboxFacts,
                         results: bool) -> SandboxRun:
        """Wait for a started launcher and read its outcome; the uid and directory are
        released here, or by the cleanup task when cancelled."""
        started = False
        try:
            async with asyncio.timeout(limits.wall_s + 30.0):
                assert proc.stdout is not None
                first = await proc.stdout.readline()
                started = first.strip() == STARTED
                out, err = await proc.communicate()
        except TimeoutError:
            # The launcher hung. Once the program runs, only it can be the cause (it may
            # have stopped its supervisor when it shares our uid): a failed run, not ours.
            await self._stop(proc, uid, root)
            if not started:
                raise JudgeError("the sandbox launcher hung before starting the program"
                                 ) from None
            return lost_run(uid, limits, facts, "the launcher stopped answering",
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
                    await launch({"sweep": uid}, limit_s=30.0)
                return lost_run(uid, limits, facts, f"the launcher died "
                                f"(exit {proc.returncode}) after starting the program")
            return read_report(root, first + out, err, uid, limits, results)
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
                    await launch({"sweep": uid}, limit_s=30.0)
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
