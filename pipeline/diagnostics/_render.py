"""Renderers of a diagnostics :class:`Snapshot`: text for humans, JSON for tools.

The text form reads top-down the way one debugs a hang: which samples are stuck where, then
the asyncio tasks grouped by identical await chain (one line per kind of stuck thing, with a
count), then every thread's stack, the loop thread first.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

from pipeline.diagnostics._frames import FrameInfo
from pipeline.diagnostics._model import Snapshot, TaskGroupInfo

_NAMES_SHOWN = 5


def render_text(snapshot: Snapshot, *, max_samples: int = 100, max_groups: int = 200) -> str:
    """The dump as plain text.

    Args:
        snapshot: what to render.
        max_samples: in-flight samples listed one per line (longest in their stage first);
            the rest are counted per stage.
        max_groups: task groups shown in full; the rest are counted.

    Returns:
        The text, ending with a newline.
    """
    out: list[str] = []
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(snapshot.taken_at))
    out.append(f"rollout task dump: pid={snapshot.pid} at={stamp}Z reason={snapshot.reason} "
               f"python={snapshot.python} capture_s={snapshot.capture_s:.3f}")
    for loop in snapshot.loops:
        thread = _thread_name(snapshot, loop.thread_ident)
        lag = "" if loop.lag_s is None else f" heartbeat_unanswered_s={loop.lag_s:.2f}"
        current = loop.current_task or "-"
        blocked = " (the loop is running this task now)" if loop.current_task else ""
        out.append(f"loop {loop.loop_id:#x} {loop.loop_type} thread={thread} "
                   f"current_task={current}{blocked}{lag}")
    for error in snapshot.errors:
        out.append(f"! could not read {error}")
    _render_samples(snapshot, out, max_samples)
    _render_tasks(snapshot, out, max_groups)
    _render_threads(snapshot, out)
    return "\n".join(out) + "\n"


def _render_samples(snapshot: Snapshot, out: list[str], limit: int) -> None:
    samples = snapshot.samples
    out.append("")
    for flow in snapshot.flow:
        servers = flow.get("servers") or {}
        out.append("flow control: " + " ".join(f"{key}={value}" for key, value in flow.items()
                                               if key != "servers"))
        for name, server in servers.items():  # an engine's servers, one line each
            error = server.get("error") if isinstance(server, dict) else None
            state = server.get("state") if isinstance(server, dict) else server
            out.append(f"  server {name}: {state}" + (f" (last error: {error})" if error else ""))
    out.append(f"== samples in flight: {len(samples)} ==")
    if not samples:
        return
    by_stage = Counter(s.stage or "-" for s in samples)
    oldest: dict[str, float] = {}
    for s in samples:
        key = s.stage or "-"
        oldest[key] = max(oldest.get(key, 0.0), s.in_stage_s or 0.0)
    out.append("by stage: " + ", ".join(f"{stage}={count} (longest {oldest[stage]:.1f}s)"
                                        for stage, count in by_stage.most_common()))
    stuck = Counter(s.stage or "-" for s in samples if s.stuck)
    if stuck:
        out.append("stuck (longer than stuck_stage_s in one stage): "
                   + ", ".join(f"{stage}={count}" for stage, count in stuck.most_common()))
    for s in samples[:limit]:
        turn = "" if s.turn is None else f" turn={s.turn}"
        in_stage = "-" if s.in_stage_s is None else f"{s.in_stage_s:.2f}s"
        out.append(f"  uid={s.uid} group={s.group_id} stage={s.stage or '-'}{turn} "
                   f"in_stage={in_stage}{' STUCK' if s.stuck else ''} "
                   f"running={s.running_s:.2f}s task={s.task_state or '?'}")
        if s.location is not None:
            out.append(f"      at {s.location}")
        if s.awaiting:
            out.append(f"      awaiting {s.awaiting}")
    rest = samples[limit:]
    if rest:
        counts = Counter(s.stage or "-" for s in rest)
        out.append(f"  ... {len(rest)} more: " + ", ".join(
            f"{stage}={n}" for stage, n in counts.most_common()))


def _render_tasks(snapshot: Snapshot, out: list[str], limit: int) -> None:
    groups = snapshot.task_groups()
    out.append("")
    out.append(f"== asyncio tasks: {len(snapshot.tasks)} in {len(groups)} groups "
               f"(same state and await chain) ==")
    for group in groups[:limit]:
        out.extend(_group_lines(group))
    if len(groups) > limit:
        hidden = sum(g.count for g in groups[limit:])
        out.append(f"... {len(groups) - limit} more groups ({hidden} tasks)")


def _group_lines(group: TaskGroupInfo) -> list[str]:
    age = ""
    if group.age_max_s is not None and group.age_min_s is not None:
        age = (f" age={group.age_max_s:.1f}s" if group.count == 1 else
               f" age={group.age_min_s:.1f}-{group.age_max_s:.1f}s")
    names = ", ".join(group.names[:_NAMES_SHOWN])
    if group.count > _NAMES_SHOWN:
        names += f", ... ({group.count - _NAMES_SHOWN} more)"
    lines = [f"{group.count} x {group.state}{age}: {names}"]
    lines.extend(f"    {frame}" for frame in group.chain)
    if group.blocking:
        lines.append("    -- blocking the event loop in:")
        lines.extend(f"    {frame}" for frame in group.blocking)
    if group.awaiting:
        lines.append(f"    awaiting {group.awaiting}")
    return lines


def _render_threads(snapshot: Snapshot, out: list[str]) -> None:
    out.append("")
    out.append(f"== threads: {len(snapshot.threads)} ==")
    for thread in snapshot.threads:
        tags = [t for t, on in (("event loop", thread.is_loop_thread),
                                ("daemon", thread.daemon)) if on]
        suffix = f" ({', '.join(tags)})" if tags else ""
        out.append(f"thread {thread.name} ident={thread.ident}{suffix}, innermost last:")
        out.extend(f"    {frame}" for frame in thread.stack)


def _thread_name(snapshot: Snapshot, ident: int | None) -> str:
    if ident is None:
        return "?"
    for thread in snapshot.threads:
        if thread.ident == ident:
            return thread.name
    return str(ident)


def snapshot_to_dict(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as JSON-ready data; tasks are grouped, each group's chain written once."""
    return {
        "pid": snapshot.pid, "reason": snapshot.reason, "taken_at": snapshot.taken_at,
        "capture_s": round(snapshot.capture_s, 6), "python": snapshot.python,
        "errors": list(snapshot.errors),
        "loops": [{"loop_id": lp.loop_id, "loop_type": lp.loop_type,
                   "thread_ident": lp.thread_ident, "current_task": lp.current_task,
                   "lag_s": lp.lag_s} for lp in snapshot.loops],
        "samples": [s.to_dict() for s in snapshot.samples],
        "flow": list(snapshot.flow),
        "task_count": len(snapshot.tasks),
        "task_groups": [_group_dict(g) for g in snapshot.task_groups()],
        "threads": [t.to_dict() for t in snapshot.threads],
    }


def _group_dict(group: TaskGroupInfo) -> dict[str, Any]:
    return {"count": group.count, "state": group.state, "names": list(group.names),
            "age_min_s": group.age_min_s, "age_max_s": group.age_max_s,
            "awaiting": group.awaiting, "chain": [_frame(f) for f in group.chain],
            "blocking": [_frame(f) for f in group.blocking]}


def _frame(frame: FrameInfo) -> dict[str, Any]:
    return frame.to_dict()


def render_json(snapshot: Snapshot, *, indent: int | None = None) -> str:
    """The snapshot as a JSON document (see :func:`snapshot_to_dict`)."""
    return json.dumps(snapshot_to_dict(snapshot), indent=indent)
