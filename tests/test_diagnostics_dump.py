"""The task dumper across a process boundary: real child processes, real signals.

Each test starts ``tests/diag_child.py`` (a pipeline whose samples are stuck on an Event
that is never set), waits for it to say it is ready, and asks it for a dump while its event
loop idles or while its loop thread is blocked in ``time.sleep``, a pure-Python loop, a
lock, or C code holding the GIL.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.diagnostics import DUMP_DIR_ENV, DiagnosticsError, TaskDumper
from pipeline.diagnostics._cli import dump_command
from pipeline.diagnostics._paths import UnsafeDirectoryError, open_private_dir, write_atomic

CHILD = Path(__file__).with_name("diag_child.py")
READY_TIMEOUT_S = 30.0


@dataclass
class Child:
    proc: subprocess.Popen[bytes]
    base: Path
    uids: list[str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def directory(self) -> Path:
        return self.base / str(self.pid)

    def log(self) -> str:
        return (self.base / "child.log").read_text(errors="replace")


@pytest.fixture
def spawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Start diag_child.py in a mode; every child is killed when the test ends."""
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    children: list[subprocess.Popen[bytes]] = []

    def start(mode: str, *extra: str, wait_ready: bool = True,
              env: dict[str, str] | None = None) -> Child:
        """``env`` replaces the child's ROLLOUT_DUMP_DIR (default: the test's directory)."""
        child_env = {**os.environ, "DIAG_READY_DIR": str(tmp_path)}
        child_env.pop(DUMP_DIR_ENV, None)
        child_env.update({DUMP_DIR_ENV: str(tmp_path)} if env is None else env)
        log = open(tmp_path / "child.log", "ab")  # closed below
        try:
            proc = subprocess.Popen([sys.executable, str(CHILD), mode, *extra],
                                    stdout=log, stderr=subprocess.STDOUT, env=child_env)
        finally:
            log.close()
        children.append(proc)
        child = Child(proc, tmp_path, [])
        if wait_ready:
            ready = tmp_path / f"ready-{proc.pid}"
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not ready.exists():
                assert proc.poll() is None, f"child exited early:\n{child.log()}"
                assert time.monotonic() < deadline, f"child not ready:\n{child.log()}"
                time.sleep(0.02)
            time.sleep(0.05)  # the mode's blocking call starts right after the file
            child.uids = ready.read_text().split()
        return child

    yield start
    for proc in children:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def _ask(child: Child, timeout: float = 10.0) -> tuple[int, str]:
    out = io.StringIO()
    code = dump_command(child.pid, timeout=timeout, out=out)
    return code, out.getvalue()


def _assert_names_stuck_samples(text: str, child: Child) -> None:
    assert len(child.uids) == 3
    for uid in child.uids:
        assert f"uid={uid} " in text
    assert "stage=wait_forever" in text
    assert "awaiting Event.wait() on <asyncio.locks.Event" in text
    assert "[unset" in text
    assert "in WaitForever.run" in text  # where the stage waits


