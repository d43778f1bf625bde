"""``rollout inspect``: read a dump as a person would, in plain text.

- :func:`render_summary`: batches and counts by status, finish reason, exit reason and data
  source, with latency and reward figures;
- :func:`render_trajectory`: one sample as a conversation with token counts, its reward and
  its stage timeline;
- :func:`render_failures`: samples that did not complete, grouped by error (ids and numbers
  in messages folded, so one cause is one group).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.observability.reader import TrajectoryDump, read_trajectories
from pipeline.observability.schema import TrajectoryRecord


def render_summary(dump: TrajectoryDump) -> str:
    """Tables of a dump: per batch, per status / finish / exit reason, per data source."""
    samples = dump.samples
    lines = [f"dump {dump.path.name}: {len(samples)} samples in {len(dump.batches)} batch(es)"]
    lines.extend(_read_problems(dump))
    if not samples:
        return "\n".join(lines)
    ended = {e.batch_id: e for e in dump.ends}
    by_batch: dict[str | None, list[TrajectoryRecord]] = defaultdict(list)
    for s in samples:
        by_batch[s.batch_id].append(s)
    rows = []
    for b in dump.batches:
        group = by_batch.get(b.batch_id, [])
        end = ended.get(b.batch_id)
        wall = None if end is None else end.monotonic - b.monotonic
        rows.append([str(b.step), b.batch_id, str(len(group)),
                     str(sum(s.status.value == "completed" for s in group)),
                     "-" if wall is None else f"{wall:.2f}", "yes" if end else "no (cut short)"])
    lines += ["", _table(["step", "batch", "samples", "completed", "wall_s", "ended"], rows)]
    for title, values in (("status", [s.status.value for s in samples]),
                          ("finish_reason", [s.finish_reason.value for s in samples]),
                          ("exit_reason", [s.exit_reason or "-" for s in samples])):
        counts = Counter(values).most_common()
        lines += ["", _table([title, "count", "share"],
                             [[k, str(v), f"{100 * v / len(samples):.1f}%"] for k, v in counts])]
    lines += ["", _table(
        ["data_source", "samples", "completed", "reward_mean", "response_len_mean",
         "latency_p95_s"],
        [_source_row(name, group) for name, group in sorted(_by_source(samples).items())])]
    lat = [x for s in samples if (x := s.latency_s) is not None]
    rewards = [s.reward for s in samples if s.reward is not None]
    figures = []
    if lat:
        p50, p95 = np.percentile(lat, [50, 95])
        figures.append(f"latency p50 {p50:.3f}s p95 {p95:.3f}s max {max(lat):.3f}s")
    if rewards:
        figures.append(f"reward mean {np.mean(rewards):.4f} over {len(rewards)} samples")
    if figures:
        lines += ["", "; ".join(figures)]
    return "\n".join(lines)


def render_trajectory(sample: TrajectoryRecord) -> str:
    """One sample: outcome, token counts, the conversation, the raw prompt, the timeline."""
    reward = "-" if sample.reward is None else f"{sample.reward:g}"
    latency = "-" if sample.latency_s is None else f"{sample.latency_s:.3f}s"
    queued = "" if sample.queue_s is None else f" (queued {sample.queue_s:.3f}s)"
    lines = [
        f"sample {sample.uid}  group {sample.group_id}  index {sample.index}  step {sample.step}",
        f"status {sample.status.value}  finish {sample.finish_reason.value}"
        f"{_paren(sample.raw_finish_reason)}  exit {sample.exit_reason}  reward {reward}"
        f"  masked {'yes' if sample.masked else 'no'}",
        f"tokens: prompt {sample.prompt_len}, response {sample.response_len} "
        f"(model {sample.model_tokens})  tool turns {sample.agent.tool_turns}  "
        f"latency {latency}{queued}",
    ]
    if sample.error:
        lines.append(f"error ({sample.error_stage or '?'}): {sample.error}")
    if sample.dump_error:
        lines.append(f"dump error: the full line could not be written: {sample.dump_error}")
    if sample.counters:
        lines.append("counters: " + ", ".join(f"{k} {v:g}" for k, v in sample.counters.items()))
    if sample.reward_payload:
        lines.append("reward payload: " + json.dumps(sample.reward_payload, ensure_ascii=False,
                                                     default=repr))
    lines += ["", "--- conversation ---"]
    for message in sample.conversation():
        lines.extend(_message_lines(message))
    if sample.raw_prompt is not None:
        lines += ["", "--- raw prompt (as rendered by the chat template) ---", sample.raw_prompt]
    if sample.response is not None:
        lines += ["", "--- response (decoded, special tokens kept) ---", sample.response]
    lines += ["", "--- stage timeline ---", _timeline(sample)]
    return "\n".join(lines)


def render_failures(dump: TrajectoryDump, *, examples: int = 3) -> str:
    """Samples that did not complete, grouped by status, stage and folded error message."""
    failed = [s for s in dump.samples if s.status.value != "completed"]
    lines = [f"{len(failed)} of {len(dump.samples)} samples did not complete"]
    lines.extend(_read_problems(dump))
    groups: dict[tuple[str, str, str], list[TrajectoryRecord]] = defaultdict(list)
    for s in failed:
        groups[(s.status.value, s.error_stage or "-", _fold(s.error or "(no message)"))].append(s)
    for (status, stage, message), members in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        uids = ", ".join(m.uid for m in members[:examples])
        more = f" (+{len(members) - examples} more)" if len(members) > examples else ""
        lines += ["", f"{len(members):>5}  {status}  stage {stage}", f"       {message}",
                  f"       e.g. {uids}{more}"]
    return "\n".join(lines)


def inspect_command(path: str | os.PathLike[str], *, show: str | None = None,
                    failed: bool = False) -> int:
    """``rollout inspect FILE [--show UID] [--failed]``: print to stdout.

    Args:
        path: the dump (file or folder of rotated dumps).
        show: print this sample (a unique uid prefix is enough).
        failed: list failures grouped by error.

    Returns:
        0 on success, 1 when ``show`` matches no sample or several, 2 when the dump cannot
        be read.
    """
    try:
        dump = read_trajectories(path)
    except (OSError, ValueError) as exc:
        print(f"rollout inspect: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if show is not None:
        matches = dump.find(show)
        if len(matches) != 1:
            what = "no sample" if not matches else f"{len(matches)} samples"
            print(f"rollout inspect: {what} with uid {show!r} in {Path(path).name}",
                  file=sys.stderr)
            for m in matches[:10]:
                print(f"  {m.uid}", file=sys.stderr)
            return 1
        print(render_trajectory(matches[0]))
        return 0
    print(render_failures(dump) if failed else render_summary(dump))
    return 0


def _read_problems(dump: TrajectoryDump) -> list[str]:
    out = [f"note: {t.path.name} line {t.line} is torn ({t.size} bytes, a writer died "
           f"mid-line); left out" for t in dump.torn_tails]
    out += [f"note: {b.path.name} line {b.line} skipped: {b.reason}" for b in dump.bad_lines]
    return out


def _by_source(samples: Sequence[TrajectoryRecord]) -> dict[str, list[TrajectoryRecord]]:
    groups: dict[str, list[TrajectoryRecord]] = defaultdict(list)
    for s in samples:
        groups[s.data_source or "-"].append(s)
    return groups


def _source_row(name: str, group: list[TrajectoryRecord]) -> list[str]:
    rewards = [s.reward for s in group if s.reward is not None]
    lat = [x for s in group if (x := s.latency_s) is not None]
    return [name, str(len(group)), str(sum(s.status.value == "completed" for s in group)),
            f"{np.mean(rewards):.4f}" if rewards else "-",
            f"{np.mean([s.response_len for s in group]):.1f}",
            f"{np.percentile(lat, 95):.3f}" if lat else "-"]


def _message_lines(message: dict[str, Any]) -> list[str]:
    role = str(message.get("role", "?"))
    head = f"[{role}" + (f" {message['name']}" if message.get("name") else "") + "]"
    facts = []
    tokens = message.get("num_tokens")
    if tokens is None and isinstance(message.get("token_ids"), list):
        tokens = len(message["token_ids"])
    if tokens is not None:
        facts.append(f"{tokens} tokens")
    if message.get("finish_reason"):
        facts.append(f"finish {message['finish_reason']}")
    if message.get("tool_call_id"):
        facts.append(f"for call {message['tool_call_id']}")
    if message.get("error"):
        facts.append(f"error {message['error']}")
    lines = ["", head + (" " + ", ".join(facts) if facts else "")]
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p)
                          for p in content)
    if content:
        lines.append(str(content))
    for call in message.get("tool_calls") or ():
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        lines.append(f"  -> call {fn.get('name', '?')}({fn.get('arguments', '')})"
                     f" id {call.get('id', '?') if isinstance(call, dict) else '?'}")
    return lines


def _timeline(sample: TrajectoryRecord, width: int = 30) -> str:
    if not sample.records:
        return "(no stage ran)"
    origin = sample.started_at if sample.started_at is not None else sample.records[0].start
    end = sample.ended_at if sample.ended_at is not None else max(
        (r.end or r.start) for r in sample.records)
    span = max(end - origin, 1e-9)
    rows = []
    for r in sample.records:
        r_end = r.end if r.end is not None else end
        left = int(width * (r.start - origin) / span)
        size = max(1, int(width * (r_end - r.start) / span))
        bar = (" " * left + "#" * size)[:width].ljust(width)
        name = r.name if r.phase == "run" else f"{r.name} (cleanup)"
        error = f"{r.error_type}: {r.error_message}" if r.error_type else ""
        rows.append([name, "-" if r.turn is None else str(r.turn),
                     f"{1000 * (r.start - origin):.1f}", f"{1000 * (r_end - r.start):.1f}",
                     r.status, f"|{bar}|", error])
    return _table(["stage", "turn", "start_ms", "dur_ms", "status", "timeline", "error"], rows)


_ID = re.compile(r"\b[0-9a-f]{8,}(?:-\d+)*\b")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _fold(message: str) -> str:
    """A message with ids and numbers replaced, so one cause with different ids is one group."""
    return _NUMBER.sub("N", _ID.sub("<id>", message))[:300]


def _paren(text: str | None) -> str:
    return f" ({text})" if text else ""


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(_is_number(r[i]) for r in rows) for i in range(len(headers))]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(cells, widths, numeric, strict=True)).rstrip()

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def _is_number(text: str) -> bool:
    try:
        float(text.rstrip("%"))
    except ValueError:
        return text == "-"
    return True
