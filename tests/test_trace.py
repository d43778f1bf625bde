"""Timelines: a real batch's dump as Chrome/Perfetto trace events."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
from obs_batch import make_pipeline, rows

from pipeline import Status
from pipeline.observability import (
    StageTiming,
    TrajectoryWriter,
    build_trace,
    read_trajectories,
    stage_category,
    trace_command,
)


@pytest.fixture(scope="module")
def dump_path(tmp_path_factory):
    """Two real batches of 8 samples (4 complete, 2 fail, 2 time out) in one dump."""
    path = tmp_path_factory.mktemp("trace") / "dump.jsonl"

    async def produce() -> None:
        pipe = make_pipeline()
        with TrajectoryWriter(path) as writer:
            for step in (0, 1):
                writer.begin_batch(step=step)
                result = await pipe.run_batch(rows(4), n=2, on_sample_done=writer.write)
                writer.end_batch(result)

    asyncio.run(produce())
    return path


def _load(path):
    return json.loads(path.read_text(encoding="utf-8"))


async def test_trace_file_loads_and_every_event_has_the_required_fields(dump_path, capsys):
    out = dump_path.parent / "trace.json"
    assert trace_command(dump_path, out) == 0
    assert "16 samples" in capsys.readouterr().out
    events = _load(out)["traceEvents"]
    assert events
    for ev in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= ev.keys(), ev
        assert isinstance(ev["name"], str) and isinstance(ev["ph"], str)
        assert all(isinstance(ev[k], int | float) for k in ("ts", "dur", "pid", "tid"))
        assert ev["ts"] >= 0 and ev["dur"] >= 0
    names = {ev["args"]["name"] for ev in events if ev["name"] == "process_name"}
    assert len(names) == 2 and all(n.startswith("batch step=") for n in names)


async def test_each_sample_is_a_track_of_properly_nested_stage_slices(dump_path):
    dump = read_trajectories(dump_path)
    events = build_trace(dump)["traceEvents"]
    slices = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            slices[(ev["pid"], ev["tid"])].append(ev)
    assert len(slices) == len(dump.samples) == 16
    for track in slices.values():
        track.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for ev in track:
            while stack and ev["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1e-6:
                stack.pop()
            if stack:  # nested: it must end inside its parent
                assert ev["ts"] + ev["dur"] <= stack[-1]["ts"] + stack[-1]["dur"] + 1e-6
            stack.append(ev)
        samples = [e for e in track if e["cat"] == "sample"]
        assert len(samples) == 1
        outer = samples[0]
        for ev in track:
            if ev["cat"] not in ("sample", "queue"):
                assert outer["ts"] <= ev["ts"] and ev["ts"] + ev["dur"] <= (
                    outer["ts"] + outer["dur"] + 1e-6)
    cats = {ev["cat"] for ev in events if ev["ph"] == "X"}
    assert {"engine", "tool", "judge", "prompt", "loop", "sample"} <= cats
    completed = [ev for ev in events if ev["ph"] == "X" and ev["cat"] == "sample"
                 and ev["args"]["status"] == "completed"]
    assert completed and all(ev["args"]["engine_s"] > 0 for ev in completed)


async def test_failures_are_marked_where_the_sample_ended(dump_path):
    dump = read_trajectories(dump_path)
    events = build_trace(dump)["traceEvents"]
    bad = [s for s in dump.samples if s.status is not Status.COMPLETED]
    marks = [ev for ev in events if ev["ph"] == "i"]
    assert len(marks) == len(bad) == 8
    timeouts = [ev for ev in marks if ev["name"].startswith("timeout")]
    assert len(timeouts) == 4 and all("timed out" in ev["args"]["error"] for ev in timeouts)
    failed_slices = [ev for ev in events if ev["ph"] == "X" and ev["name"] == "outcome"
                     and ev["args"]["status"] == "failed"]
    assert failed_slices and all("ValueError" in ev["args"]["error"] for ev in failed_slices)


async def test_flow_arrows_point_at_each_groups_straggler(dump_path):
    dump = read_trajectories(dump_path)
    events = build_trace(dump, flows=True)["traceEvents"]
    starts = {ev["id"]: ev for ev in events if ev["ph"] == "s"}
    ends = {ev["id"]: ev for ev in events if ev["ph"] == "f"}
    assert starts.keys() == ends.keys() and len(starts) == 8  # 8 groups of 2
    sample_slices = {(ev["pid"], ev["tid"]): ev for ev in events
                     if ev["ph"] == "X" and ev["cat"] == "sample"}
    for flow_id, start in starts.items():
        end = ends[flow_id]
        src, dst = sample_slices[start["pid"], start["tid"]], sample_slices[end["pid"], end["tid"]]
        assert src["args"]["group_id"] == dst["args"]["group_id"]
        assert src["ts"] + src["dur"] <= dst["ts"] + dst["dur"]  # the arrow ends at the last one
        assert dst["ts"] <= end["ts"] <= dst["ts"] + dst["dur"]  # and binds inside its slice
    assert not [ev for ev in build_trace(dump, flows=False)["traceEvents"]
                if ev["ph"] in ("s", "f")]


async def test_running_counter_tracks_concurrency(dump_path):
    events = build_trace(read_trajectories(dump_path))["traceEvents"]
    by_batch = defaultdict(list)
    for ev in events:
        if ev["ph"] == "C":
            by_batch[ev["pid"]].append(ev["args"]["running"])
    assert len(by_batch) == 2
    for values in by_batch.values():
        assert min(values) >= 0 and values[-1] == 0 and max(values) >= 2


def test_stage_categories():
    def timing(name: str, phase: str = "run") -> StageTiming:
        return StageTiming(name=name, phase=phase, start=0.0, start_wall=0.0)

    assert stage_category(timing("generate")) == "engine"
    assert stage_category(timing("call_tools")) == "tool"
    assert stage_category(timing("sandbox_tool_exec")) == "tool"
    assert stage_category(timing("math_judger")) == "judge"
    assert stage_category(timing("judge", "cleanup")) == "cleanup"
    assert stage_category(timing("my_stage")) == "stage"


async def test_trace_command_reports_problems(tmp_path, dump_path, capsys):
    assert trace_command(tmp_path / "missing.jsonl", tmp_path / "t.json") == 2
    assert "cannot read" in capsys.readouterr().err
    data = dump_path.read_bytes()
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(data[:-10])
    assert trace_command(torn) == 0  # default output beside the dump
    assert "torn" in capsys.readouterr().err
    assert json.loads((tmp_path / "torn.trace.json").read_text())["otherData"]["torn_tail"]
    empty = tmp_path / "empty.jsonl"
    with TrajectoryWriter(empty) as writer:
        writer.begin_batch(step=0)
    assert trace_command(empty, tmp_path / "e.json") == 1
    assert "no samples" in capsys.readouterr().err
