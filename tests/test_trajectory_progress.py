"""Live progress: redrawn in place on a real terminal (a pty), logged elsewhere."""

from __future__ import annotations

import asyncio
import io
import os
import select

from obs_batch import make_pipeline, rows

from pipeline.observability import BatchProgress, TrajectoryWriter, chain_callbacks
from pipeline.testing import capture_logs


def _drain(fd: int) -> bytes:
    out = b""
    while select.select([fd], [], [], 0.05)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other side closed
            break
        if not chunk:
            break
        out += chunk
    return out


def test_terminal_progress_shows_live_counts(tmp_path):
    master, slave = os.openpty()
    try:
        with open(slave, "w", encoding="utf-8", closefd=True) as term:
            progress = BatchProgress(total=12, stream=term, refresh_s=0.0)
            assert progress.tty
            writer = TrajectoryWriter(tmp_path / "dump.jsonl")
            asyncio.run(make_pipeline().run_batch(
                rows(6), n=2, on_sample_done=chain_callbacks(writer.write, None, progress)))
            progress.close()
            writer.close()
            screen = _drain(master).decode()
    finally:
        os.close(master)
    frames = [f.replace("\x1b[K", "") for f in screen.split("\r") if f.strip()]
    assert len(frames) == 12  # one redraw per sample (refresh_s=0)
    assert frames[0].startswith("rollout 1/12 [")
    last = frames[-1].strip()
    assert last.startswith("rollout 12/12 [" + "#" * 24 + "]")
    assert "done 8 failed 2 timeout 2" in last and "aborted" not in last
    assert screen.endswith("\n")
    assert writer.written == 12


def test_plain_output_logs_periodic_events():
    now = [0.0]
    with capture_logs() as logs:
        progress = BatchProgress(total=10, stream=io.StringIO(), log_every_s=5.0,
                                 clock=lambda: now[0])
        assert not progress.tty
        for i in range(10):
            now[0] = float(i * 2)
            progress.update("completed" if i % 3 else "timeout")
        progress.close()
    events = [e for e in logs if e["event"] == "rollout_progress"]
    # Samples end at t = 0, 2, 4, ...: events at t = 6 and 12, then the last sample's.
    assert [e["finished"] for e in events] == [4, 7, 10]
    assert [e["final"] for e in events] == [False, False, True]
    assert (events[-1]["completed"], events[-1]["timeout"], events[-1]["failed"]) == (6, 4, 0)
    assert progress.stream.getvalue() == ""


def test_render_without_total_and_eta():
    now = [0.0]
    progress = BatchProgress(stream=io.StringIO(), tty=True, clock=lambda: now[0])
    now[0] = 2.0
    progress.update("failed")
    progress.update("aborted")
    assert progress.render().startswith("rollout 2 done 0 failed 1 timeout 0 aborted 1 | 1.0/s")
    bounded = BatchProgress(total=4, stream=io.StringIO(), tty=True, clock=lambda: now[0])
    now[0] = 4.0
    bounded.update("completed")
    assert bounded.render().endswith("eta 6s")


def test_chain_calls_every_callback_in_order():
    seen: list[str] = []
    chained = chain_callbacks(lambda i, s: seen.append("a"), None, lambda i, s: seen.append("b"))
    chained(None, None)  # type: ignore[arg-type]
    assert seen == ["a", "b"]
