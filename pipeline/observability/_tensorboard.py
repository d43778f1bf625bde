"""``TensorBoardSink``: batch metrics as TensorBoard scalars (needs the ``tensorboard`` extra).

Uses the event-file writer that ships with the ``tensorboard`` package itself, so neither
torch nor TensorFlow is needed::

    sink = TensorBoardSink("runs/exp1")
    log_batch_metrics(result, [sink], step)
    sink.close()
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from pipeline._exceptions import PipelineError


class TensorBoardSink:
    """Writes each metric as a scalar at the given step into ``log_dir``.

    Args:
        log_dir: the run folder TensorBoard reads (created if missing).
        flush_secs: how often the writer thread flushes to disk.

    Raises:
        PipelineError: the ``tensorboard`` package is not installed (it names the extra).
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, flush_secs: float = 10.0) -> None:
        try:
            writer_mod = importlib.import_module("tensorboard.summary.writer.event_file_writer")
            self._event_pb2: Any = importlib.import_module("tensorboard.compat.proto.event_pb2")
            self._summary_pb2: Any = importlib.import_module(
                "tensorboard.compat.proto.summary_pb2")
        except ImportError as exc:
            raise PipelineError(
                "TensorBoardSink needs the 'tensorboard' package: "
                "pip install 'rollout-pipeline[tensorboard]'") from exc
        self.log_dir = os.fspath(log_dir)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer: Any = writer_mod.EventFileWriter(self.log_dir, flush_secs=flush_secs)
        self._closed = False

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Write every metric as a scalar summary at ``step``.

        Raises:
            ValueError: the sink is closed.
        """
        if self._closed:
            raise ValueError("TensorBoardSink is closed")
        values = [self._summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
                  for tag, value in metrics.items()]
        event = self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                      summary=self._summary_pb2.Summary(value=values))
        self._writer.add_event(event)

    def flush(self) -> None:
        """Write buffered events to disk now."""
        if not self._closed:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file; idempotent."""
        if not self._closed:
            self._closed = True
            self._writer.close()

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
