"""Timelines: a dump's stage records as a Chrome / Perfetto trace (``ui.perfetto.dev``).

Each batch is a process, each sample a thread (its track), ordered by the sample's index:

- a ``queued`` slice while the sample waited for a concurrency slot;
- a ``sample (<status>)`` slice over its running time, with its outcome in the args;
- one slice per stage run nested inside (``Loop`` slices contain their turns), its category
  telling engine, tool and judge time apart (``engine``, ``tool``, ``judge``, ``prompt``,
  ``loop``, ``cleanup``, ``stage``), so a search for ``cat:engine`` selects model time;
- an instant marking where a failed, timed-out or aborted sample ended, with the error;
- a ``running samples`` counter track per batch;
- optional flow arrows from each sample of a group to the group's last one to finish: the
  straggler every group member waits for.

Every event carries ``name, ph, ts, dur, pid, tid`` (``dur`` is 0 where it has no meaning).
Times are microseconds from the first sample's queueing; batches sit at their wall-clock
distance from each other.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pydantic_core

from pipeline.observability._reader import TrajectoryDump, read_trajectories
from pipeline.observability._schema import BatchSummary, StageTiming, TrajectoryRecord

StageCategory = Callable[[StageTiming], str]
"""Picks a stage slice's category from its timing (name, phase)."""

_NAMED = {"generate": "engine", "call_tools": "tool", "judge": "judge",
          "build_prompt": "prompt", "loop": "loop"}
_CNAME = {"failed": "terrible", "timeout": "bad", "aborted": "grey"}


def stage_category(timing: StageTiming) -> str:
    """Default categories: built-in stage names first, then words in the name."""
    if timing.phase == "cleanup":
        return "cleanup"
    name = timing.name.lower()
    if name in _NAMED:
        return _NAMED[name]
    for word, category in (("generat", "engine"), ("engine", "engine"), ("tool", "tool"),
                           ("judg", "judge"), ("reward", "judge"), ("loop", "loop")):
        if word in name:
            return category
    return "stage"


def trace_events(dump: TrajectoryDump, *, flows: bool = True,
                 category: StageCategory = stage_category) -> list[dict[str, Any]]:
    """The trace events of a dump's samples.

    Args:
        dump: a dump read with :func:`read_trajectories`.
        flows: add the group flow arrows.
        category: chooses each stage slice's category.

    Returns:
        Trace events, metadata first; every one has name, ph, ts, dur, pid and tid.
    """
    batches = _group_batches(dump)
    offsets = {key: _clock_offset(summary, samples) for key, (summary, samples) in batches.items()}
    starts = [first + offsets[key] for key, (_, samples) in batches.items()
              for s in samples if (first := _first_time(s)) is not None]
    zero = min(starts, default=0.0)
    events: list[dict[str, Any]] = []
    flow_id = 0
    for pid, (key, (summary, samples)) in enumerate(batches.items(), start=1):
        def us(t: float, _offset: float = offsets[key]) -> float:
            return round((t + _offset - zero) * 1e6, 3)

        label = "batch" if summary is None else f"batch step={summary.step} {summary.batch_id}"
        events.append(_meta("process_name", pid, 0, {"name": label}))
        events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        ends: dict[str, tuple[float, int]] = {}
        for sample in sorted(samples, key=lambda s: s.index):
            tid = sample.index + 1
            events.append(_meta("thread_name", pid, tid,
                                {"name": f"{sample.index:04d} {sample.uid} [{sample.status}]"}))
            events.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
            end = _sample_events(sample, pid, tid, us, category, events)
            if end is not None:
                group_end = ends.get(sample.group_id)
                if group_end is None or end > group_end[0]:
                    ends[sample.group_id] = (end, tid)
        events.extend(_counter(samples, pid, us))
        if flows:
            flow_id = _flows(samples, pid, us, ends, flow_id, events)
    return events


def build_trace(dump: TrajectoryDump, *, flows: bool = True,
                category: StageCategory = stage_category) -> dict[str, Any]:
    """The whole trace document (``{"traceEvents": [...], ...}``) of a dump."""
    return {
        "traceEvents": trace_events(dump, flows=flows, category=category),
        "displayTimeUnit": "ms",
        "otherData": {"source": dump.path.name, "samples": len(dump.samples),
                      "batches": len(dump.batches), "torn_tail": bool(dump.torn_tails),
                      "bad_lines": len(dump.bad_lines)},
    }


def write_trace(path: str | os.PathLike[str], out: str | os.PathLike[str], *,
                flows: bool = True) -> dict[str, Any]:
    """Convert the dump at ``path`` into a trace file at ``out``.

    Returns:
        The trace document written.

    Raises:
        FileNotFoundError: no dump at ``path``.
    """
    trace = build_trace(read_trajectories(path), flows=flows)
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(pydantic_core.to_json(trace, fallback=repr))
    return trace


