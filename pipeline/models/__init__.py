"""Local models built without any hub. Two dense tiny Qwen2 models of the same shape and
tokenizer, easy to mix up:

- the tiny **policy**, :func:`tiny_policy_dir`: trained to solve arithmetic word problems with
  the calculator tool (about a third right), shipped as package data; ``rollout run arith``
  runs it. It was trained on the rows of :func:`scenarios.arith_tools.rows` (a system prompt,
  the question and the calculator's schema): other prompts get little reward from it;
- the **random** tiny model, :func:`ensure_random_tiny_model` (older name
  :func:`ensure_tiny_model`): random weights, built in seconds and cached; for tests of the
  machinery (engines, templates, token accounting). It never calls a tool on its own.

Importing this package is cheap; torch and transformers load only when a model is built.
"""

from pipeline.models._cache import ModelKind
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
    ensure_random_tiny_model,
    ensure_tiny_model,
)

__all__ = [
    "ModelKind",
    "TinyModelSpec",
    "TinyMoeSpec",
    "build_tiny_model",
    "build_tiny_moe_model",
    "default_model_dir",
    "default_moe_model_dir",
    "ensure_random_tiny_model",
    "ensure_tiny_model",
    "ensure_tiny_moe_model",
    "tiny_policy_dir",
    "tiny_policy_info",
]
