"""``TrajectoryWriter``: crash-safe JSONL dumps of every sample, written as samples finish.

Every line goes to the file with ``os.write`` the moment it is built: nothing is held in a
buffer across samples, so a process killed mid-batch loses at most the line being written,
and the reader reports that torn tail instead of failing. Reopening a file whose last line is
torn first ends that line, so the next batch's lines start clean.

Usage, line by line as samples finish::

    writer = TrajectoryWriter("dumps/rollouts.jsonl", tokenizer=tokenizer)
    writer.begin_batch(step=step)
    result = await pipeline.run_batch(rows, on_sample_done=writer.write)
    writer.end_batch(result)

A path with a ``{step}`` field (``"dumps/step_{step:06d}.jsonl"``) rotates: each batch goes to
the file of its step. Any other path collects every batch in one file.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog

from pipeline._data.models import AgentRolloutItem, BatchStats, ProduceBatchResult, RolloutSample
from pipeline._exceptions import ConfigError
from pipeline._text.tokenizer import Tokenizer
from pipeline.observability._records import dumps_line, minimal_record, trajectory_record
from pipeline.observability._schema import SCHEMA_VERSION

_logger = structlog.get_logger("pipeline.observability")


class TrajectoryWriter:
    """Appends batches of sample lines to a JSONL dump (or one file per step).

    Args:
        path: the dump file; a ``{step}`` field in it (``"run/step_{step:05d}.jsonl"``)
            writes each batch to its step's file instead of appending to one file.
        tokenizer: decodes each response into the line's ``response`` text.
        include_token_ids: also dump prompt/response ids, mask and logprobs (large).
        fsync: ``fsync`` after every line (survives power loss, not only a killed process;
            costs a disk flush per sample). The file is always synced when a batch ends.
        raise_errors: re-raise write errors. Off by default: :meth:`write` runs inside the
            pipeline's ``on_sample_done`` callback, where an exception would end the batch;
            errors are logged and counted in :attr:`errors` instead.
        chunk_bytes: the most bytes handed to one ``os.write`` call.

    Raises:
        ConfigError: a path whose ``{...}`` fields are not just ``{step}``.
    """

    def __init__(self, path: str | os.PathLike[str], *, tokenizer: Tokenizer | None = None,
                 include_token_ids: bool = False, fsync: bool = False,
                 raise_errors: bool = False, chunk_bytes: int = 1 << 20) -> None:
        self._template = os.fspath(path)
        self.rotate = "{" in self._template
        if self.rotate:
            try:
                self._template.format(step=0)
            except (KeyError, IndexError, ValueError) as exc:
                raise ConfigError(f"trajectory path {self._template!r}: the only field a "
                                  f"path may hold is {{step}} ({exc!r})") from None
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.tokenizer = tokenizer
        self.include_token_ids = include_token_ids
        self.fsync = fsync
        self.raise_errors = raise_errors
        self.chunk_bytes = chunk_bytes
        self.errors = 0
        """Lines that could not be written (each is logged)."""
        self.written = 0
        """Sample lines written by this writer, all batches."""
        self._fd: int | None = None
        self._path: Path | None = None
        self._lock = threading.Lock()
        self._batch_id: str | None = None
        self._step: int | None = None
        self._batch_written = 0
        self._batch_errors = 0
        self._next_step = 0
        self._closed = False

    @property
    def path(self) -> Path | None:
        """The file being written now (None before the first batch)."""
        return self._path

    @property
    def batch_id(self) -> str | None:
        """The id of the open batch, or None between batches."""
        return self._batch_id

    def begin_batch(self, *, step: int | None = None, num_samples: int | None = None,
                    meta: Mapping[str, Any] | None = None) -> str:
        """Open a batch: write its summary line (ending a batch still open first).

        Args:
            step: the trainer step; defaults to one more than the last batch's.
            num_samples: how many samples the batch will have, if known.
            meta: anything to keep with the batch (model name, config, ...); JSON-able.

        Returns:
            The batch id written on each of its lines.

        Raises:
            ValueError: the writer is closed.
            OSError: the file cannot be opened or written.
        """
        with self._lock:
            if self._closed:
                raise ValueError("TrajectoryWriter is closed")
            if self._batch_id is not None:
                self._end_locked(None)
            step = self._next_step if step is None else step
            self._next_step = step + 1
            self._open(Path(self._template.format(step=step)) if self.rotate
                       else Path(self._template))
            self._batch_id, self._step = uuid.uuid4().hex[:12], step
            self._batch_written = self._batch_errors = 0
            self._write_line({
                "type": "batch", "version": SCHEMA_VERSION, "batch_id": self._batch_id,
                "step": step, "started_wall": time.time(), "monotonic": time.monotonic(),
                "host": socket.gethostname(), "pid": os.getpid(),
                "python": platform.python_version(), "num_samples": num_samples,
                "include_token_ids": self.include_token_ids, "meta": dict(meta or {}),
            })
            return self._batch_id

    def write(self, item: AgentRolloutItem, sample: RolloutSample) -> None:
        """Write one finished sample's line now; fits ``run_batch(on_sample_done=...)``.

        Opens a batch first if none is open. Never raises (unless ``raise_errors``): a
        sample that cannot be dumped in full gets a minimal line naming the problem, and a
        failed write is logged and counted.
        """
        try:
            if self._batch_id is None:
                self.begin_batch()
            with self._lock:
                try:
                    line = trajectory_record(
                        item, sample, tokenizer=self.tokenizer,
                        include_token_ids=self.include_token_ids, step=self._step,
                        batch_id=self._batch_id)
                    data = dumps_line(line)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    _logger.error("trajectory_line_failed", uid=item.uid, error=error)
                    data = dumps_line(minimal_record(item, sample, error, step=self._step,
                                                     batch_id=self._batch_id))
                self._write_bytes(data)
                self._batch_written += 1
                self.written += 1
        except Exception as exc:
            self.errors += 1
            self._batch_errors += 1
            _logger.error("trajectory_write_failed", uid=item.uid, path=str(self._path),
                          error=f"{type(exc).__name__}: {exc}")
            if self.raise_errors:
                raise

    def end_batch(self, result: ProduceBatchResult | BatchStats | None = None) -> None:
        """Close the open batch: write its closing line with the stats, sync the file.

        Args:
            result: the batch's result (or just its stats) for the closing line.

        Raises:
            OSError: the closing line cannot be written.
        """
        with self._lock:
            if self._batch_id is not None:
                stats = result.stats if isinstance(result, ProduceBatchResult) else result
                self._end_locked(stats)

    def write_batch(self, result: ProduceBatchResult, *, step: int | None = None,
                    meta: Mapping[str, Any] | None = None) -> None:
        """Write a whole finished batch at once (summary, every sample, closing line).

        Raises:
            ValueError: the writer is closed.
            OSError: the file cannot be written.
        """
        self.begin_batch(step=step, num_samples=len(result.samples), meta=meta)
        for item, sample in zip(result.items, result.samples, strict=True):
            self.write(item, sample)
        self.end_batch(result)

    def close(self) -> None:
        """End the open batch without stats (if any), sync and close the file. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._batch_id is not None:
                    self._end_locked(None)
            finally:
                self._closed = True
                self._close_fd()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _end_locked(self, stats: BatchStats | None) -> None:
        line = {"type": "batch_end", "batch_id": self._batch_id, "step": self._step,
                "ended_wall": time.time(), "monotonic": time.monotonic(),
                "written": self._batch_written, "write_errors": self._batch_errors,
                "stats": None if stats is None else stats.model_dump(mode="json")}
        self._batch_id = None
        self._write_line(line)
        if self._fd is not None:
            os.fsync(self._fd)

    def _open(self, path: Path) -> None:
        if self._fd is not None and path == self._path:
            return
        self._close_fd()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                _logger.warning("trajectory_torn_tail_sealed", path=str(path), size=size)
                _write_all(fd, b"\n", self.chunk_bytes)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._path = fd, path

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _write_line(self, line: Mapping[str, Any]) -> None:
        self._write_bytes(dumps_line(line))

    def _write_bytes(self, data: bytes) -> None:
        if self._fd is None:
            raise ValueError("TrajectoryWriter has no open file (closed?)")
        _write_all(self._fd, data, self.chunk_bytes)
        if self.fsync:
            os.fsync(self._fd)


def _write_all(fd: int, data: bytes, chunk: int) -> None:
    """Write every byte: ``os.write`` may write less than asked."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view[:chunk])
        view = view[written:]
