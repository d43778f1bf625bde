"""pipeline: an asyncio stage pipeline for LLM agent rollouts in RL training.

A rollout is a list of async stages run on an :class:`AgentRolloutItem`; the
:class:`Pipeline` runs a batch of them with per-sample deadlines and failure isolation and
hands the trainer one :class:`RolloutSample` per sample, in input order.
"""

from pipeline import artifacts
from pipeline._config import PipelineConfig, SamplingParams
from pipeline._context import Context, Resources
from pipeline._exceptions import (
    ConfigError,
    ContractError,
    EngineError,
    PipelineError,
    RowError,
    SampleAborted,
    StageDefinitionError,
)
from pipeline._fill import SampleBuilder, fill_sample, minimal_sample
from pipeline._models import (
    AgentMessage,
    AgentRolloutItem,
    BatchStats,
    ExitReason,
    FinishReason,
    ProduceBatchResult,
    RolloutSample,
    StageRecord,
    Status,
    ToolCall,
    ToolFunction,
)
from pipeline._pipeline import InflightSample, Pipeline
from pipeline._rows import DatasetRow, iter_rows, load_rows, parse_row
from pipeline._stats import compute_stats
from pipeline._tokenizer import Tokenizer
from pipeline.batch import (
    GroupSummary,
    collate,
    group_advantages,
    group_indices,
    summarize_groups,
    to_verl_batch,
    to_verl_outputs,
    to_xtuner,
)
from pipeline.diagnostics import (
    DiagnosticsError,
    Watchdog,
    asyncio_run,
    capture_snapshot,
    install_task_dumper,
)
from pipeline.engines import Engine, Generation, SimulatedEngine
from pipeline.judgers import JudgeError, Judger, JudgeResult, get_judger, register_judger
from pipeline.models import ensure_tiny_model
from pipeline.observability import (
    BatchProgress,
    MetricsSink,
    StructlogSink,
    TensorBoardSink,
    TrajectoryReader,
    TrajectoryRecord,
    TrajectoryWriter,
    batch_metrics,
    build_trace,
    chain_callbacks,
    log_batch_metrics,
    read_trajectories,
    write_trace,
)
from pipeline.proxy import (
    AgentEndpoint,
    ProxyConfig,
    ProxyError,
    ProxyServer,
    RemoteAgent,
    RemoteAgentError,
)
from pipeline.ratelimit import (
    FairAsyncTokenBucket,
    LimiterClosed,
    LimiterConflict,
    LimiterRegistry,
    RateLimitError,
)
from pipeline.stages import (
    BuildPrompt,
    CallTools,
    FunctionStage,
    Generate,
    Judge,
    JudgerSpec,
    Loop,
    Stage,
    as_stage,
)
from pipeline.tools import (
    CalculatorError,
    FunctionTool,
    HermesToolParser,
    Tool,
    ToolParser,
    calculator_tool,
    make_registry,
)

__version__ = "0.1.0"

__all__ = [
    "AgentEndpoint",
    "AgentMessage",
    "AgentRolloutItem",
    "BatchProgress",
    "BatchStats",
    "BuildPrompt",
    "CalculatorError",
    "CallTools",
    "ConfigError",
    "Context",
    "ContractError",
    "DatasetRow",
    "DiagnosticsError",
    "Engine",
    "EngineError",
    "ExitReason",
    "FairAsyncTokenBucket",
    "FinishReason",
    "FunctionStage",
    "FunctionTool",
    "Generate",
    "Generation",
    "GroupSummary",
    "HermesToolParser",
    "InflightSample",
    "Judge",
    "JudgeError",
    "JudgeResult",
    "Judger",
    "JudgerSpec",
    "LimiterClosed",
    "LimiterConflict",
    "LimiterRegistry",
    "Loop",
    "MetricsSink",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "ProduceBatchResult",
    "ProxyConfig",
    "ProxyError",
    "ProxyServer",
    "RateLimitError",
    "RemoteAgent",
    "RemoteAgentError",
    "Resources",
    "RolloutSample",
    "RowError",
    "SampleAborted",
    "SampleBuilder",
    "SamplingParams",
    "SimulatedEngine",
    "Stage",
    "StageDefinitionError",
    "StageRecord",
    "Status",
    "StructlogSink",
    "TensorBoardSink",
    "Tokenizer",
    "Tool",
    "ToolCall",
    "ToolFunction",
    "ToolParser",
    "TrajectoryReader",
    "TrajectoryRecord",
    "TrajectoryWriter",
    "Watchdog",
    "artifacts",
    "as_stage",
    "asyncio_run",
    "batch_metrics",
    "build_trace",
    "calculator_tool",
    "capture_snapshot",
    "chain_callbacks",
    "collate",
    "compute_stats",
    "ensure_tiny_model",
    "fill_sample",
    "get_judger",
    "group_advantages",
    "group_indices",
    "install_task_dumper",
    "iter_rows",
    "load_rows",
    "log_batch_metrics",
    "make_registry",
    "minimal_sample",
    "parse_row",
    "read_trajectories",
    "register_judger",
    "summarize_groups",
    "to_verl_batch",
    "to_verl_outputs",
    "to_xtuner",
    "write_trace",
]
