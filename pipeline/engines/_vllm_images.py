"""An image prompt as the engine input vLLM takes, rendered by vLLM's own renderer.

vLLM (0.24 and 0.32) takes a ``{"type": "token", ...}`` prompt as an input that is already
rendered: it passes it to the engine core as it is, and ignores any ``multi_modal_data`` in it.
An image prompt in that form ran as plain text, each image placeholder embedded as the
``<|image_pad|>`` token itself with text positions (seen on an H200 with Qwen2.5-VL: no image
feature reached the text model, and nothing failed). So an image prompt is handed over in
vLLM's raw ``TokensPrompt`` form and rendered by ``AsyncLLM.renderer.process_for_engine_async``
(vLLM's processor, run off the event loop in vLLM's pool; its cache keyed by the images'
sha256 given as ``multi_modal_uuids``, so the ``n`` samples of a group process an image once),
and the result is checked to carry every image before the request goes in.
"""

from __future__ import annotations

import time
from typing import Any

from pipeline._exceptions import EngineError


async def render_image_prompt(llm: Any, prompt: dict[str, Any], request_id: str) -> Any:
    """``prompt`` (a raw ``TokensPrompt`` with ``multi_modal_data``) as the multimodal engine
    input of ``llm``'s renderer; where the installed vLLM has no renderer, ``prompt`` itself
    (its input processor renders a raw prompt).

    Raises:
        EngineError: vLLM cannot take the images (a text-only model, placeholders that do not
            match the images), rendered the prompt without all of them, or changed its ids.
    """
    images = len(prompt["multi_modal_data"]["image"])
    render = getattr(getattr(llm, "renderer", None), "process_for_engine_async", None)
    if render is None:
        return prompt
    try:
        rendered = await render(prompt, time.time())
    except Exception as exc:  # vLLM's processor's own message says what does not fit
        raise EngineError(f"request {request_id}: vLLM cannot take the prompt's {images} "
                          f"image(s): {type(exc).__name__}: {exc}") from exc
    placed = len((rendered.get("mm_placeholders") or {}).get("image") or ())
    if rendered.get("type") != "multimodal" or placed != images:
        raise EngineError(f"request {request_id}: vLLM rendered the prompt with {placed} of its "
                          f"{images} image(s) (input type {rendered.get('type')!r}); refusing "
                          f"to generate without them")
    if rendered["prompt_token_ids"] != prompt["prompt_token_ids"]:  # the sample's own ids only
        raise EngineError(f"request {request_id}: vLLM's renderer changed the prompt's token ids "
                          f"({len(prompt['prompt_token_ids'])} -> "
                          f"{len(rendered['prompt_token_ids'])}): the image placeholders are "
                          f"not expanded as this model's processor expands them")
    return rendered
