"""What a proxy session's history is made of: segments (token sequences, one trainer sample
each) and the messages they stand for, the match of a request against them, the rendered turn
waiting for the engine, and the reasons a new segment starts. The logic that builds them is
:class:`~pipeline.proxy._history.History`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline._data.models import AgentMessage, FinishReason
from pipeline.multimodal import MultiModalInputs
from pipeline.proxy._wire import WireMessage

SPLIT_START = "start"
"""The first segment of a session (not counted as a split)."""
SPLIT_TOOLS = "tools_changed"
"""The request's tool schemas or chat-template options (``chat_template_kwargs``) differ from
the segment's (the rendered prompt changes)."""
SPLIT_RETRY = "retry"
"""The request repeats the previous request's messages (the last reply is abandoned)."""
SPLIT_TRUNCATED = "truncated"
"""The request is a shorter prefix of the recorded conversation (turns dropped at the end)."""
SPLIT_EDITED = "edited"
"""A recorded message was changed, dropped or replaced (e.g. a summary); ``at_message`` says
where the request first differs."""
SPLIT_REASONS = (SPLIT_TOOLS, SPLIT_RETRY, SPLIT_TRUNCATED, SPLIT_EDITED)
NEW_CONVERSATION = "conversation"
"""A segment that starts a second conversation in the session (not counted as a split)."""


@dataclass(slots=True)
class Entry:
    """One message of a segment's conversation.

    Attributes:
        message: the message as rendered (for model turns: the reply as sent, with token ids).
        key: the normalised comparison key.
        echo: the agent's own dict for this message, once seen (fast comparison).
        end: model turns only: the sequence offset just after the turn's last token.
        closed: model turns only: the turn ended on the template's end-of-turn token.
    """

    message: AgentMessage
    key: tuple[Any, ...]
    echo: dict[str, Any] | None = None
    end: int | None = None
    closed: bool = True


@dataclass(eq=False)
class Segment:
    """One token sequence of a session: a trainer sample.

    Attributes:
        index: position in the session's segments.
        reason: why it started: ``start`` or one of :data:`SPLIT_REASONS`.
        at_message: for ``edited``: the first request message that differed.
        tools: the tool schemas its prompt was rendered with.
        prompt_ids: the prompt (rendered, or partly reused from an earlier segment).
        reused_tokens: how many prompt tokens were taken from an earlier segment's record.
        raw_prompt: the rendered prompt text (None when part of the prompt was reused).
        response_ids / response_mask / logprobs: everything after the prompt, aligned.
        entries: the conversation the sequence stands for.
        turns: indices of the session turns that extended it.
        tool_turns: merges whose new messages held a tool result.
        drift: merges whose template delta drifted (see ``render_turn_delta``).
    """

    index: int
    reason: str
    at_message: int | None
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    reused_tokens: int = 0
    raw_prompt: str | None = None
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    tool_turns: int = 0
    drift: int = 0
    anchor: AgentMessage | None = None
    finish_reason: FinishReason | None = None
    raw_finish_reason: str | None = None
    policy_version: int | None = None
    routed_experts: Any = None
    conversation: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    """The chat-template options its prompt and deltas were rendered with."""
    images: MultiModalInputs | None = None
    """The pixel inputs of the images in its sequence, in order (a vision processor's)."""
    image_ends: tuple[int, ...] = ()
    """Where each image's tokens end in the sequence (a reused prefix keeps the images that
    end in it; counting image-token ids instead would be fooled by a sampled one)."""

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def sequence(self) -> list[int]:
        """Prompt and response ids as one list."""
        return self.prompt_ids + self.response_ids


@dataclass(slots=True)
class Match:
    """What a request's messages are to the recorded history (no rendering done yet).

    ``segment`` set: the request extends it. Otherwise a new segment starts, with ``reason``,
    reusing the first ``keep`` entries (and their tokens) of ``base``.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    segment: Segment | None
    reason: str | None = None
    at_message: int | None = None
    base: Segment | None = None
    keep: int = 0
    new: list[tuple[WireMessage, dict[str, Any]]] = field(default_factory=list)
    conversation: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    """The request's chat-template options (``chat_template_kwargs``)."""

    def render_chars(self) -> int:
        """Rough size of the text to render (to decide whether to render off the loop)."""
        total = 0
        for message, _ in self.new:
            content = message.content
            total += len(content) if isinstance(content, str) else sum(
                len(getattr(p, "text", "")) for p in content or ())
        return total


@dataclass(slots=True)
class TurnPlan:
    """A rendered turn, ready for the engine; committed only if generation succeeds.

    ``template_ids`` are the tokens the chat template produced for this turn (the delta of a
    merge, or the rendered part of a new segment's prompt); ``prompt_ids`` is the whole
    engine prompt, of which ``reused_tokens`` came from the record.
    """

    match: Match
    template_ids: list[int]
    prompt_ids: list[int]
    reused_tokens: int
    raw_prompt: str | None
    drift: tuple[str, ...]
    new_entries: list[Entry]
    inputs: MultiModalInputs | None = None
    """The images of the whole prompt, for the engine (None: no image)."""
    new_images: MultiModalInputs | None = None
    """This turn's own images (those its template tokens hold)."""
    image_ends: tuple[int, ...] = ()
    """Where each image of ``inputs`` ends in ``prompt_ids``."""


def new_images(match: Match) -> bool:
    """Whether ``match``'s new messages hold image parts (render them with the processor,
    off the event loop)."""
    return any(w.image_parts() for w, _ in match.new)
