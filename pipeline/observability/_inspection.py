"""``rollout inspect``: read a dump as a person would, in plain text.

- :func:`render_summary`: batches and counts by status, finish reason, exit reason and data
  source, with latency and reward figures;
- :func:`render_trajectory`: one sample as a conversation with token counts, its reward and
  its stage timeline;
- :func:`render_failures`: samples that did not complete, grouped by error (ids and numbers
  in messages folded, so one cause is one group);
- ``--list``: one line per sample (uid, status, reward, ...), the uids ``--show`` takes, cut
  at a limit so a large dump prints a bounded page.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.observability._reader import (
    BadLine,
    NotADumpError,
    TornTail,
    TrajectoryDump,
    TrajectoryReader,
)
from pipeline.observability._schema import BatchEnd, BatchSummary, TrajectoryRecord


class _SummaryTally:
    """What the summary needs, gathered while streaming: a few facts per sample, not lines."""

    def __init__(self) -> None:
        self.batches: list[BatchSummary] = []
        self.ends: dict[str, BatchEnd] = {}
        self.facts: list[tuple[str | None, str, str, str, str, float | None, float | None,
                               int]] = []

    def add(self, line: BatchSummary | TrajectoryRecord | BatchEnd) -> None:
        if isinstance(line, TrajectoryRecord):
            self.facts.append((line.batch_id, line.status.value, line.finish_reason.value,
                               line.exit_reason or "-", line.data_source or "-", line.reward,
                               line.latency_s, line.response_len))
        elif isinstance(line, BatchSummary):
            self.batches.append(line)
        else:
            self.ends[line.batch_id] = line

    def render(self, name: str, problems: list[str]) -> str:
        facts = self.facts
        lines = [f"dump {name}: {len(facts)} samples in {len(self.batches)} batch(es)",
                 *problems]
        if not facts:
            return "\n".join(lines)
        rows = []
        for b in self.batches:
            mine = [f for f in facts if f[0] == b.batch_id]
            end = self.ends.get(b.batch_id)
            wall = "-" if end is None else f"{end.monotonic - b.monotonic:.2f}"
            rows.append([str(b.step), b.batch_id, str(len(mine)),
                         str(sum(f[1] == "completed" for f in mine)), wall,
                         "yes" if end else "no (cut short)"])
        lines += ["", _table(["step", "batch", "samples", "completed", "wall_s", "ended"], rows)]
        for column, title in ((1, "status"), (2, "finish_reason"), (3, "exit_reason")):
            counts = Counter(str(f[column]) for f in facts).most_common()
            lines += ["", _table([title, "count", "share"],
                                 [[k, str(v), f"{100 * v / len(facts):.1f}%"]
                                  for k, v in counts])]
        sources: dict[str, list[Any]] = defaultdict(list)
        for f in facts:
            sources[f[4]].append(f)
        lines += ["", _table(
            ["data_source", "samples", "completed", "reward_mean", "response_len_mean",
             "latency_p95_s"],
            [_source_row(source, group) for source, group in sorted(sources.items())])]
        lat = [f[6] for f in facts if f[6] is not None]
        rewards = [f[5] for f in facts if f[5] is not None]
        figures = []
        if lat:
            p50, p95 = np.percentile(lat, [50, 95])
            figures.append(f"latency p50 {p50:.3f}s p95 {p95:.3f}s max {max(lat):.3f}s")
        if rewards:
            figures.append(f"reward mean {np.mean(rewards):.4f} over {len(rewards)} samples")
        if figures:
            lines += ["", "; ".join(figures)]
        return "\n".join(lines)


class _FailureTally:
    """Failures grouped by status, stage and folded message, gathered while streaming."""

    def __init__(self, examples: int) -> None:
        self.examples = examples
        self.total = 0
        self.groups: dict[tuple[str, str, str], tuple[int, list[str]]] = {}

    def add(self, line: BatchSummary | TrajectoryRecord | BatchEnd) -> None:
        if not isinstance(line, TrajectoryRecord):
            return
        self.total += 1
        if line.status.value == "completed":
            return
        key = (line.status.value, line.error_stage or "-", _fold(line.error or "(no message)"))
        count, uids = self.groups.get(key, (0, []))
        if len(uids) < self.examples:
            uids.append(line.uid)
        self.groups[key] = (count + 1, uids)

    def render(self, problems: list[str]) -> str:
        failed = sum(count for count, _ in self.groups.values())
        lines = [f"{failed} of {self.total} samples did not complete", *problems]
        for (status, stage, message), (count, uids) in sorted(self.groups.items(),
                                                              key=lambda kv: -kv[1][0]):
            more = f" (+{count - len(uids)} more)" if count > len(uids) else ""
            lines += ["", f"{count:>5}  {status}  stage {stage}", f"       {message}",
                      f"       e.g. {', '.join(uids)}{more}"]
        return "\n".join(lines)


class _ListTally:
    """The first ``limit`` samples' lines and the counts of all, gathered while streaming."""

    HEADERS = ("uid", "status", "reward", "finish", "exit", "tool_turns", "response_len",
               "latency_s")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.total = 0
        self.by_status: Counter[str] = Counter()
        self.rows: list[list[str]] = []

    def add(self, line: BatchSummary | TrajectoryRecord | BatchEnd) -> None:
        if not isinstance(line, TrajectoryRecord):
            return
        self.total += 1
        self.by_status[line.status.value] += 1
        if self.limit is None or len(self.rows) < self.limit:
            self.rows.append([
                line.uid, line.status.value, "-" if line.reward is None else f"{line.reward:g}",
                line.finish_reason.value, line.exit_reason or "-", str(line.agent.tool_turns),
                str(line.response_len),
                "-" if line.latency_s is None else f"{line.latency_s:.3f}"])

    def render(self, problems: list[str]) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.by_status.items()))
        lines = [*problems, _table(list(self.HEADERS), self.rows) if self.rows else "(no samples)"]
        shown = len(self.rows)
        if shown < self.total:
            lines.append(f"... {self.total - shown} more: {shown} of {self.total} samples "
                         f"shown ({counts}); --limit N shows more, --limit 0 all")
        else:
            lines.append(f"{self.total} samples ({counts})")
        lines.append("rollout inspect FILE --show UID prints one (a unique uid prefix is enough)")
        return "\n".join(lines)


