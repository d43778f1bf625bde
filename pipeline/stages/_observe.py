"""Appending what the model did not write (tool results, an environment's observation, a
simulated user's reply) to a sample's token sequence, with ``response_mask = 0``.

One function for every stage that adds non-model turns, so each follows the same token rule
(the chat template's delta after the model's stop token, never a re-tokenized history) and
the same length rule (a turn that would leave no room for another model token ends the sample
with ``finish_reason=length``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from pipeline import artifacts as A
from pipeline._data.models import AgentMessage, AgentRolloutItem
from pipeline._runner.context import Context
from pipeline._text import integrity
from pipeline._text.render import render_turn_delta
from pipeline.multimodal import add_images, expand_observation
from pipeline.stages._generate import end_on_length, length_limits
from pipeline.stages._prompt import template_options


async def append_observation(item: AgentRolloutItem, ctx: Context,
                             new_messages: Sequence[AgentMessage], *,
                             max_model_len: int | None = None, offload: bool = True,
                             offload_chars: int = 32768) -> bool:
    """Add ``new_messages`` to the conversation and their template tokens to the response.

    The messages follow the last assistant turn (they answer it); their tokens are the chat
    template's delta after that turn's stop token, up to the next generation prompt,
    appended with ``response_mask = 0`` and logprob 0.0. ``template_drift`` counts turns
    whose delta had to be recovered.

    Args:
        item: the sample; its last message must be an assistant turn.
        ctx: the sample's context (tokenizer, template options, engine's ``max_model_len``).
        new_messages: tool results, observations, a user's reply.
        max_model_len: context limit; default: the engine's ``max_model_len`` if it has one.
        offload: render turns larger than ``offload_chars`` in a worker thread.
        offload_chars: the size above which a turn goes to a worker thread.

    Returns:
        False when the tokens would leave no room for another model token (the sample then
        ends with ``finish_reason=length``; the messages are kept, the tokens are not).
    """
    art = item.artifacts
    messages: list[AgentMessage] = art.setdefault(A.MESSAGES, [])
    history = list(messages)
    response: list[int] = art.setdefault(A.RESPONSE_IDS, [])
    last_token = response[-1] if response else (history[-1].token_ids or [-1])[-1]
    args = (ctx.tokenizer, history, list(new_messages), item.data.tools, last_token,
            template_options(item, ctx))
    # images (a tool's screenshot): placeholders expanded by the processor, in a thread
    vision = await expand_observation(art, *args[1:])
    if vision is not None:  # the messages keep each image's hash and size, not the image
        new_messages, delta, images = vision
    else:
        size = sum(len(str(m.content or "")) for m in (history[-1], *new_messages))
        delta = (await asyncio.to_thread(render_turn_delta, *args)
                 if offload and size > offload_chars else render_turn_delta(*args))
    messages.extend(new_messages)
    drift = 1 if delta.drift else 0
    art[A.TEMPLATE_DRIFT] = art.get(A.TEMPLATE_DRIFT, 0) + drift
    art.setdefault(A.EXTRA_FIELDS, {})[A.TEMPLATE_DRIFT] = art[A.TEMPLATE_DRIFT]
    if drift:
        ctx.log.warning("template_drift", kinds=list(delta.drift))
    max_model_len = max_model_len or getattr(ctx.resources.engine, "max_model_len", None)
    limits = length_limits(item, max_model_len)
    for limit in ("context", "response_budget"):
        if limit in limits and limits[limit] - len(delta.ids) <= 0:
            end_on_length(item, limit)
            return False
    if vision is not None:
        add_images(art, images)
    response.extend(delta.ids)
    art.setdefault(A.RESPONSE_MASK, []).extend([0] * len(delta.ids))
    art.setdefault(A.LOGPROBS, []).extend([0.0] * len(delta.ids))
    if ctx.config.token_integrity_checks and A.PROMPT_IDS in art:
        integrity.mark_turn(art, art[A.PROMPT_IDS], response)  # the delta's end
    return True
