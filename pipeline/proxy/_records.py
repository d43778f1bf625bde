"""What a session recorded, as the sessions API returns it (pydantic, JSON wire form).

:class:`SessionRecord` is the answer of ``GET /sessions/{sid}`` and ``POST .../complete`` and
what :class:`~pipeline.proxy.RemoteAgent` reads in-process. A session stores its turns
compactly (``_sessions.Turn``: a turn's prompt is a prefix of its segment's sequence); the full
per-turn views are built here, on request. Records read sessions, never the other way round.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from pipeline._data.models import AgentMessage, FinishReason

if TYPE_CHECKING:
    from pipeline.proxy._segments import Segment
    from pipeline.proxy._sessions import Session

_TOKEN_FIELDS = {"token_ids", "logprobs", "finish_reason"}


class TurnRecord(BaseModel):
    """One turn: the request, the exact engine prompt and reply, and timings.

    Attributes:
        request_id: the engine request id of the turn.
        merged: the turn extended its segment (False: it started one).
        split_reason: why its segment started, for the first turn of a segment.
        messages: the request's messages as the segment recorded them.
        prompt_len: the length of the engine prompt.
        prompt_ids: exactly what the engine was sent (None where the record was asked for
            without per-turn prompts: each one repeats the conversation so far).
        response_ids / logprobs: exactly what the engine returned (cut after a stop string).
        finish_reason: what the agent was told (``stop``, ``length``, ``tool_calls``).
        engine_finish_reason / raw_finish_reason: the engine's view.
        template_tokens: tokens the chat template added for this turn (mask 0).
        reused_tokens: prompt tokens taken from the record instead of rendering.
        timings: ``received_at`` (Unix time), ``queued_s`` (waiting for the session),
            ``render_s``, ``engine_s`` and ``total_s``.
        ignored_fields: the request's hints the proxy did not act on, by path
            (``metadata``, ``text.verbosity``, ...; see ``_policy.read_hints``).
        constraints: the decoding constraints the engine enforced on the reply
            (``json_schema``, ``tool_choice_required``, ...; ``pipeline.proxy.ENFORCEABLE``).
        images: the images of the turn's new messages, in order: ``sha256`` (of the encoded
            image), ``width``, ``height`` and ``tokens`` (its image tokens in the prompt);
            never the image itself (a vision processor's proxy, ``ProxyServer(processor=)``).
    """

    index: int
    request_id: str
    segment: int
    merged: bool
    split_reason: str | None
    messages: list[dict[str, Any]]
    prompt_len: int
    prompt_ids: list[int] | None
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    engine_finish_reason: FinishReason | None
    raw_finish_reason: str | None
    template_tokens: int
    reused_tokens: int
    drift: list[str]
    stop_string: str | None
    request: dict[str, Any]
    sampling: dict[str, Any]
    policy_version: int | None
    reply: dict[str, Any]
    timings: dict[str, float]
    ignored_fields: list[str] = Field(default_factory=list)
    constraints: list[str] = Field(default_factory=list)
    images: list[dict[str, Any]] = Field(default_factory=list)


class SegmentRecord(BaseModel):
    """One token sequence of a session: what a trainer sample is built from.

    ``response_mask`` is 1 on model tokens and 0 on template/tool tokens; ``logprobs`` is
    aligned with ``response_ids`` (0.0 where the mask is 0). ``conversation`` tells apart the
    conversations of one session (0: the first; see ``_history``). ``images``: every image
    whose tokens are in the sequence, in order (``sha256``, ``width``, ``height``,
    ``tokens``); the pixel inputs stay on the session (``Segment.images``), the sample
    :class:`~pipeline.proxy.RemoteAgent` builds carries them.
    """

    index: int
    reason: str
    at_message: int | None
    turns: list[int]
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_turns: int
    drift: int
    reused_tokens: int
    raw_prompt: str | None
    finish_reason: FinishReason | None
    policy_version: int | None
    conversation: int = 0
    raw_finish_reason: str | None = None
    images: list[dict[str, Any]] = Field(default_factory=list)

    def agent_messages(self) -> list[AgentMessage]:
        """The conversation as :class:`AgentMessage` objects (model turns carry token ids)."""
        return [AgentMessage.model_validate(m) for m in self.messages]

    def trainer_fields(self) -> dict[str, Any]:
        """The token fields a trainer sample needs (``extra_fields["proxy_segments"]``)."""
        return {"index": self.index, "reason": self.reason, "conversation": self.conversation,
                "prompt_ids": self.prompt_ids,
                "response_ids": self.response_ids, "response_mask": self.response_mask,
                "logprobs": self.logprobs, "tool_turns": self.tool_turns,
                "turns": len(self.turns),
                "finish_reason": None if self.finish_reason is None
                else self.finish_reason.value}


class SessionRecord(BaseModel):
    """Everything a session recorded.

    Attributes:
        state: ``active`` or ``completed``.
        ended: the limit that ended the session (``response_budget``, ``max_turns``), if one
            did.
        splits: split count by reason (see :data:`pipeline.proxy.SPLIT_REASONS`).
        requests: chat completions served, including ones that recorded no turn (a spent
            response budget).
        token_integrity: the live token-integrity checks that failed in this session,
            ``{"reason", "turn", "detail"}`` each (see ``pipeline.TokenIntegrityError``);
            empty when every turn passed (or the checks are off).
        ignored_fields: the hints the proxy did not act on, by path, and how many turns
            sent each (see ``_policy.read_hints``).
        constraints: the decoding constraints enforced, and on how many turns each.
    """

    id: str
    state: Literal["active", "completed"]
    created_at: float
    metadata: dict[str, Any] = Field(default_factory=dict)
    turns: list[TurnRecord]
    segments: list[SegmentRecord]
    splits: dict[str, int]
    num_splits: int
    requests: int
    ended: str | None = None
    conversations: int = 1
    token_integrity: list[dict[str, Any]] = Field(default_factory=list)
    ignored_fields: dict[str, int] = Field(default_factory=dict)
    constraints: dict[str, int] = Field(default_factory=dict)


_MESSAGE_TOKENS = {"__all__": set(_TOKEN_FIELDS)}
AGENT_VIEW: dict[str, Any] = {
    "metadata": True,  # the trainer's (a ground truth, say): never the agent's to read
    "token_integrity": True,  # the trainer's verdict, with token ids in its details
    "segments": {"__all__": {"prompt_ids": True, "response_ids": True, "response_mask": True,
                             "logprobs": True, "raw_prompt": True,
                             "messages": _MESSAGE_TOKENS}},
    "turns": {"__all__": {"prompt_ids": True, "response_ids": True, "logprobs": True,
                          "messages": _MESSAGE_TOKENS, "reply": set(_TOKEN_FIELDS)}},
}
"""``model_dump(exclude=...)`` of a record without any token payload (what an agent's own
key reads, ``_access``): the segments' and turns' token lists, the rendered prompt, and the
token ids, logprobs and engine finish reason of every message in them; without the
session's ``metadata``, which the trainer set (it may carry the answer); and without the
failed token-integrity checks (their details name token ids)."""


def agent_view(record: SessionRecord) -> dict[str, Any]:
    """``record`` in its JSON form without token payloads (see :data:`AGENT_VIEW`)."""
    return record.model_dump(mode="json", exclude=AGENT_VIEW)


def session_record(session: Session, *, with_turns: bool = True,
                   turn_tokens: bool = True) -> SessionRecord:
    """Build the record of ``session``.

    Args:
        with_turns: include the per-turn views.
        turn_tokens: include each turn's prompt ids (its prompt is a prefix of its segment's
            sequence, so these repeat the conversation once per turn).
    """
    history = session.history
    segments = [segment_record(s) for s in history.segments]
    turns: list[TurnRecord] = []
    if with_turns:
        for turn in session.turns:
            seg = history.segments[turn.segment]
            sequence = seg.sequence()
            start = turn.prompt_len
            tokens = turn.reply.token_ids or []
            turns.append(TurnRecord(
                index=turn.index, request_id=turn.request_id, segment=turn.segment,
                merged=turn.merged,
                split_reason=turn.split_reason,
                messages=[_wire(e.message, tokens=False)
                          for e in seg.entries[:turn.message_count]],
                prompt_len=start, prompt_ids=sequence[:start] if turn_tokens else None,
                response_ids=list(tokens),
                logprobs=list(turn.reply.logprobs or []), finish_reason=turn.finish_reason,
                engine_finish_reason=turn.reply.finish_reason,
                raw_finish_reason=turn.raw_finish_reason,
                template_tokens=turn.template_tokens, reused_tokens=turn.reused_tokens,
                drift=list(turn.drift), stop_string=turn.stop_string, request=turn.request,
                sampling=turn.sampling, policy_version=turn.policy_version,
                reply=_wire(turn.reply, tokens=False), timings=dict(turn.timings),
                ignored_fields=list(turn.ignored_fields),
                constraints=list(turn.constraints), images=[dict(i) for i in turn.images]))
    return SessionRecord(
        id=session.id, state=session.state, created_at=session.created_at,
        metadata=dict(session.metadata), turns=turns, segments=segments,
        splits=dict(history.splits), num_splits=sum(history.splits.values()),
        requests=session.requests, ended=session.ended,
        conversations=1 + max((s.conversation for s in history.segments), default=0),
        token_integrity=[dict(f) for f in session.integrity],
        ignored_fields=dict(Counter(path for turn in session.turns
                                    for path in turn.ignored_fields)),
        constraints=dict(Counter(name for turn in session.turns for name in turn.constraints)))


def segment_record(seg: Segment) -> SegmentRecord:
    """The record of one segment."""
    return SegmentRecord(
        index=seg.index, reason=seg.reason, at_message=seg.at_message, turns=list(seg.turns),
        prompt_ids=list(seg.prompt_ids), response_ids=list(seg.response_ids),
        response_mask=list(seg.response_mask), logprobs=list(seg.logprobs),
        messages=[_wire(e.message, tokens=True) for e in seg.entries],
        tools=seg.tools, tool_turns=seg.tool_turns, drift=seg.drift,
        reused_tokens=seg.reused_tokens, raw_prompt=seg.raw_prompt,
        finish_reason=seg.finish_reason, policy_version=seg.policy_version,
        conversation=seg.conversation, raw_finish_reason=seg.raw_finish_reason,
        images=seg.images.summary() if seg.images else [])


def _wire(message: AgentMessage, *, tokens: bool) -> dict[str, Any]:
    return message.model_dump(mode="json", exclude_none=True,
                              exclude=None if tokens else _TOKEN_FIELDS)