def test_sigusr1_on_idle_loop_dumps_stuck_samples_their_stage_and_awaited_event(spawn):
    child = spawn("idle")
    os.kill(child.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not list(child.directory.glob("tasks-*.json")):  # the .json comes after the .txt
        assert time.monotonic() < deadline, child.log()
        time.sleep(0.02)
    [path] = child.directory.glob("tasks-*.txt")
    text = path.read_text()
    assert "reason=signal SIGUSR1" in text
    _assert_names_stuck_samples(text, child)
    assert "3 x pending" in text  # the identical stuck tasks read as one group
    assert "task_dump_written" in child.log() and str(path) in child.log()
    data = json.loads(path.with_suffix(".json").read_text())
    assert sorted(s["uid"] for s in data["samples"]) == sorted(child.uids)
    assert {s["stage"] for s in data["samples"]} == {"wait_forever"}
    assert child.proc.poll() is None  # the signal did not kill it


@pytest.mark.parametrize(("mode", "blocker"), [
    ("sleep", "block_in_sleep"), ("spin", "busy_spin"), ("lock", "wait_on_lock")])
def test_dump_appears_while_the_loop_thread_is_blocked_and_shows_the_blocking_frame(
        spawn, mode, blocker):
    child = spawn(mode)
    code, text = _ask(child)
    assert code == 0, child.log()
    _assert_names_stuck_samples(text, child)
    tasks = text.split("== asyncio tasks")[1]
    assert "1 x running" in tasks and "-- blocking the event loop in:" in tasks
    assert f"in {blocker}" in tasks.split("-- blocking the event loop in:")[1].split("\n\n")[0]
    threads = text.split("== threads")[1]
    main = threads.split("thread MainThread")[1].split("\nthread ")[0]
    assert "(event loop)" in main and main.rstrip().endswith(f"in {blocker}")


def test_uvloop_idle_and_blocked(spawn):
    child = spawn("sleep", "--loop", "uvloop")
    code, text = _ask(child)
    assert code == 0, child.log()
    assert "uvloop.Loop thread=MainThread current_task=Task-1" in text
    _assert_names_stuck_samples(text, child)
    assert "in block_in_sleep" in text
    idle = spawn("idle", "--loop", "uvloop")
    code, text = _ask(idle)
    assert code == 0, idle.log()
    _assert_names_stuck_samples(text, idle)


def test_loop_in_a_worker_thread_is_dumped_through_the_socket(spawn):
    child = spawn("thread")
    locator = json.loads((child.base / f"{child.pid}.json").read_text())
    assert locator["signal"] is None and locator["socket"]
    code, text = _ask(child)
    assert code == 0, child.log()
    assert "reason=socket request" in text
    assert "thread=rollout-worker" in text
    _assert_names_stuck_samples(text, child)


def test_gil_held_in_c_code_falls_back_to_faulthandler_stacks(spawn):
    child = spawn("cgil")
    code, text = _ask(child, timeout=1.5)
    assert code == 1  # no Python-level dump can be taken while C code holds the GIL
    assert "hold_gil_in_c" in text  # faulthandler wrote the main thread's stack at once
    assert "Current thread" in text or "Thread 0x" in text


def test_hard_limit_writes_a_dump_and_exits_nonzero(spawn):
    child = spawn("hardlimit")
    assert child.proc.wait(timeout=30) == 70
    [path] = child.directory.glob("tasks-*.txt")
    text = path.read_text()
    assert "reason=hard limit: event loop blocked" in text
    assert "in block_in_sleep" in text
    _assert_names_stuck_samples(text, child)
    assert "watchdog_exit" in child.log()


def test_refuses_to_signal_a_process_without_a_dumper(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert dump_command(proc.pid, timeout=1.0) == 2
        assert "would kill it" in capsys.readouterr().err
        time.sleep(0.1)
        assert proc.poll() is None  # still alive: no SIGUSR1 was sent
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_missing_process(capsys):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=10)
    assert dump_command(proc.pid, timeout=0.5) == 1
    assert f"no process {proc.pid}" in capsys.readouterr().err


# --- the dump directory against another local user -------------------------------------

NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path=os.defpath)
needs_root = pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None,
                                reason="needs root and a system python3 to act as another uid")


def as_nobody(script: str, *args: str) -> None:
    """Run ``script`` as another user (uid 65534): a real process, a real uid."""
    assert SYSTEM_PYTHON is not None
    done = subprocess.run([SYSTEM_PYTHON, "-I", "-c", script, *args], user=NOBODY,
                          group=NOBODY, extra_groups=[], capture_output=True, timeout=30,
                          cwd="/")
    assert done.returncode == 0, done.stderr.decode(errors="replace")


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A world-writable sticky directory like /tmp, that other users can reach."""
    path = Path(tempfile.mkdtemp(prefix="diag-shared-"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _owners(path: Path) -> set[int]:
    return {p.lstat().st_uid for p in path.rglob("*")}


PLANT_DIR = """
import os, sys, json
base, fake = sys.argv[1], sys.argv[2]
os.mkdir(base); os.chmod(base, 0o777)
os.mkdir(fake)
open(os.path.join(fake, "tasks-99999999T000000.000000Z-1.txt"), "w").write("forged dump")
"""
PLANT_LINK = """
import os, sys
os.symlink(sys.argv[3], sys.argv[1])
"""
SWAP = """
import os, sys, json
base, pid, victim, fake = sys.argv[1:]
target = os.path.join(base, pid)
if os.path.lexists(target):
    os.rename(target, target + ".moved")
