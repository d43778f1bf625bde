"""Fixtures and helpers for tests on the real tiny model.

A test module registers the fixtures with ``pytest_plugins = ["_model_fixtures"]`` and imports
the helpers it uses. The model is built once per run: into ``$ROLLOUT_TINY_MODEL_DIR``
when that is set (a cache across runs), else into the run's temporary directory (under xdist,
the folder all workers share; the first worker builds it, the others wait and reuse it).

PYTEST_DONT_REWRITE (no asserts here; lets test modules import helpers before registering).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from filelock import FileLock  # noqa: E402  (installed with transformers)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from pipeline.engines.transformers import TransformersEngine  # noqa: E402
from pipeline.models.tiny import ENV_DIR, ensure_tiny_model  # noqa: E402

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.environ.get(ENV_DIR):
        return ensure_tiny_model()
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, shared by its xdist workers: one build per run
    target = root / "models" / "tiny-qwen2"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # the others wait for the first build, then reuse it
        return ensure_tiny_model(target)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def engine_model(tiny_model_dir: Path) -> Any:
    """The model the engines run on (shared: engines only read it)."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def reference_model(tiny_model_dir: Path) -> Any:
    """A second, independent copy of the model, used only to re-score sequences."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def make_engine(engine_model: Any, tiny_tokenizer: Any) -> Iterator[Any]:
    """``make_engine(**kwargs)`` -> a TransformersEngine on the shared model, closed after."""
    made: list[TransformersEngine] = []

    def make(**kwargs: Any) -> TransformersEngine:
        kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
        engine = TransformersEngine(engine_model, tiny_tokenizer, **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        asyncio.run(engine.aclose())


def rescore(model: Any, ids: Sequence[int], start: int) -> Any:
    """Raw next-token log-softmax ``[len(ids) - start, vocab]`` for positions ``start..``:
    row ``j`` is the distribution token ``ids[start + j]`` was drawn from (no processing)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0].float()
    return torch.log_softmax(logits[start - 1:len(ids) - 1], dim=-1)


class ForcedText:
    """Constrained decoding for tests: only token sequences from ``choices`` are allowed.

    At each step the allowed tokens are the next tokens of every choice that the tokens
    generated so far are a prefix of; after a complete choice only the stop token is allowed.
    Where choices share a prefix there is exactly one allowed token (its logprob is 0); where
    they branch the model really samples among them (renormalised over the allowed tokens).
    """

    def __init__(self, choices: Sequence[Sequence[int]], stop_token: int) -> None:
        self.choices = [list(c) for c in choices]
        self.stop_token = stop_token

    def allowed(self, generated: Sequence[int]) -> set[int]:
        done = len(generated)
        out: set[int] = set()
        for choice in self.choices:
            if list(generated[:len(choice)]) != choice[:done]:
                continue
            out.add(choice[done] if done < len(choice) else self.stop_token)
        return out

    def __call__(self, generated: Sequence[int], logits: Any) -> Any:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[list(self.allowed(generated))] = True
        return logits.masked_fill(~keep, float("-inf"))
