"""Helpers of the vision-language tests: small PNG data URLs, the zoom tool loop (a scripted
first turn that calls it, the reference conversation), and the tiny VL model's processor
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

from pipeline import FinishReason
from pipeline.engines import Generation
from pipeline.multimodal import ensure_tiny_vl_model, tiny_vl_processor

ZOOM = {"type": "function", "function": {
    "name": "zoom", "description": "Zoom into the image; returns the zoomed image.",
    "parameters": {"type": "object", "properties": {"factor": {"type": "integer"}},
                   "required": ["factor"]}}}
CALL = '<tool_call>\n{"name": "zoom", "arguments": {"factor": 2}}\n</tool_call>'
ZOOM_PROMPT = "Zoom in, then say the color."


def zoom_conversation() -> list[dict[str, Any]]:
    """The zoom loop's conversation up to the model's answer, images as bare parts (what a
    processor's chat template takes for the reference rendering)."""
    return [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": ZOOM_PROMPT}]},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
             "function": {"name": "zoom", "arguments": {"factor": 2}}}]},
            {"role": "tool", "name": "zoom", "content": [{"type": "image"},
                                                        {"type": "text", "text": "zoom x2"}]}]


class PassThroughEngine:
    """A real engine behind a test's wrapper: each request goes to it with the sample's
    images; ``abort`` and ``aclose`` too. Subclasses record or script what they need."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_model_len = getattr(engine, "max_model_len", None)

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str, *,
                       multi_modal: Any = None) -> Any:
        return await self.engine.generate(prompt_ids, sampling, request_id,
                                          multi_modal=multi_modal)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def aclose(self) -> None:
        await self.engine.aclose()


class ScriptedCallThenModel(PassThroughEngine):
    """Turn 0 is a scripted tool call in the template's format (a random-weight model never
    writes one); later turns are the real engine's, with the sample's images."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        super().__init__(engine)
        self.call = [*tokenizer.encode(CALL, add_special_tokens=False),
                     tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.seen: list[tuple[list[int], Any]] = []

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str, *,
                       multi_modal: Any = None) -> Any:
        self.seen.append((list(prompt_ids), multi_modal))
        if request_id.endswith("-0"):
            return Generation(list(self.call), [0.0] * len(self.call), FinishReason.STOP,
                              "stop_token")
        return await super().generate(prompt_ids, sampling, request_id,
                                      multi_modal=multi_modal)


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
