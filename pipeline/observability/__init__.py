"""Observability: crash-safe trajectory dumps, batch timelines, metrics, inspection, progress.

- :class:`TrajectoryWriter` / :class:`TrajectoryReader` / :func:`read_trajectories`: one JSON
  line per sample, written as samples finish; a torn last line is reported, not fatal.
- :func:`build_trace` / :func:`write_trace`: a dump as a Chrome/Perfetto trace.
- :func:`batch_metrics` and :class:`MetricsSink` (:class:`StructlogSink`,
  :class:`TensorBoardSink`): per-batch figures.
- :func:`render_summary` / :func:`render_trajectory` / :func:`render_failures`: a dump as text.
- :class:`BatchProgress`: live done/failed/timeout counts; :class:`ProgressHeartbeat`: the
  runner's periodic progress log line (``PipelineConfig.progress_log_s``).
- :func:`trace_command` / :func:`inspect_command`: the ``rollout trace`` / ``rollout inspect``
  commands.
"""

from pipeline._runner.heartbeat import ProgressHeartbeat
from pipeline.observability._inspection import (
    inspect_command,
    render_failures,
    render_summary,
    render_trajectory,
)
from pipeline.observability._metrics import (
    ALWAYS_KEYS,
    MetricsSink,
    StructlogSink,
    batch_metrics,
    limiter_metrics,
    log_batch_metrics,
)
from pipeline.observability._progress import BatchProgress, chain_callbacks
from pipeline.observability._reader import (
    BadLine,
    NotADumpError,
    TornTail,
    TrajectoryDump,
    TrajectoryFormatError,
    TrajectoryReader,
    read_trajectories,
)
from pipeline.observability._records import trajectory_record
from pipeline.observability._schema import (
    SCHEMA_VERSION,
    AgentTrace,
    BatchEnd,
    BatchSummary,
    StageTiming,
    TokenData,
    TrajectoryRecord,
)
from pipeline.observability._tensorboard import TensorBoardSink
from pipeline.observability._trace import (
    build_trace,
    stage_category,
    trace_command,
    trace_events,
    write_trace,
)
from pipeline.observability._writer import TrajectoryWriter

__all__ = [
    "ALWAYS_KEYS",
    "SCHEMA_VERSION",
    "AgentTrace",
    "BadLine",
    "BatchEnd",
    "BatchProgress",
    "BatchSummary",
    "MetricsSink",
    "NotADumpError",
    "ProgressHeartbeat",
    "StageTiming",
    "StructlogSink",
    "TensorBoardSink",
    "TokenData",
    "TornTail",
    "TrajectoryDump",
    "TrajectoryFormatError",
    "TrajectoryReader",
    "TrajectoryRecord",
    "TrajectoryWriter",
    "batch_metrics",
    "build_trace",
    "chain_callbacks",
    "inspect_command",
    "limiter_metrics",
    "log_batch_metrics",
    "read_trajectories",
    "render_failures",
    "render_summary",
    "render_trajectory",
    "stage_category",
    "trace_command",
    "trace_events",
    "trajectory_record",
    "write_trace",
]
