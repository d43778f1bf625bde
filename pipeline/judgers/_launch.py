"""The sandbox's side of the launcher (``_launcher.py``, run in its own interpreter).

A run's directory is laid out here and described to the launcher as one JSON config
(:func:`prepare_run`); its report, and the program's output it left in the directory, are read
back into a :class:`SandboxRun` (:func:`read_report`). The launcher also probes the machine's
isolation and sweeps a uid's leftover processes (:func:`launch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.judgers._base import JudgeError
from pipeline.judgers._sandbox_run import SandboxFacts, SandboxLimits, SandboxRun

LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
"""The launcher script, run as ``python -I -S LAUNCHER '<json config>'``."""
_PYTHON_PATH = "/usr/local/bin:/usr/bin:/bin"
_PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
"""Hidden behind an empty tmpfs in the program's mount namespace (plus the temp directory)."""
STARTED = b'{"started": true}'
"""The launcher's first line once the program is exec'd: from then on, a launcher that
dies or hangs is the program's doing."""


def private_dirs() -> list[str]:
    """The directories a run gets private, empty copies of (the temp directory included)."""
    return list(dict.fromkeys([*_PRIVATE_DIRS, os.path.realpath(tempfile.gettempdir())]))


def python_candidates() -> list[str]:
    """Interpreters to try for programs, in order (the probe keeps the first usable one)."""
    found = [sys.executable, os.path.realpath(sys.executable),
             getattr(sys, "_base_executable", ""), shutil.which("python3", path=_PYTHON_PATH)]
    return list(dict.fromkeys(p for p in found if p))


def prepare_run(root: Path, files: Mapping[str, str], stdin: str, results: bool,
                uid: int | None, limits: SandboxLimits, facts: SandboxFacts,
                env: dict[str, str], argv: Sequence[str]) -> dict[str, Any]:
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
        "private_dirs": private_dirs() if facts.mounts_isolated else [],
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


def lost_run(uid: int | None, limits: SandboxLimits, facts: SandboxFacts, why: str, *,
             timed_out: bool = False) -> SandboxRun:
    """A run whose supervisor the program took down: a failed run, with no outcome."""
    return SandboxRun(exit_code=None, signal=None, timed_out=timed_out, stdout="",
                      stderr=f"sandbox: {why}", results="", duration_s=limits.wall_s, cpu_s=0.0,
                      stragglers=0, uid=uid, network_isolated=facts.network_isolated,
                      privileges_dropped=facts.privileges_dropped,
                      mounts_isolated=facts.mounts_isolated, extra={"supervisor_lost": why})


def read_report(root: Path, out: bytes, err: bytes, uid: int | None, limits: SandboxLimits,
                results: bool) -> SandboxRun:
    """The run's outcome from the launcher's report (its last line on stdout) and the
    program's output files.

    Raises:
        JudgeError: the launcher failed, or could not start the program.
    """
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


async def launch(cfg: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """Run the launcher for a probe or a sweep and return its report."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg), stdout=asyncio.subprocess.PIPE,
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
