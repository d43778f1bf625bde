"""Inference engines: the protocol and its implementations.

Importing this package needs neither torch nor vLLM. ``TransformersEngine`` (from
:mod:`pipeline.engines.transformers`) and ``RouterCapture`` (from :mod:`pipeline.engines.moe`)
import torch, so they are loaded on first access: ``from pipeline.engines import
TransformersEngine`` works and costs the torch import only then.
"""

from __future__ import annotations

import importlib
from typing import Any

from pipeline.engines._base import Engine, EngineLoad, Generation
from pipeline.engines._consistency import ConsistencyError, ConsistencyReport, check_consistency
from pipeline.engines._factory import ENGINE_NAMES, make_engine, resolve_engine_name
from pipeline.engines._health import ServerHealth
from pipeline.engines._openai import OpenAIEngine
from pipeline.engines._routing import Route, ServerError
from pipeline.engines._simulated import Responder, SimulatedEngine
from pipeline.engines._weight_sync import (
    PauseGate,
    PauseMode,
    WeightSync,
    WeightSyncedEngine,
    load_weights,
)
from pipeline.engines.vllm import VLLMEngine, vllm_available

__all__ = [
    "ENGINE_NAMES",
    "ConsistencyError",
    "ConsistencyReport",
    "Engine",
    "EngineLoad",
    "Generation",
    "OpenAIEngine",
    "PauseGate",
    "PauseMode",
    "Responder",
    "Route",
    "RouterCapture",
    "ServerError",
    "ServerHealth",
    "SimulatedEngine",
    "TransformersEngine",
    "VLLMEngine",
    "WeightSync",
    "WeightSyncedEngine",
    "check_consistency",
    "load_weights",
    "make_engine",
    "resolve_engine_name",
    "vllm_available",
]

_LAZY = {
    "TransformersEngine": "pipeline.engines.transformers",
    "RouterCapture": "pipeline.engines.moe",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline.engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
