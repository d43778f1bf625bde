"""pipeline: an asyncio stage pipeline for LLM agent rollouts in RL training.

A rollout is a list of async stages run on an :class:`AgentRolloutItem`; the
:class:`Pipeline` runs a batch of them with per-sample deadlines and failure isolation and
hands the trainer one :class:`RolloutSample` per sample, in input order.

Public API rule: inside each subpackage the modules are private (``_name.py``) and the
subpackage's ``__init__`` is its public surface (``__all__``, snapshotted by a test). The
core's private rooms (``_runner``, ``_data``, ``_text``, ``_concurrency``) hold the sample
runner, the data model, text rendering and the concurrency kit that all subpackages share. Public
modules are kept only where importing the module is the point: the ones that load a heavy
optional dependency (:mod:`pipeline.engines.vllm`, :mod:`pipeline.engines.transformers`,
:mod:`pipeline.engines.moe`),
commands (:mod:`pipeline.cli`, ``python -m pipeline.models.tiny``), test helpers
(:mod:`pipeline.testing`, :mod:`pipeline.judgers.testing`) and the artifact key names
(:mod:`pipeline.artifacts`). This package re-exports the names most programs need; the rest
live in their subpackage.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline import artifacts
    from pipeline._data.config import AdaptiveConcurrency, PipelineConfig, SamplingParams
    from pipeline._data.models import (
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
    from pipeline._data.rows import DatasetRow, iter_rows, load_rows, parse_row
    from pipeline._exceptions import (
        ConfigError,
        ContractError,
        DeadlineExceeded,
        EngineCircuitOpen,
        EngineError,
        PipelineError,
        RowError,
        SampleAborted,
        StageDefinitionError,
        StageTimeout,
        TokenIntegrityError,
    )
    from pipeline._logging import configure_logging
    from pipeline._runner.async_driver import AsyncRollout
    from pipeline._runner.async_report import AsyncReport
    from pipeline._runner.context import Context, Resources
    from pipeline._runner.dynamic import (
        DynamicSampling,
        GroupResult,
        StreamReport,
        has_reward_variance,
    )
    from pipeline._runner.fill import SampleBuilder, fill_sample
    from pipeline._runner.pipeline import Pipeline
    from pipeline._runner.stream import RolloutStream, SampleResult
    from pipeline._text.tokenizer import Tokenizer
    from pipeline.batch import collate, group_advantages, summarize_groups, to_verl_batch, to_xtuner
    from pipeline.diagnostics import Watchdog, asyncio_run, capture_snapshot, install_task_dumper
    from pipeline.engines import (
        Engine,
        Generation,
        OpenAIEngine,
        SimulatedEngine,
        VLLMEngine,
        make_engine,
    )
    from pipeline.judgers import JudgeError, Judger, JudgeResult, get_judger, register_judger
    from pipeline.models import ensure_tiny_model
    from pipeline.observability import (
        BatchProgress,
        StructlogSink,
        TrajectoryReader,
        TrajectoryWriter,
        chain_callbacks,
        log_batch_metrics,
    )
    from pipeline.proxy import ProxyServer, RemoteAgent
    from pipeline.ratelimit import FairAsyncTokenBucket, LimiterRegistry
    from pipeline.stages import BuildPrompt, CallTools, Generate, Judge, JudgerSpec, Loop, Stage
    from pipeline.tools import FunctionTool, Tool, calculator_tool, make_registry

__version__ = "0.1.0"

# Where each re-exported name lives, imported at its first use (PEP 562): a process that needs
# only the sample runner (a doc example, a CLI command, an agent program of the proxy) does not
# pay for the proxy's server, the batch adapters or observability at ``import pipeline`` (the
# suite starts hundreds of such processes). The names and their types are the imports above.
_WHERE: dict[str, tuple[str, ...]] = {
    "pipeline._data.config": ("AdaptiveConcurrency", "PipelineConfig", "SamplingParams"),
    "pipeline._data.models": (
        "AgentMessage", "AgentRolloutItem", "BatchStats", "ExitReason", "FinishReason",
        "ProduceBatchResult", "RolloutSample", "StageRecord", "Status", "ToolCall",
        "ToolFunction"
    ),
    "pipeline._data.rows": ("DatasetRow", "iter_rows", "load_rows", "parse_row"),
    "pipeline._exceptions": (
        "ConfigError", "ContractError", "DeadlineExceeded", "EngineCircuitOpen",
        "EngineError", "PipelineError", "RowError", "SampleAborted",
        "StageDefinitionError", "StageTimeout", "TokenIntegrityError"
    ),
    "pipeline._logging": ("configure_logging",),
    "pipeline._runner.async_driver": ("AsyncRollout",),
    "pipeline._runner.async_report": ("AsyncReport",),
    "pipeline._runner.context": ("Context", "Resources"),
    "pipeline._runner.dynamic": (
        "DynamicSampling", "GroupResult", "StreamReport", "has_reward_variance"
    ),
    "pipeline._runner.fill": ("SampleBuilder", "fill_sample"),
    "pipeline._runner.pipeline": ("Pipeline",),
    "pipeline._runner.stream": ("RolloutStream", "SampleResult"),
    "pipeline._text.tokenizer": ("Tokenizer",),
    "pipeline.batch": (
        "collate", "group_advantages", "summarize_groups", "to_verl_batch", "to_xtuner"
    ),
    "pipeline.diagnostics": ("Watchdog", "asyncio_run", "capture_snapshot", "install_task_dumper"),
    "pipeline.engines": (
        "Engine", "Generation", "OpenAIEngine", "SimulatedEngine", "VLLMEngine",
        "make_engine"
    ),
    "pipeline.judgers": ("JudgeError", "Judger", "JudgeResult", "get_judger", "register_judger"),
    "pipeline.models": ("ensure_tiny_model",),
    "pipeline.observability": (
        "BatchProgress", "StructlogSink", "TrajectoryReader", "TrajectoryWriter",
        "chain_callbacks", "log_batch_metrics"
    ),
    "pipeline.proxy": ("ProxyServer", "RemoteAgent"),
    "pipeline.ratelimit": ("FairAsyncTokenBucket", "LimiterRegistry"),
    "pipeline.stages": (
        "BuildPrompt", "CallTools", "Generate", "Judge", "JudgerSpec", "Loop", "Stage"
    ),
    "pipeline.tools": ("FunctionTool", "Tool", "calculator_tool", "make_registry"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


__all__ = [
    "AdaptiveConcurrency",
    "AgentMessage",
    "AgentRolloutItem",
    "AsyncReport",
    "AsyncRollout",
    "BatchProgress",
    "BatchStats",
    "BuildPrompt",
    "CallTools",
    "ConfigError",
    "Context",
    "ContractError",
    "DatasetRow",
    "DeadlineExceeded",
    "DynamicSampling",
    "Engine",
    "EngineCircuitOpen",
    "EngineError",
    "ExitReason",
    "FairAsyncTokenBucket",
    "FinishReason",
    "FunctionTool",
    "Generate",
    "Generation",
    "GroupResult",
    "Judge",
    "JudgeError",
    "JudgeResult",
    "Judger",
    "JudgerSpec",
    "LimiterRegistry",
    "Loop",
    "OpenAIEngine",
    "Pipeline",
    "PipelineConfig",
    "PipelineError",
    "ProduceBatchResult",
    "ProxyServer",
    "RemoteAgent",
    "Resources",
    "RolloutSample",
    "RolloutStream",
    "RowError",
    "SampleAborted",
    "SampleBuilder",
    "SampleResult",
    "SamplingParams",
    "SimulatedEngine",
    "Stage",
    "StageDefinitionError",
    "StageRecord",
    "StageTimeout",
    "Status",
    "StreamReport",
    "StructlogSink",
    "TokenIntegrityError",
    "Tokenizer",
    "Tool",
    "ToolCall",
    "ToolFunction",
    "TrajectoryReader",
    "TrajectoryWriter",
    "VLLMEngine",
    "Watchdog",
    "artifacts",
    "asyncio_run",
    "calculator_tool",
    "capture_snapshot",
    "chain_callbacks",
    "collate",
    "configure_logging",
    "ensure_tiny_model",
    "fill_sample",
    "get_judger",
    "group_advantages",
    "has_reward_variance",
    "install_task_dumper",
    "iter_rows",
    "load_rows",
    "log_batch_metrics",
    "make_engine",
    "make_registry",
    "parse_row",
    "register_judger",
    "summarize_groups",
    "to_verl_batch",
    "to_xtuner",
]


def __getattr__(name: str) -> Any:
    """Import a re-exported name (or a subpackage, as ``import pipeline`` once did) at first
    use and keep it, so later lookups are plain attribute reads."""
    module = _MODULE_OF.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name.isidentifier() and not name.startswith("__"):
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