def render_summary(dump: TrajectoryDump) -> str:
    """Tables of a dump: per batch, per status / finish / exit reason, per data source."""
    tally = _SummaryTally()
    lines: list[BatchSummary | TrajectoryRecord | BatchEnd] = [*dump.batches, *dump.samples,
                                                                *dump.ends]
    for line in lines:
        tally.add(line)
    return tally.render(dump.path.name, _problems(dump.torn_tails, dump.bad_lines))


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
    tally = _FailureTally(examples)
    for sample in dump.samples:
        tally.add(sample)
    return tally.render(_problems(dump.torn_tails, dump.bad_lines))


def inspect_command(path: str | os.PathLike[str], *, show: str | None = None,
                    failed: bool = False, listing: bool = False,
                    limit: int | None = 50) -> int:
    """``rollout inspect FILE [--show UID | --failed | --list [--limit N]]``: print to stdout.

    The dump is streamed: only the figures of each sample are kept (for ``--show``, the
    matching samples; for ``--list``, the first ``limit`` lines), so dumps larger than memory
    can be inspected.

    Args:
        path: the dump (file or folder of rotated dumps).
        show: print this sample (a unique uid prefix is enough).
        failed: list failures grouped by error.
        listing: one line per sample: uid, status, reward, finish and exit reasons, tool
            turns, response length, latency.
        limit: for ``listing``, at most this many lines (None: all); a last line counts the
            rest by status.

    Returns:
        0 on success, 1 when ``show`` matches no sample or several, 2 when the dump cannot
        be read or is not a trajectory dump (no line of it is one).
    """
    reader = TrajectoryReader(path, sniff_lines=_SNIFF_LINES)
    summary, failures, listed = _SummaryTally(), _FailureTally(examples=3), _ListTally(limit)
    exact: list[TrajectoryRecord] = []
    prefixed: list[TrajectoryRecord] = []
    read = 0
    try:
        for line in reader:
            read += 1
            if show is not None:
                if isinstance(line, TrajectoryRecord) and line.uid.startswith(show):
                    (exact if line.uid == show else prefixed).append(line)
            elif failed:
                failures.add(line)
            elif listing:
                listed.add(line)
            else:
                summary.add(line)
    except NotADumpError as exc:
        print(f"rollout inspect: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"rollout inspect: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if not read:
        print(f"rollout inspect: {path} is not a trajectory dump: {_why_not_a_dump(reader)}",
              file=sys.stderr)
        return 2
    problems = _problems(reader.torn_tails, reader.bad_lines)
    if show is not None:
        matches = exact or prefixed
        if len(matches) != 1:
            what = "no sample" if not matches else f"{len(matches)} samples"
            print(f"rollout inspect: {what} with uid {show!r} in {Path(path).name} "
                  f"(--list lists the uids)", file=sys.stderr)
            for m in matches[:10]:
                print(f"  {m.uid}", file=sys.stderr)
            return 1
        print(render_trajectory(matches[0]))
        return 0
    if listing:
        print(listed.render(problems))
    else:
        print(failures.render(problems) if failed else summary.render(Path(path).name, problems))
    return 0


_SNIFF_LINES = 20
"""``rollout inspect`` calls a file whose first this many lines are all bad not a dump."""


def _why_not_a_dump(reader: TrajectoryReader) -> str:
    """One clause: why a file without a single dump line is not one."""
    if reader.bad_lines:
        first = reader.bad_lines[0]
        return (f"none of its {len(reader.bad_lines)} line(s) is a batch, sample or batch_end "
                f"record (line {first.line}: {first.reason})")
    if reader.torn_tails:
        return "it holds one torn line only"
    if reader.path.is_dir():
        return "the folder holds no *.jsonl dump"
    return "it is empty"


def _problems(torn_tails: list[TornTail], bad_lines: list[BadLine]) -> list[str]:
    out = [f"note: {t.path.name} line {t.line} is torn ({t.size} bytes, a writer died "
           f"mid-line); left out" for t in torn_tails]
    out += [f"note: {b.path.name} line {b.line} skipped: {b.reason}" for b in bad_lines]
    return out


def _source_row(name: str, group: list[Any]) -> list[str]:
    rewards = [f[5] for f in group if f[5] is not None]
    lat = [f[6] for f in group if f[6] is not None]
    return [name, str(len(group)), str(sum(f[1] == "completed" for f in group)),
            f"{np.mean(rewards):.4f}" if rewards else "-",
            f"{np.mean([f[7] for f in group]):.1f}",
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
