"""A tiny Qwen3-MoE chat model built locally: the MoE sibling of :mod:`pipeline.models.tiny`.

Run ``python -m pipeline.models.tiny --kind moe DIR`` to build it into ``DIR`` (or call
:func:`ensure_tiny_moe_model`, which builds once and caches). Same tokenizer and chat template
as the tiny dense model (built by its code); the model is a ``Qwen3MoeForCausalLM`` with a few
experts per layer and top-2 routing, random weights from a seeded generator, so the same spec
gives byte-identical files. Its router spreads tokens over all experts, which is what tests of
routing capture and replay need; its text is random.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.models._cache import ModelKind
from pipeline.models.tiny import TinyModelSpec, build_tokenizer

ENV_DIR = "ROLLOUT_TINY_MOE_MODEL_DIR"
"""Environment variable that overrides where :func:`ensure_tiny_moe_model` caches the model."""

MARKER = "rollout_tiny_moe_model.json"
"""File written last into a finished build; holds the spec it was built from."""

_BUILDER_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TinyMoeSpec:
    """Shape and seed of the tiny MoE model; the defaults are what tests use.

    Every layer is sparse (``decoder_sparse_step=1``): ``num_hidden_layers`` MoE layers with
    ``num_experts`` experts each, ``num_experts_per_tok`` chosen per token. ``router_std``
    sets the router weights' scale: with the default the router logits have a spread of
    about one, so tokens go to every expert rather than always the same two.
    """

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 128
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    num_experts: int = 4
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 4096
    embedding_std: float = 1.0
    weight_std: float = 0.1
    router_std: float = 0.1
    lm_head_std: float = 0.2


def default_moe_model_dir() -> Path:
    """``$ROLLOUT_TINY_MOE_MODEL_DIR``, else ``$XDG_CACHE_HOME/rollout-pipeline/
    tiny-qwen3-moe`` (``~/.cache`` when XDG is unset)."""
    return MOE.default_dir()


def ensure_tiny_moe_model(directory: Path | None = None, spec: TinyMoeSpec | None = None, *,
                          rebuild: bool = False) -> Path:
    """Return a directory holding the tiny MoE model, building it first if needed (same
    caching rules as :func:`pipeline.models.ensure_tiny_model`).

    Args:
        directory: where the model lives; default :func:`default_moe_model_dir`.
        spec: shape and seed; default :class:`TinyMoeSpec()`.
        rebuild: build again even when a finished build with this spec is there.

    Returns:
        The model directory.

    Raises:
        ConfigError: ``directory`` exists, is not empty and is not a tiny-MoE build.
    """
    return MOE.ensure(directory, spec or TinyMoeSpec(), rebuild=rebuild)


def build_tiny_moe_model(directory: Path, spec: TinyMoeSpec | None = None) -> Path:
    """Build the tokenizer and the random-weight MoE model into ``directory``.

    Deterministic: the same spec writes the same files. Needs the ``transformers`` extra.

    Returns:
        ``directory``.
    """
    return MOE.build_into(Path(directory), spec or TinyMoeSpec())


def _write_model(directory: Path, spec: TinyMoeSpec) -> None:
    tokenizer = build_tokenizer(TinyModelSpec(
        vocab_size=spec.vocab_size, max_position_embeddings=spec.max_position_embeddings))
    tokenizer.save_pretrained(directory)
    build_moe_model(spec, tokenizer).save_pretrained(directory)


def build_moe_model(spec: TinyMoeSpec, tokenizer: Any) -> Any:
    """The random-weight ``Qwen3MoeForCausalLM`` for ``tokenizer``, in memory (eval mode)."""
    import torch

    hf: Any = importlib.import_module("transformers")  # untyped at this boundary
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = hf.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size * spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad, dtype="float32")
    model = hf.Qwen3MoeForCausalLM(config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = (spec.embedding_std if "embed_tokens" in name
                       else spec.lm_head_std if name.startswith("lm_head")
                       else spec.router_std if name.endswith("mlp.gate.weight")
                       else spec.weight_std)
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.generation_config = hf.GenerationConfig(eos_token_id=eos, pad_token_id=pad,
                                                  bos_token_id=None)
    return model.eval()


MOE = ModelKind(label="tiny-MoE", env_var=ENV_DIR, cache_name="tiny-qwen3-moe", marker=MARKER,
                builder_version=_BUILDER_VERSION, build=_write_model)
"""How the tiny MoE model is cached and built (see :class:`~pipeline.models._cache.ModelKind`)."""
