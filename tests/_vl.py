"""Helpers of the vision-language tests: small PNG data URLs, and the tiny VL model's processor
with the model's 3-D rope positions bound to it, as verl's ``hf_processor`` binds them
(``processor.config``, ``get_rope_index``): what ``to_verl_batch`` and ``to_xtuner`` call for
mrope positions. verl's own loader needs ``AutoProcessor``, whose Qwen2-VL video processor
needs torchvision (not installable with the CPU torch here)."""

from __future__ import annotations

import base64
import copy
import io
import types
from typing import Any

from PIL import Image

from pipeline.multimodal import ensure_tiny_vl_model, tiny_vl_processor


def solid_png_url(color: tuple[int, int, int], size: tuple[int, int]) -> str:
    """A PNG of one color, as a data URL."""
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def with_rope_index(processor: Any) -> Any:
    """A copy of ``processor`` with the tiny VL model's config and its ``get_rope_index`` and
    ``get_vision_position_ids`` bound to it."""
    import transformers

    proc = copy.copy(processor)
    proc.config = transformers.AutoConfig.from_pretrained(str(ensure_tiny_vl_model()))
    model = transformers.Qwen2_5_VLModel
    proc.get_rope_index = types.MethodType(model.get_rope_index, proc)
    proc.get_vision_position_ids = types.MethodType(model.get_vision_position_ids, proc)
    return proc


def rope_processor() -> Any:
    """The tiny VL model's processor (Qwen3-VL's template) with its rope positions bound."""
    return with_rope_index(tiny_vl_processor(ensure_tiny_vl_model(), template="qwen3_vl"))
