"""Reading dumps back: stream lines as models; report a torn tail and bad lines, don't fail.

A process killed while writing leaves a last line without its newline: the reader reports it
as :class:`TornTail` (where it starts, how many bytes) and yields every whole line before it.
A line in the middle that is not a valid dump line (a torn line sealed by a later writer, a
hand edit) is reported as a :class:`BadLine` and skipped, unless ``strict=True``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from pydantic import ValidationError

from pipeline._exceptions import PipelineError
from pipeline.observability._schema import (
    DUMP_LINE,
    BatchEnd,
    BatchSummary,
    TrajectoryRecord,
)

_logger = structlog.get_logger("pipeline.observability")

_PREVIEW = 80


class TrajectoryFormatError(PipelineError, ValueError):
    """A dump line that cannot be read (raised only by ``strict`` readers)."""


class NotADumpError(TrajectoryFormatError):
    """A file that does not start like a trajectory dump (``TrajectoryReader(sniff_lines=)``)."""


@dataclass(frozen=True, slots=True)
class TornTail:
    """The unterminated last line of a dump: the write a killed process did not finish.

    Attributes:
        path: the file.
        line: its 1-based line number.
        offset: byte offset where it starts.
        size: its length in bytes.
        preview: its first characters.
    """

    path: Path
    line: int
    offset: int
    size: int
    preview: str


@dataclass(frozen=True, slots=True)
class BadLine:
    """A whole line that is not a valid dump line (skipped).

    Attributes:
        path: the file.
        line: its 1-based line number.
        offset: byte offset where it starts.
        reason: why it was rejected.
        preview: its first characters.
    """

    path: Path
    line: int
    offset: int
    reason: str
    preview: str


class TrajectoryReader:
    """Streams the lines of a dump, or of every ``*.jsonl`` file of a folder of rotated dumps.

    Iterate for every line (:class:`BatchSummary`, :class:`TrajectoryRecord`,
    :class:`BatchEnd`), or call :meth:`samples`. After (or during) iteration,
    :attr:`torn_tails` and :attr:`bad_lines` say what was left out.

    Args:
        path: a dump file, or a folder whose ``*.jsonl`` files are read in name order
            (numbers compared as numbers: ``step_9`` before ``step_10``).
        strict: raise :class:`TrajectoryFormatError` on a bad line (a torn tail is still
            only reported: it is what a killed writer leaves, not corruption).
        sniff_lines: when the first this many lines of the first file are all bad, raise
            :class:`NotADumpError` instead of reading (and warning about) the whole file;
            their warnings are held back until a good line shows the file is a dump.

    Raises:
        FileNotFoundError: the path does not exist (when iteration starts).
        NotADumpError: with ``sniff_lines``, the file does not start like a dump.
    """

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = False,
                 sniff_lines: int | None = None) -> None:
        self.path = Path(path)
        self.strict = strict
        self.sniff_lines = sniff_lines
        self._good = 0
        self.torn_tails: list[TornTail] = []
        self.bad_lines: list[BadLine] = []

    @property
    def torn_tail(self) -> TornTail | None:
        """The torn tail of the (last) file read, if it had one."""
        return self.torn_tails[-1] if self.torn_tails else None

    def files(self) -> list[Path]:
        """The files this reader reads, in order."""
        if self.path.is_dir():
            return sorted(self.path.glob("*.jsonl"), key=_natural)
        if not self.path.exists():
            raise FileNotFoundError(f"no trajectory dump at {self.path}")
        return [self.path]

    def __iter__(self) -> Iterator[BatchSummary | TrajectoryRecord | BatchEnd]:
        self.torn_tails.clear()
        self.bad_lines.clear()
        self._good = 0
        for path in self.files():
            yield from self._read_file(path)

    def samples(self) -> Iterator[TrajectoryRecord]:
        """Only the sample lines."""
        for line in self:
            if isinstance(line, TrajectoryRecord):
                yield line

    def _read_file(self, path: Path) -> Iterator[BatchSummary | TrajectoryRecord | BatchEnd]:
        offset = 0
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                start, offset = offset, offset + len(raw)
                if not raw.endswith(b"\n"):
                    tail = TornTail(path, lineno, start, len(raw), _preview(raw))
                    self.torn_tails.append(tail)
                    _logger.warning("trajectory_torn_tail", path=str(path), line=lineno,
                                    offset=start, size=len(raw))
                    return
                if not raw.strip():
                    continue
                try:
                    line = DUMP_LINE.validate_json(raw)
                except ValidationError as exc:
                    reason = _reason(exc)
                    if self.strict:
                        raise TrajectoryFormatError(
                            f"{path.name} line {lineno}: {reason}") from None
                    self.bad_lines.append(BadLine(path, lineno, start, reason, _preview(raw)))
                    if self._good or self.sniff_lines is None:
                        _log_bad(self.bad_lines[-1])
                    elif len(self.bad_lines) >= self.sniff_lines:
                        raise NotADumpError(
                            f"{path} is not a trajectory dump: its first "
                            f"{len(self.bad_lines)} lines are not dump lines (line "
                            f"{self.bad_lines[0].line}: {self.bad_lines[0].reason})") from None
                    continue
                if not self._good and self.sniff_lines is not None:
                    for held in self.bad_lines:  # it is a dump after all: warn as usual
                        _log_bad(held)
                self._good += 1
                yield line


def _log_bad(bad: BadLine) -> None:
    _logger.warning("trajectory_bad_line", path=str(bad.path), line=bad.line, reason=bad.reason)


@dataclass
class TrajectoryDump:
    """A whole dump in memory: batch lines, sample lines, and what could not be read."""

    path: Path
    batches: list[BatchSummary] = field(default_factory=list)
    ends: list[BatchEnd] = field(default_factory=list)
    samples: list[TrajectoryRecord] = field(default_factory=list)
    torn_tails: list[TornTail] = field(default_factory=list)
    bad_lines: list[BadLine] = field(default_factory=list)

    @property
    def torn_tail(self) -> TornTail | None:
        """The torn tail of the last file, if it had one."""
        return self.torn_tails[-1] if self.torn_tails else None

    def batch(self, batch_id: str | None) -> BatchSummary | None:
        """The summary line of a batch, by id."""
        return next((b for b in self.batches if b.batch_id == batch_id), None)

    def find(self, uid: str) -> list[TrajectoryRecord]:
        """Samples whose uid is ``uid``, or else starts with it (a unique prefix finds one)."""
        exact = [s for s in self.samples if s.uid == uid]
        return exact or [s for s in self.samples if s.uid.startswith(uid)]


def read_trajectories(path: str | os.PathLike[str], *, strict: bool = False) -> TrajectoryDump:
    """Read a whole dump (see :class:`TrajectoryReader` for streaming).

    Args:
        path: a dump file, or a folder of rotated ``*.jsonl`` dumps.
        strict: raise on a bad line instead of reporting it.

    Returns:
        The dump's batches, samples and any torn tail / bad lines.

    Raises:
        FileNotFoundError: the path does not exist.
        TrajectoryFormatError: a bad line, when ``strict``.
    """
    reader = TrajectoryReader(path, strict=strict)
    dump = TrajectoryDump(Path(path))
    for line in reader:
        if isinstance(line, TrajectoryRecord):
            dump.samples.append(line)
        elif isinstance(line, BatchSummary):
            dump.batches.append(line)
        else:
            dump.ends.append(line)
    dump.torn_tails, dump.bad_lines = list(reader.torn_tails), list(reader.bad_lines)
    return dump


def _natural(path: Path) -> list[Any]:
    """Name order with numbers compared as numbers (``step_9`` before ``step_10``)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", path.name)]


def _preview(raw: bytes) -> str:
    text = raw[:_PREVIEW * 4].decode("utf-8", errors="replace").rstrip("\n")
    return text[:_PREVIEW] + ("..." if len(text) > _PREVIEW else "")


def _reason(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"])
    return f"{err['msg']}" + (f" at '{loc}'" if loc else "")
