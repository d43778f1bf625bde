"""A writer process killed with SIGKILL mid-batch: whole lines survive, the torn tail is named."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from obs_batch import make_pipeline, rows

from pipeline.observability import TrajectoryWriter, read_trajectories

CHILD = Path(__file__).with_name("obs_kill_writer.py")


def _start(path: Path, mode: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(CHILD), str(path), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=CHILD.parent)


def _wait_for(proc: subprocess.Popen[bytes], prefix: str, timeout_s: float = 30.0) -> str:
    """The first stdout line starting with ``prefix`` (bounded wait)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline, buffer = time.monotonic() + timeout_s, b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.05)
        chunk = os.read(fd, 65536) if ready else b""
        buffer += chunk
        for line in buffer.decode(errors="replace").splitlines():
            if line.startswith(prefix):
                return line
        if ready and not chunk:  # EOF: the child ended without printing it
            break
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()
    raise AssertionError(f"child never printed {prefix!r}; output so far: {buffer[-500:]!r}")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert proc.stdout is not None
    proc.stdout.close()


async def test_sigkill_inside_a_line_leaves_whole_lines_and_a_reported_torn_tail(tmp_path):
    path = tmp_path / "dump.jsonl"
    proc = _start(path, "midline")
    _wait_for(proc, "MIDLINE")
    _kill(proc)

    data = path.read_bytes()
    assert not data.endswith(b"\n")
    whole = data[: data.rindex(b"\n") + 1]
    expected = [json.loads(line) for line in whole.splitlines()]
    assert [e["type"] for e in expected] == ["batch"] + ["sample"] * 5

    dump = read_trajectories(path)
    assert [s.uid for s in dump.samples] == [e["uid"] for e in expected[1:]]
    assert all(s.tokens is not None and s.tokens.prompt_ids for s in dump.samples)
    assert dump.ends == []  # the batch never closed
    torn = dump.torn_tail
    assert torn is not None and torn.line == 7 and torn.offset == len(whole)
    assert torn.size == len(data) - len(whole) == 64

    # The restarted run appends to the same file: the torn line is sealed and skipped.
    result = await make_pipeline().run_batch(rows(1), n=2)
    with TrajectoryWriter(path) as writer:
        writer.write_batch(result, step=1)
    dump = read_trajectories(path)
    assert dump.torn_tail is None and [b.line for b in dump.bad_lines] == [7]
    assert len(dump.samples) == 7 and [b.step for b in dump.batches] == [0, 1]


def test_sigkill_at_any_moment_loses_no_whole_line(tmp_path):
    path = tmp_path / "dump.jsonl"
    proc = _start(path, "busy")
    _wait_for(proc, "LINES 40")
    _kill(proc)

    data = path.read_bytes()
    whole_lines = data.count(b"\n")
    dump = read_trajectories(path)
    assert len(dump.samples) == whole_lines - 1 >= 40  # minus the summary line
    assert (dump.torn_tail is None) == data.endswith(b"\n")
    assert len({s.uid for s in dump.samples}) == len(dump.samples)