def trace_command(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> int:
    """``rollout trace FILE -o OUT``: write the timeline and say what went into it.

    Args:
        path: the dump (file or folder of rotated dumps).
        out: the trace file; default: ``FILE`` with the suffix ``.trace.json``.

    Returns:
        0 on success, 1 when the dump holds no samples, 2 when it cannot be read.
    """
    source = Path(path)
    target = Path(out) if out is not None else source.with_suffix(".trace.json")
    try:
        trace = write_trace(source, target)
    except (OSError, ValueError) as exc:
        print(f"rollout trace: cannot read {source}: {exc}", file=sys.stderr)
        return 2
    info = trace["otherData"]
    if info["torn_tail"]:
        print(f"rollout trace: {source.name}: the last line is torn (a writer died mid-line); "
              "it was left out", file=sys.stderr)
    if info["bad_lines"]:
        print(f"rollout trace: {source.name}: {info['bad_lines']} unreadable line(s) skipped",
              file=sys.stderr)
    if not info["samples"]:
        print(f"rollout trace: {source.name} holds no samples", file=sys.stderr)
        return 1
    print(f"wrote {len(trace['traceEvents'])} events for {info['samples']} samples in "
          f"{info['batches']} batch(es) to {target}; open it in https://ui.perfetto.dev")
    return 0


def _group_batches(dump: TrajectoryDump
                   ) -> dict[str, tuple[BatchSummary | None, list[TrajectoryRecord]]]:
    batches: dict[str, tuple[BatchSummary | None, list[TrajectoryRecord]]] = {}
    for summary in dump.batches:
        batches.setdefault(summary.batch_id, (summary, []))
    for sample in dump.samples:
        key = sample.batch_id or ""
        if key not in batches:
            batches[key] = (None, [])
        batches[key][1].append(sample)
    return {k: v for k, v in batches.items() if v[1]}


def _clock_offset(summary: BatchSummary | None, samples: list[TrajectoryRecord]) -> float:
    """Seconds to add to the batch's monotonic times to get wall-clock times."""
    if summary is not None:
        return summary.started_wall - summary.monotonic
    diffs = sorted(r.start_wall - r.start for s in samples for r in s.records)
    return diffs[len(diffs) // 2] if diffs else 0.0


def _first_time(sample: TrajectoryRecord) -> float | None:
    times = [t for t in (sample.queued_at, sample.started_at) if t is not None]
    times.extend(r.start for r in sample.records)
    return min(times, default=None)


def _sample_events(sample: TrajectoryRecord, pid: int, tid: int, us: Callable[[float], float],
                   category: StageCategory, events: list[dict[str, Any]]) -> float | None:
    """Append one sample's slices; return its end (µs) or None when it has no times."""
    start = sample.started_at if sample.started_at is not None else _first_time(sample)
    if start is None:
        return None
    ends = [r.end for r in sample.records if r.end is not None]
    end = sample.ended_at if sample.ended_at is not None else max(ends, default=start)
    if sample.queued_at is not None and sample.queued_at < start:
        events.append(_slice("queued", "queue", us(sample.queued_at), us(start), pid, tid, {}))
    totals: dict[str, float] = defaultdict(float)
    stage_events = []
    for record in sample.records:
        cat = category(record)
        rec_end = record.end if record.end is not None else end
        totals[cat] += rec_end - record.start
        args: dict[str, Any] = {"status": record.status, "turn": record.turn,
                                "phase": record.phase}
        if record.error_type:
            args["error"] = f"{record.error_type}: {record.error_message}"
        ev = _slice(record.name, cat, us(record.start), us(rec_end), pid, tid, args)
        if record.status in _CNAME:
            ev["cname"] = _CNAME[record.status]
        stage_events.append(ev)
    args = {"uid": sample.uid, "group_id": sample.group_id, "status": sample.status.value,
            "finish_reason": sample.finish_reason.value, "exit_reason": sample.exit_reason,
            "reward": sample.reward, "prompt_len": sample.prompt_len,
            "response_len": sample.response_len, "latency_s": sample.latency_s,
            "queue_s": sample.queue_s, "error": sample.error}
    args.update({f"{cat}_s": round(total, 6) for cat, total in sorted(totals.items())
                 if cat not in ("loop",)})
    outer = _slice(f"sample ({sample.status.value})", "sample", us(start), us(end), pid, tid,
                   args)
    if sample.status.value in _CNAME:
        outer["cname"] = _CNAME[sample.status.value]
    events.append(outer)
    stage_events.sort(key=lambda e: (e["ts"], -e["dur"]))
    events.extend(stage_events)
    if sample.status.value != "completed":
        events.append({"name": f"{sample.status.value}: {sample.error or ''}"[:200],
                       "cat": "outcome", "ph": "i", "s": "t", "ts": us(end), "dur": 0,
                       "pid": pid, "tid": tid, "args": {"error": sample.error}})
    return us(end)


def _counter(samples: Iterable[TrajectoryRecord], pid: int,
             us: Callable[[float], float]) -> list[dict[str, Any]]:
    changes: list[tuple[float, int]] = []
    for s in samples:
        if s.started_at is not None and s.ended_at is not None:
            changes += [(us(s.started_at), 1), (us(s.ended_at), -1)]
    running, out = 0, []
    for ts, delta in sorted(changes):
        running += delta
        out.append({"name": "running samples", "ph": "C", "ts": ts, "dur": 0, "pid": pid,
                    "tid": 0, "args": {"running": running}})
    return out


def _flows(samples: Iterable[TrajectoryRecord], pid: int, us: Callable[[float], float],
           ends: Mapping[str, tuple[float, int]], flow_id: int,
           events: list[dict[str, Any]]) -> int:
    for s in samples:
        if s.ended_at is None or s.group_id not in ends:
            continue
        last_end, last_tid = ends[s.group_id]
        tid = s.index + 1
        if tid == last_tid:
            continue
        flow_id += 1
        common = {"name": "group", "cat": "group", "id": flow_id, "pid": pid, "dur": 0}
        # Bind each end inside its sample slice: just before the slice ends.
        events.append({**common, "ph": "s", "ts": max(us(s.ended_at) - 0.001, 0.0), "tid": tid})
        events.append({**common, "ph": "f", "bp": "e", "ts": max(last_end - 0.001, 0.0),
                       "tid": last_tid})
    return flow_id


def _slice(name: str, cat: str, ts: float, end: float, pid: int, tid: int,
           args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": round(max(end - ts, 0.0), 3),
            "pid": pid, "tid": tid, "args": args}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": tid, "args": args}
