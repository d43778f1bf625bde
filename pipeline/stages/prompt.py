"""``BuildPrompt``: render the row's messages with the chat template and tokenize them."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline import artifacts as A
from pipeline._context import Context
from pipeline._models import AgentMessage, AgentRolloutItem
from pipeline._tokenizer import Tokenizer


def render_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
    """Render ``messages`` (with tool schemas) for generation and tokenize the text.

    Returns:
        ``(raw_prompt, prompt_ids)``.
    """
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(messages, **kwargs)
    return text, tokenizer.encode(text, add_special_tokens=False)


class BuildPrompt:
    """Writes ``raw_prompt``, ``prompt_ids`` and the prompt ``messages``.

    Rendering and tokenization run in a worker thread (``offload=True``) so a long prompt
    never stalls the event loop that serves every other sample.
    """

    name = "build_prompt"

    def __init__(self, *, offload: bool = True) -> None:
        self.offload = offload

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        row = item.data
        if self.offload:
            text, ids = await asyncio.to_thread(render_prompt, ctx.tokenizer, row.messages, row.tools)
        else:
            text, ids = render_prompt(ctx.tokenizer, row.messages, row.tools)
        item.artifacts[A.RAW_PROMPT] = text
        item.artifacts[A.PROMPT_IDS] = ids
        item.artifacts[A.MESSAGES] = [AgentMessage.model_validate(m) for m in row.messages]
