"""``BuildPrompt``: the row's messages rendered with the chat template and tokenized once
(rendering itself lives in :mod:`pipeline._text.render`)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline import artifacts as A
from pipeline._data.messages import prompt_message
from pipeline._data.models import AgentMessage, AgentRolloutItem
from pipeline._exceptions import ConfigError
from pipeline._runner.context import Context
from pipeline._text.encode import batch_encoder
from pipeline._text.render import encode_text, render, render_prompt
from pipeline.multimodal import (
    MULTI_MODAL,
    Rendered,
    SampleImages,
    VisionProcessor,
    has_images,
)
from pipeline.tools import tool_schema


class BuildPrompt:
    """Writes ``raw_prompt``, ``prompt_ids`` and the prompt ``messages``.

    The row's ``tools`` (OpenAI schemas) are rendered into the prompt by the chat template;
    a row without a ``tools`` key gets the schemas of the pipeline's tool registry
    (``Pipeline(tools=...)``), as verl's tool agent loop gives every prompt its configured
    tools (``tools: []`` renders none). With the template options of
    :func:`template_options` (``chat_template_kwargs`` of the pipeline and the row, e.g.
    ``enable_thinking``).
    The ``n`` samples of a prompt (one group) share one rendering. A prompt
    of more than ``offload_chars`` characters is rendered and tokenized in a worker thread,
    so a long prompt never stalls the event loop that serves every other sample. A short one
    is rendered inline (a thread hop per prompt would cost more than the rendering); its
    tokenizing, the larger part, goes to a worker thread in batches with a Hugging Face fast
    tokenizer (:mod:`pipeline._text.encode`: the prompts asked for in one loop iteration are
    encoded together, off the loop and over the machine's cores). The tokenizer is then used
    from that thread: do not change its padding or truncation settings while a batch runs.
    The ``n`` samples of a prompt share one ``prompt_ids`` list (and their trainer views with
    it) and their prompt messages (each sample has a ``messages`` list of its own): copy them
    before changing them in place.

    With a ``processor`` (a vision-language model's), image parts of the messages (see
    :mod:`pipeline.multimodal`) are loaded, checked and rendered by it: the template's image
    placeholders expanded to the model's image tokens (they count toward the prompt and
    context limits like any token), the pixel inputs kept in the ``multi_modal`` artifact for
    the engine, each image replaced in ``messages`` by its hash and size. That work runs in a
    worker thread, once per group: the ``n`` samples of a prompt share one processing.

    Args:
        offload: False renders and tokenizes every prompt inline (images still go to a
            worker thread).
        offload_chars: the size (message text plus tool schemas) above which a prompt goes
            to a worker thread; 0 sends every prompt there.
        processor: a Hugging Face processor or a :class:`~pipeline.multimodal.VisionProcessor`;
            the pipeline's tokenizer must be its tokenizer.
    """

    name = "build_prompt"
    requires: frozenset[str] = frozenset()
    provides = frozenset({A.RAW_PROMPT, A.PROMPT_IDS, A.MESSAGES})
    vision_groups = 64
    """How many groups' image renderings are kept (pixel inputs are large)."""

    def __init__(self, *, offload: bool = True, offload_chars: int = 32768,
                 processor: Any = None) -> None:
        self.offload = offload
        self.offload_chars = offload_chars
        self.processor = (processor if processor is None or isinstance(processor, VisionProcessor)
                          else VisionProcessor(processor))
        self._rendered = _RenderCache()
        self._registry: tuple[Mapping[str, Any], list[dict[str, Any]] | None] | None = None
        self._vision: OrderedDict[str, tuple[Any, asyncio.Future[_Vision]]] = OrderedDict()

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        row, tokenizer = item.data, ctx.tokenizer
        if self.processor is not None:
            if tokenizer is not self.processor.tokenizer:
                raise ConfigError("BuildPrompt(processor=...) needs the pipeline's tokenizer "
                                  "to be the processor's (Pipeline(tokenizer="
                                  "processor.tokenizer))", field="tokenizer")
            if has_images(row.messages):
                await self._run_vision(item, ctx)
                return
            item.artifacts[MULTI_MODAL] = SampleImages(self.processor)
        cached, ids = self._rendered.get(item.group_id, row, tokenizer)
        if cached is not None:
            text = cached
        else:
            options, tools = template_options(item, ctx), self._tools(row.tools, ctx)
            if self.offload and prompt_size(row.messages, tools) > self.offload_chars:
                text, ids = await asyncio.to_thread(render_prompt, tokenizer, row.messages,
                                                    tools, options)
            else:
                text = render(tokenizer, row.messages, tools, add_generation_prompt=True,
                              options=options)
            self._rendered.put(item.group_id, row, tokenizer, text, ids)
        if ids is None:
            ids = await self._encode(tokenizer, text)
            self._rendered.put(item.group_id, row, tokenizer, text, ids)
        item.artifacts[A.RAW_PROMPT] = text
        # The group's samples share one list (no stage changes prompt ids in place): a copy
        # per sample was a tenth of what a finished sample keeps, and one more list to walk.
        item.artifacts[A.PROMPT_IDS] = ids if type(ids) is list else list(ids)
        item.artifacts[A.MESSAGES] = self._rendered.messages(item.group_id, row)

    async def _run_vision(self, item: AgentRolloutItem, ctx: Context) -> None:
        """Render a prompt with images: once per group, in a worker thread; the group's
        other samples await the same result (a cancelled sample does not cancel it)."""
        assert self.processor is not None
        entry = self._vision.get(item.group_id)
        if entry is None or entry[0] is not item.data:
            processor, row, options = self.processor, item.data, template_options(item, ctx)
            future = processor.submit(_render_vision, processor, row.messages,
                                      self._tools(row.tools, ctx), options)
            entry = self._vision[item.group_id] = (item.data, future)
            while len(self._vision) > self.vision_groups:
                self._vision.popitem(last=False)
        rendered, messages = await asyncio.shield(entry[1])
        item.artifacts[A.RAW_PROMPT] = rendered.text
        # As for text prompts: the group's samples share one ids list and one set of message
        # objects (each sample a list of its own), built once in the worker thread
        item.artifacts[A.PROMPT_IDS] = rendered.ids
        item.artifacts[A.MESSAGES] = list(messages)
        item.artifacts[MULTI_MODAL] = SampleImages(self.processor, rendered.inputs)

    def _tools(self, row_tools: list[dict[str, Any]] | None, ctx: Context
               ) -> list[dict[str, Any]] | None:
        """The row's tool schemas, else the registry's (built once per registry)."""
        if row_tools is not None:
            return row_tools
        registry = ctx.resources.tools
        if self._registry is None or self._registry[0] is not registry:
            schemas = [tool_schema(tool) for tool in registry.values()] or None
            self._registry = (registry, schemas)
        return self._registry[1]

    async def _encode(self, tokenizer: Any, text: str) -> list[int]:
        encoder = batch_encoder(tokenizer) if self.offload else None
        if encoder is not None:
            try:
                return await encoder.encode(text)
            except Exception:  # the same ids inline (e.g. another thread reconfigured it)
                pass
        return encode_text(tokenizer, text)


