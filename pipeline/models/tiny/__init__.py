"""The *random* tiny Qwen2 chat model, built locally: no hub, seeded, a few seconds on a CPU.

Its weights are random: it shows the machinery (engines, templates, token accounting), not
skill. The model ``rollout run arith`` runs is another one, the tiny *policy* trained from this
shape to call the calculator: :func:`pipeline.models.tiny_policy_dir`.

Run ``python -m pipeline.models.tiny DIR`` to build it into ``DIR`` (or call
:func:`ensure_random_tiny_model`, which builds once and caches; :func:`ensure_tiny_model` is
its older name). The result is a standard Hugging Face
model directory (``config.json``, ``model.safetensors``, ``tokenizer.json``, chat template), so
``transformers`` and vLLM load it like any other Qwen2 model.

What is built:

* a byte-level BPE tokenizer trained on a small built-in corpus, with ChatML control tokens
  and hermes tool-call markup as single tokens, and a chat template that supports tools
  (see :mod:`pipeline.models._template`);
* a ``Qwen2ForCausalLM`` with random weights drawn from a seeded generator, so the same spec
  gives byte-identical files. Its output is random text: it never calls a tool on its own.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.models._cache import ModelKind
from pipeline.models._template import (
    CHAT_TEMPLATE,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    training_corpus,
)

ENV_DIR = "ROLLOUT_TINY_MODEL_DIR"
"""Environment variable that overrides where :func:`ensure_tiny_model` caches the model."""

MARKER = "rollout_tiny_model.json"
"""File written last into a finished build; holds the spec it was built from."""

_BUILDER_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TinyModelSpec:
    """Shape and seed of the tiny model. The defaults are what tests and scenarios use.

    ``head_dim`` is ``hidden_size / num_attention_heads`` = 64, a size every attention backend
    (vLLM's CPU one included) supports. The weight scales give next-token distributions with an
    entropy of about 4-5 nats: varied random text, neither uniform noise nor one repeated token.
    """

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    max_position_embeddings: int = 4096
    embedding_std: float = 1.0
    weight_std: float = 0.1
    lm_head_std: float = 0.2


def default_model_dir() -> Path:
    """Where the tiny model is cached: ``$ROLLOUT_TINY_MODEL_DIR``, else
    ``$XDG_CACHE_HOME/rollout-pipeline/tiny-qwen2`` (``~/.cache`` when XDG is unset)."""
    return DENSE.default_dir()


def ensure_random_tiny_model(directory: Path | None = None, spec: TinyModelSpec | None = None,
                             *, rebuild: bool = False) -> Path:
    """Return a directory holding the random tiny model, building it first if needed.

    Random weights: not the trained tiny policy of ``rollout run arith``
    (:func:`pipeline.models.tiny_policy_dir`).

    A finished build is recognised by its marker file; a build with another spec (or an older
    builder) is replaced. Builds go to a temporary sibling directory and are renamed into place,
    so concurrent callers (test workers) never see half-written files.

    Args:
        directory: where the model lives; default :func:`default_model_dir`.
        spec: shape and seed; default :class:`TinyModelSpec()`.
        rebuild: build again even when a finished build with this spec is there.

    Returns:
        The model directory.

    Raises:
        ConfigError: ``directory`` exists, is not empty and is not a tiny-model build.
    """
    return DENSE.ensure(directory, spec or TinyModelSpec(), rebuild=rebuild)


def ensure_tiny_model(directory: Path | None = None, spec: TinyModelSpec | None = None, *,
                      rebuild: bool = False) -> Path:
    """The random tiny model: the older name of :func:`ensure_random_tiny_model` (same
    arguments, same directory). It is not the trained policy ``rollout run arith`` runs;
    that is :func:`pipeline.models.tiny_policy_dir`."""
    return ensure_random_tiny_model(directory, spec, rebuild=rebuild)


def build_tiny_model(directory: Path, spec: TinyModelSpec | None = None) -> Path:
    """Build the tokenizer and the random-weight model into ``directory`` (created if needed).

    Deterministic: the same spec writes the same files. Needs ``torch``, ``transformers`` and
    ``tokenizers`` (the ``transformers`` extra).

    Returns:
        ``directory``.
    """
    return DENSE.build_into(Path(directory), spec or TinyModelSpec())


def _write_model(directory: Path, spec: TinyModelSpec) -> None:
    tokenizer = build_tokenizer(spec)
    tokenizer.save_pretrained(directory)
    ModelKind.save_model(_build_model(spec, tokenizer), directory)


def build_tokenizer(spec: TinyModelSpec) -> Any:
    """The tiny models' byte-level BPE tokenizer (a ``tokenizers.Tokenizer``), trained on the
    built-in corpus with the chat markup as single tokens; deterministic for a spec."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    hf: Any = importlib.import_module("transformers")  # untyped at this boundary

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=spec.vocab_size - len(MARKUP_TOKENS), special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(training_corpus(), trainer=trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tokenizer = hf.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"], model_max_length=spec.max_position_embeddings)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(spec: TinyModelSpec, tokenizer: Any) -> Any:
    import torch

    hf: Any = importlib.import_module("transformers")

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = hf.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad, dtype="float32")
    model = hf.Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = (spec.embedding_std if "embed_tokens" in name
                       else spec.lm_head_std if name.startswith("lm_head") else spec.weight_std)
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.generation_config = hf.GenerationConfig(eos_token_id=eos, pad_token_id=pad,
                                               bos_token_id=None)
    return model.eval()


DENSE = ModelKind(label="tiny-model", env_var=ENV_DIR, cache_name="tiny-qwen2", marker=MARKER,
                  builder_version=_BUILDER_VERSION, build=_write_model)
"""How the tiny dense model is cached and built (see :class:`~pipeline.models._cache.ModelKind`)."""
