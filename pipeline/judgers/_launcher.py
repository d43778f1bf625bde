"""Sandbox launcher: supervises one untrusted program. Started by ``Sandbox`` as a script.

Runs as the parent's user (root on the training machines) with only the standard library:

1. optionally enters a new network namespace (``unshare(CLONE_NEWNET)``: no interface but a
   down loopback, so no network and no abstract Unix socket of the host) and a new mount
   namespace where ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run`` are fresh, empty tmpfs
   (``unshare(CLONE_NEWNS)``: no pathname socket or file of the host under them is
   reachable; they vanish with the namespace). The run's own files, under the host's temp
   directory, are opened before and reached by descriptor (the program's cwd);
2. becomes a child subreaper, so every descendant of the program is re-parented here;
3. forks the program: new session, stdio from files, rlimits (CPU, address space, processes,
   file size, open files, no core), then drops to the sandbox uid/gid with no supplementary
   groups, ``no_new_privs`` and a parent-death SIGKILL, and execs it in an empty environment;
4. waits up to the wall limit (SIGTERM stops it early: the parent was cancelled or died);
5. kills the program's process group and then every process of the sandbox uid: a process
   that calls ``kill(-1, SIGKILL)`` as that uid kills them all in one kernel pass (new forks
   cannot slip through), repeated until ``/proc`` shows none; then reaps every zombie;
6. prints one JSON line with the outcome (after ``{"started": true}`` once the program was
   exec'd: a launcher that dies or hangs after that line was taken down by the program).

The configuration is a JSON object in ``argv[1]``; ``{"sweep": uid}`` only does step 5 and
``{"probe": [...]}`` reports what this machine allows.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
from typing import Any

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_NOSUID = 2
MS_NODEV = 4
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
_LIBC = ctypes.CDLL(None, use_errno=True)


class _Stop(Exception):
    pass


def _on_term(signum: int, frame: Any) -> None:
    raise _Stop


def _prctl(option: int, value: int) -> bool:
    return bool(_LIBC.prctl(option, value, 0, 0, 0) == 0)


def _unshare_net() -> str | None:
    if _LIBC.unshare(CLONE_NEWNET) == 0:
        return None
    return os.strerror(ctypes.get_errno())


def _private_mounts(paths: list[str], size_mb: int) -> str | None:
    """Enter a new mount namespace with an empty tmpfs on each existing directory of
    ``paths``; None on success, else why not (then nothing was mounted)."""
    if _LIBC.unshare(CLONE_NEWNS) != 0:
        return "unshare(CLONE_NEWNS): " + os.strerror(ctypes.get_errno())
    # Mounts made here must not propagate back to the host's namespace.
    if _LIBC.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return "making / private: " + os.strerror(ctypes.get_errno())
    options = f"size={size_mb}m,nr_inodes=16384,mode=1777".encode()
    for path in paths:
        if os.path.islink(path) or not os.path.isdir(path):
            continue  # e.g. /var/run -> /run is covered through its target
        if _LIBC.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
            return f"tmpfs on {path}: " + os.strerror(ctypes.get_errno())
    return None


def _pids_of(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat("/proc/" + name).st_uid == uid:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _sweep(uid: int) -> int:
    """Kill every process of ``uid``; return how many were found alive at first."""
    found = len(_pids_of(uid))
    for _ in range(200):
        if not _pids_of(uid):
            break
        killer = os.fork()
        if killer == 0:
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(killer, 0)
        _reap_all()
        time.sleep(0.002)
    _reap_all()
    return found


def _child(cfg: dict[str, Any], fds: list[int], cwd: int, status_w: int) -> None:
    """In the forked child: set limits, drop privileges, exec. Never returns."""
    try:
        os.setsid()
        os.fchdir(cwd)  # by descriptor: its path may lie under a private tmpfs now
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(len(fds), status_w)
        os.closerange(status_w + 1, 65536)
        limits = dict(cfg["limits"])
        if cfg["uid"] is None:  # not root: the limit counts every process of our own user
            limits["nproc"] = int(limits["nproc"]) + len(_pids_of(os.getuid()))
        cpu = int(limits["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        for name, key in (("RLIMIT_AS", "as_bytes"), ("RLIMIT_NPROC", "nproc"),
                          ("RLIMIT_FSIZE", "fsize"), ("RLIMIT_NOFILE", "nofile")):
            value = int(limits[key])
            resource.setrlimit(getattr(resource, name), (value, value))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    except BaseException as exc:
        try:
            os.write(status_w, f"{type(exc).__name__}: {exc}".encode()[:2000])
        finally:
            os._exit(127)


def _wait(pid: int, timeout: float) -> int | None:
    """The wait status of ``pid`` if it exits within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.005))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _run(cfg: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {"ok": True, "network_isolated": False, "mounts_isolated": False,
                              "privileges_dropped": cfg["uid"] is not None}
    # Opened before any mount: they may lie under a directory about to be hidden.
    fds = [os.open(cfg["stdin"], os.O_RDONLY), os.open(cfg["stdout"], os.O_WRONLY),
           os.open(cfg["stderr"], os.O_WRONLY)]
    if cfg.get("results"):
        fds.append(os.open(cfg["results"], os.O_WRONLY))
    cwd = os.open(cfg["cwd"], os.O_RDONLY | os.O_DIRECTORY)
    if cfg["unshare_net"]:
        error = _unshare_net()
        if error is not None:
            return {"ok": False, "error": f"network isolation failed: {error}"}
        report["network_isolated"] = True
    if cfg.get("private_dirs"):
        error = _private_mounts(cfg["private_dirs"], int(cfg.get("private_mb", 64)))
        if error is not None:
            return {"ok": False, "error": f"mount isolation failed: {error}"}
        report["mounts_isolated"] = True
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    status_r, status_w = os.pipe()  # close-on-exec: EOF tells that exec succeeded
    start = time.monotonic()
    setup_error = ""
    stopped = False
    status = None
    pid = os.fork()
    if pid == 0:
        _child(cfg, fds, cwd, status_w)
    try:
        os.close(status_w)
        for fd in (*fds, cwd):
            os.close(fd)
        setup_error = os.read(status_r, 4096).decode(errors="replace")
        if not setup_error:
            # From here on whatever happens to us is the program's doing: say so first.
            sys.stdout.write(json.dumps({"started": True}) + "\n")
            sys.stdout.flush()
            status = _wait(pid, cfg["wall_s"])
    except _Stop:
        stopped = True
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from here on, finish the clean-up
    os.close(status_r)
    timed_out = status is None and not setup_error and not stopped
    if status is None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    report["wall_s"] = time.monotonic() - start
    report["stragglers"] = _sweep(cfg["uid"]) if cfg["uid"] is not None else 0
    if cfg["uid"] is None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _reap_all()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report.update(
        exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        timed_out=timed_out, stopped=stopped, setup_error=setup_error or None,
        cpu_s=usage.ru_utime + usage.ru_stime, max_rss_kb=usage.ru_maxrss)
    return report


def _probe(cfg: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = {"ok": True, "network_error": None, "python": None,
                              "mount_error": None}
    if cfg["unshare_net"]:
        report["network_error"] = _unshare_net()
    report["network_isolation"] = cfg["unshare_net"] and report["network_error"] is None
    if cfg.get("private_dirs"):  # the interpreter must still be there once they are hidden
        report["mount_error"] = _private_mounts(cfg["private_dirs"], 1)
    report["mount_isolation"] = bool(cfg.get("private_dirs")) and report["mount_error"] is None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        found = ""
        try:
            os.close(read_end)
            if cfg["uid"] is not None:
                os.setgroups([])
                os.setgid(cfg["gid"])
                os.setuid(cfg["uid"])
            found = next((p for p in cfg["probe"] if p and os.access(p, os.X_OK)), "")
        finally:
            os.write(write_end, found.encode())
            os._exit(0)
    os.close(write_end)
    report["python"] = os.read(read_end, 4096).decode() or None
    os.close(read_end)
    os.waitpid(pid, 0)
    return report


def main() -> None:
    signal.signal(signal.SIGTERM, _on_term)
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    cfg = json.loads(sys.argv[1])
    report: dict[str, Any]
    try:
        if "sweep" in cfg:
            report = {"ok": True, "stragglers": _sweep(int(cfg["sweep"]))}
        elif "probe" in cfg:
            report = _probe(cfg)
        else:
            report = _run(cfg)
    except _Stop:
        report = {"ok": False, "error": "stopped before the program started"}
    except Exception as exc:
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
