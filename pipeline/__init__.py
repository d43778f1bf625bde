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
from pipeline.diagnostics.run import asyncio_run
from pipeline.engines import Engine, Generation, SimulatedEngine
from pipeline.stages import BuildPrompt, FunctionStage, Generate, Loop, Stage, as_stage

__version__ = "0.1.0"

__all__ = [
    "AgentMessage",
    "AgentRolloutItem",
    "BatchStats",
    "BuildPrompt",
    "ConfigError",
    "Context",
    "ContractError",
    "DatasetRow",
    "Engine",
    "EngineError",
    "ExitReason",
    "FinishReason",
    "FunctionStage",
    "Generate",
    "Generation",
    "InflightSample",
    "Loop",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "ProduceBatchResult",
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
    "Tokenizer",
    "ToolCall",
    "ToolFunction",
    "artifacts",
    "as_stage",
    "asyncio_run",
    "compute_stats",
    "fill_sample",
    "iter_rows",
    "load_rows",
    "minimal_sample",
    "parse_row",
]