os.symlink(victim, target)
with open(os.path.join(base, pid + ".json"), "w") as fh:
    json.dump({"pid": int(pid), "directory": fake, "signal": None, "socket": None}, fh)
"""


@needs_root
@pytest.mark.parametrize("planted", ["directory", "symlink"])
def test_a_dump_base_planted_by_another_user_is_refused(spawn, shared_tmp, tmp_path,
                                                        monkeypatch, planted):
    """Another uid creates the default base first (a world-writable directory, or a symlink
    to a directory of ours) and later swaps ``<pid>`` for a symlink and forges a locator:
    the trainer writes nothing there, dumps to a private fallback, and ``rollout dump`` finds
    the real dump."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    base = shared_tmp / f"rollout-dumps-{os.geteuid()}"
    fake = shared_tmp / "forged"
    as_nobody(PLANT_DIR if planted == "directory" else PLANT_LINK, str(base), str(fake),
              str(victim))
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    child = spawn("idle", env={"TMPDIR": str(shared_tmp)})
    log = child.log()
    assert "dump_dir_fallback" in log and str(base) in log, log
    if planted == "directory":
        as_nobody(SWAP, str(base), str(child.pid), str(victim), str(fake))
    code, text = _ask(child)
    assert code == 0, child.log()
    _assert_names_stuck_samples(text, child)
    [path] = shared_tmp.glob(f"rollout-dumps-{os.geteuid()}-*/{child.pid}/tasks-*.txt")
    fallback = path.parent.parent
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert fallback.stat().st_uid == os.geteuid()
    assert list(victim.iterdir()) == []  # nothing written through the planted links
    if planted == "directory":
        assert _owners(base) == {NOBODY}  # the trainer created nothing in the planted base


@needs_root
def test_dump_base_owned_by_another_user_is_refused_even_as_an_explicit_directory(
        shared_tmp, tmp_path):
    theirs = shared_tmp / "theirs"
    as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o700)", str(theirs))
    with pytest.raises(UnsafeDirectoryError, match="owned by uid"):
        os.close(open_private_dir(theirs))
    with pytest.raises(DiagnosticsError, match="unsafe dump path"):
        TaskDumper(theirs / "dumps", signum=None, trigger_socket=False).install()
    assert not (theirs / "dumps").exists()


def test_open_private_dir_checks_every_directory_on_the_way(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # writable by others and not sticky: anyone may swap entries
    with pytest.raises(UnsafeDirectoryError, match="not sticky"):
        os.close(open_private_dir(open_dir / "dumps"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "link").symlink_to(mine)
    with pytest.raises(UnsafeDirectoryError, match="symlink"):
        os.close(open_private_dir(tmp_path / "link"))  # the directory itself: never a link
    fd = open_private_dir(tmp_path / "link" / "a" / "b")  # our own link on the way: followed
    try:
        assert os.path.samestat(os.fstat(fd), (mine / "a" / "b").stat())
        assert stat.S_IMODE((mine / "a").stat().st_mode) == 0o700
        # A symlink standing where a dump goes is replaced, its target never written.
        target = tmp_path / "target.txt"
        target.write_text("keep")
        (mine / "a" / "b" / "tasks-1.txt").symlink_to(target)
        write_atomic(fd, "tasks-1.txt", "dump")
        assert target.read_text() == "keep"
        assert (mine / "a" / "b" / "tasks-1.txt").read_text() == "dump"
    finally:
        os.close(fd)


def test_rollout_dump_finds_a_process_started_with_rollout_dump_dir(spawn, tmp_path,
                                                                   monkeypatch):
    """The command's own environment lacks ROLLOUT_DUMP_DIR: the target's is read instead."""
    custom = tmp_path / "custom-dumps"
    child = spawn("idle", env={DUMP_DIR_ENV: str(custom)})
    monkeypatch.delenv(DUMP_DIR_ENV, raising=False)
    code, text = _ask(child, timeout=10.0)
    assert code == 0, child.log()
    _assert_names_stuck_samples(text, child)
    assert list((custom / str(child.pid)).glob("tasks-*.txt"))
