"""Local models built without any hub: a tiny chat model for tests, scenarios and CI, and the
tiny policy trained from it that really calls tools (shipped as package data).

Importing this package is cheap; torch and transformers load only when a model is built.
"""

from pipeline.models._moe import (
    TinyMoeSpec,
    build_tiny_moe_model,
    default_moe_model_dir,
    ensure_tiny_moe_model,
)
from pipeline.models._policy import tiny_policy_dir, tiny_policy_info
from pipeline.models.tiny import (
    TinyModelSpec,
    build_tiny_model,
    default_model_dir,
    ensure_tiny_model,
)

__all__ = [
    "TinyModelSpec",
    "TinyMoeSpec",
    "build_tiny_model",
    "build_tiny_moe_model",
    "default_model_dir",
    "default_moe_model_dir",
    "ensure_tiny_model",
    "ensure_tiny_moe_model",
    "tiny_policy_dir",
    "tiny_policy_info",
]
