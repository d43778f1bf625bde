"""``BuildPrompt``: the row's messages rendered with the chat template and tokenized once
(rendering itself lives in :mod:`pipeline._render`)."""

from __future__ import annotations

import asyncio

from pipeline import artifacts as A
from pipeline._context import Context
from pipeline._models import AgentMessage, AgentRolloutItem
from pipeline._render import render_prompt


class BuildPrompt:
    """Writes ``raw_prompt``, ``prompt_ids`` and the prompt ``messages``.

    The row's ``tools`` (OpenAI schemas) are rendered into the prompt by the chat template.
    Rendering and tokenization run in a worker thread (``offload=True``) so a long prompt
    never stalls the event loop that serves every other sample.
    """

    name = "build_prompt"

    def __init__(self, *, offload: bool = True) -> None:
        self.offload = offload

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        row = item.data
        if self.offload:
            text, ids = await asyncio.to_thread(render_prompt, ctx.tokenizer, row.messages,
                                                row.tools)
        else:
            text, ids = render_prompt(ctx.tokenizer, row.messages, row.tools)
        item.artifacts[A.RAW_PROMPT] = text
        item.artifacts[A.PROMPT_IDS] = ids
        item.artifacts[A.MESSAGES] = [AgentMessage.model_validate(m) for m in row.messages]
