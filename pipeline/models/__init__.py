"""Local models built without any hub: a tiny chat model for tests, scenarios and CI.

Importing this package is cheap; torch and transformers load only when a model is built.
"""

from pipeline.models.tiny import (
    TinyModelSpec,
    build_tiny_model,
    default_model_dir,
    ensure_tiny_model,
)

__all__ = ["TinyModelSpec", "build_tiny_model", "default_model_dir", "ensure_tiny_model"]
