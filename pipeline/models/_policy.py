"""The tiny policy: the tiny Qwen2 model trained to solve arithmetic word problems with the
calculator tool, shipped as package data so the main job runs offline on a fresh install.

Unlike the random tiny model it writes real ``<tool_call>`` blocks and answers; on purpose it
solves only about a third of held-out problems (wrong expressions, misread results, no tool
call now and then), so RL has room to improve it. It is trained by
``python -m scenarios.train_tiny_policy`` (see that script for the recipe and the
reproducibility tolerance); ``training.json`` beside the weights records how.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline._exceptions import ConfigError

_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def tiny_policy_dir() -> Path:
    """The directory holding the shipped tiny policy (weights, tokenizer, chat template):
    the trained model ``rollout run arith`` runs (the random tiny model is
    :func:`~pipeline.models.ensure_random_tiny_model`).

    It was trained on one prompt format, the rows of :func:`scenarios.arith_tools.rows`: the
    scenario's system prompt, a word problem, the calculator's tool schema, rendered by its
    chat template; with those and the calculator tool it solves about a third of the problems
    (a bare question without the system prompt and tools: a few percent). Its weights are
    float32. It is read-only package data: copy it before changing anything in it.

    Raises:
        ConfigError: the package was installed without its data files.
    """
    directory = Path(__file__).resolve().parent / "tiny_policy"
    missing = [name for name in _FILES if not (directory / name).is_file()]
    if missing:
        raise ConfigError(f"the tiny policy is incomplete in {directory} (missing: "
                          f"{', '.join(missing)}); reinstall the package with its data, or "
                          "train it with `python -m scenarios.train_tiny_policy`")
    return directory


def tiny_policy_info() -> dict[str, Any]:
    """What ``training.json`` records: the recipe, training time and held-out figures."""
    path = tiny_policy_dir() / "training.json"
    try:
        found: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return found
