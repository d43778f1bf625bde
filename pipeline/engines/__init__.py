"""Inference engines: the protocol and its implementations.

Importing this package needs neither torch nor vLLM; ``TransformersEngine`` lives in
:mod:`pipeline.engines.transformers` (imports torch) and ``RouterCapture`` in
:mod:`pipeline.engines.moe`.
"""

from pipeline.engines.base import Engine, Generation
from pipeline.engines.consistency import ConsistencyError, ConsistencyReport, check_consistency
from pipeline.engines.factory import ENGINE_NAMES, make_engine, resolve_engine_name
from pipeline.engines.openai import OpenAIEngine, ServerError
from pipeline.engines.simulated import SimulatedEngine
from pipeline.engines.vllm import VLLMEngine, vllm_available
from pipeline.engines.weight_sync import (
    PauseGate,
    PauseMode,
    WeightSync,
    WeightSyncedEngine,
    load_weights,
)

__all__ = [
    "ENGINE_NAMES",
    "ConsistencyError",
    "ConsistencyReport",
    "Engine",
    "Generation",
    "OpenAIEngine",
    "PauseGate",
    "PauseMode",
    "ServerError",
    "SimulatedEngine",
    "VLLMEngine",
    "WeightSync",
    "WeightSyncedEngine",
    "check_consistency",
    "load_weights",
    "make_engine",
    "resolve_engine_name",
    "vllm_available",
]