_Vision = tuple[Rendered, list[AgentMessage]]


def _render_vision(processor: VisionProcessor, messages: Sequence[Mapping[str, Any]],
                   tools: Sequence[dict[str, Any]] | None, options: Mapping[str, Any]
                   ) -> _Vision:
    """Load the images, render the template with placeholders, expand them, and build the
    prompt's message objects (worker thread)."""
    kept, images = processor.load_messages(messages)
    text = render(processor.tokenizer, kept, tools, add_generation_prompt=True, options=options)
    return processor.expand(text, images), [prompt_message(m) for m in kept]


def template_options(item: AgentRolloutItem, ctx: Context) -> Mapping[str, Any]:
    """The chat template's own variables for this sample: the pipeline's
    ``chat_template_kwargs``, overridden key by key by the row's."""
    defaults, own = ctx.config.chat_template_kwargs, item.data.chat_template_kwargs
    if not own:
        return defaults
    return {**defaults, **own} if defaults else own


def prompt_size(messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None) -> int:
    """Characters a rendering will read: message text plus tool schemas (roughly)."""
    size = sum(len(c) if isinstance(c := m.get("content"), str) else len(str(c))
               for m in messages)
    return size + (len(str(tools)) if tools else 0)


class _RenderCache:
    """The last renderings by group: a group's ``n`` items share one row object within one
    batch (group ids are fresh per batch, so a row reused later is rendered again). The text
    is kept as soon as it is rendered, so the group's other samples do not render it again
    while its ids are being tokenized. Bounded, oldest out."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._entries: OrderedDict[str, tuple[Any, Any, str, list[int] | None]] = OrderedDict()
        self._messages: OrderedDict[str, tuple[Any, list[AgentMessage]]] = OrderedDict()

    def get(self, group_id: str, row: Any, tokenizer: Any
            ) -> tuple[str, list[int] | None] | tuple[None, None]:
        entry = self._entries.get(group_id)
        if entry is None or entry[0] is not row or entry[1] is not tokenizer:
            return None, None
        return entry[2], entry[3]

    def put(self, group_id: str, row: Any, tokenizer: Any, text: str,
            ids: list[int] | None) -> None:
        self._entries[group_id] = (row, tokenizer, text, ids)
        if len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def messages(self, group_id: str, row: Any) -> list[AgentMessage]:
        """The row's messages as :class:`AgentMessage` objects, built once per group: its
        samples share them (two objects per message and sample less to keep and walk), each
        in a list of its own that its turns extend."""
        entry = self._messages.get(group_id)
        if entry is None or entry[0] is not row:
            entry = self._messages[group_id] = (row, [prompt_message(m) for m in row.messages])
            if len(self._messages) > self.size:
                self._messages.popitem(last=False)
        return list(entry[1])
