"""Images in the turns after the prompt (a tool that returns a screenshot), and what the
engine is handed for a sample.

A tool turn's tokens are the chat template's delta after the model's stop token
(:func:`pipeline._text.render.render_turn_delta`), rendered with each image as its placeholder
and then expanded by the processor, exactly as in the prompt: the image tokens go into the
response with ``response_mask = 0``, the pixel inputs are appended to the sample's.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline._data.models import AgentMessage
from pipeline._text.render import TurnDelta, render_turn_delta
from pipeline.multimodal._images import ImageError, has_images
from pipeline.multimodal._inputs import (
    MULTI_MODAL,
    MultiModalInputs,
    SampleImages,
    VisionProcessor,
)


def multi_modal_inputs(artifacts: Mapping[str, Any]) -> MultiModalInputs | None:
    """The sample's pixel inputs so far (prompt and tool turns), or None without images."""
    state = artifacts.get(MULTI_MODAL)
    if isinstance(state, SampleImages) and state.inputs:
        return state.inputs
    return None


async def expand_observation(artifacts: Mapping[str, Any], history: Sequence[AgentMessage],
                             new_messages: Sequence[AgentMessage],
                             tools: Sequence[dict[str, Any]] | None, last_token: int,
                             options: Mapping[str, Any] | None
                             ) -> tuple[list[AgentMessage], TurnDelta, MultiModalInputs] | None:
    """The template delta of ``new_messages`` when they hold images, in a worker thread.

    Returns:
        None when no new message has an image part (render as text). Else the messages with
        each image replaced by its reference, the delta (placeholders expanded: its ids hold
        the image tokens) and the new images' inputs, which the caller appends to the
        sample's (:meth:`MultiModalInputs.plus`) once the tokens are kept.

    Raises:
        ImageError: an image that cannot be used, or images for a pipeline without a
            processor (``BuildPrompt(processor=...)``).
    """
    if not has_images(new_messages):
        return None
    state = artifacts.get(MULTI_MODAL)
    if not isinstance(state, SampleImages) or state.processor is None:
        raise ImageError("a turn returned an image, but the pipeline has no vision processor "
                         "(BuildPrompt(processor=...))", field="tool")
    return await state.processor.submit(_expand, state.processor, list(history),
                                        list(new_messages), tools, last_token, options)


def _expand(processor: VisionProcessor, history: list[AgentMessage], new: list[AgentMessage],
            tools: Sequence[dict[str, Any]] | None, last_token: int,
            options: Mapping[str, Any] | None
            ) -> tuple[list[AgentMessage], TurnDelta, MultiModalInputs]:
    dumped = [m.model_dump(exclude_none=True) for m in new]
    kept_dicts, images = processor.load_messages(dumped, where="tool")
    kept = [AgentMessage.model_validate(m) for m in kept_dicts]
    delta = render_turn_delta(processor.tokenizer, history, kept, tools, last_token, options)
    expanded = processor.expand(delta.text, images)
    return kept, TurnDelta(delta.text, expanded.ids, delta.drift), expanded.inputs


def add_images(artifacts: Mapping[str, Any], inputs: MultiModalInputs) -> None:
    """Append a turn's image inputs to the sample's (after its tokens were kept)."""
    state = artifacts.get(MULTI_MODAL)
    if isinstance(state, SampleImages):
        state.inputs = state.inputs.plus(inputs)


def is_image_result(result: Any) -> bool:
    """Whether a tool's result holds an image: a PIL image, an image part, or a list of
    content parts with one."""
    from pipeline.multimodal._images import is_image_part

    if _is_pil(result) or (isinstance(result, Mapping) and is_image_part(result)):
        return True
    return isinstance(result, list) and any(_is_pil(p) or is_image_part(p) for p in result)


def image_result_parts(result: Any, max_chars: int) -> list[dict[str, Any]]:
    """A tool's image result as message content parts (text parts cut at ``max_chars``)."""
    items = result if isinstance(result, list) else [result]
    parts: list[dict[str, Any]] = []
    for item in items:
        if _is_pil(item):
            parts.append({"type": "image", "image": item})
        elif isinstance(item, Mapping):
            part = dict(item)
            if isinstance(part.get("text"), str):
                part["text"] = part["text"][:max_chars]
            parts.append(part)
        else:
            parts.append({"type": "text", "text": str(item)[:max_chars]})
    return parts


def _is_pil(value: Any) -> bool:
    image = sys.modules.get("PIL.Image")  # no PIL loaded: no PIL image can exist
    return image is not None and isinstance(value, image.Image)
