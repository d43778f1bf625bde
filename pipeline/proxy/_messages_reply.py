"""Anthropic's Messages API (``POST .../v1/messages``): the proxy's answer, its streaming events
and its error shape (the request side: :mod:`pipeline.proxy._messages`).

The answer is a ``message`` whose ``content`` holds a ``thinking`` block (reasoning a family's
parser split off), a ``text`` block (when the reply has text, or no call) and one ``tool_use``
block per call; ``stop_reason`` is ``end_turn``, ``max_tokens``, ``stop_sequence`` or
``tool_use``. Streamed, it is the event sequence the SDK's accumulator expects
(``message_start``, ``content_block_start``/``_delta``/``_stop`` per block, ``message_delta``,
``message_stop``). Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``,
with the same statuses (final ones: 404 with ``x-should-retry: false``, which the ``anthropic``
SDK honours as the ``openai`` one does; a refused field or image keeps the type
``invalid_request_error``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pipeline._data.models import AgentMessage
from pipeline.proxy._errors import ProxyError

_JSON = json.JSONEncoder(ensure_ascii=False)  # json.dumps with options builds one per call


def new_message_id() -> str:
    """A fresh message id."""
    return "msg_" + uuid.uuid4().hex


def content_blocks(reply: AgentMessage) -> list[dict[str, Any]]:
    """The reply's ``content``: thinking, text (when there is text, or no call), tool uses.

    A call's ``input`` is its arguments parsed (the tool parser accepted them as JSON; a
    value that is not an object is wrapped as ``{"value": ...}``, Anthropic's input being
    an object).
    """
    blocks: list[dict[str, Any]] = []
    reasoning = (reply.model_extra or {}).get("reasoning_content")
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = reply.content if isinstance(reply.content, str) else ""
    if text or not reply.tool_calls:
        blocks.append({"type": "text", "text": text})
    for call in reply.tool_calls or ():
        try:
            value = json.loads(call.function.arguments or "{}")
        except ValueError:
            value = call.function.arguments
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                       "input": value if isinstance(value, dict) else {"value": value}})
    return blocks


def stop_reason(finish_reason: str, stop_string: str | None) -> str:
    """Anthropic's ``stop_reason`` for the turn's finish reason (and its stop string)."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """``usage``: prompt tokens reused from the session's record count as cache reads (what
    Anthropic's ``input_tokens`` leaves out)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def message_body(*, message_id: str, model: str, reply: AgentMessage, finish_reason: str,
                 stop_string: str | None, usage: dict[str, Any]) -> dict[str, Any]:
    """A whole ``message`` object."""
    reason = stop_reason(finish_reason, stop_string)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(reply), "stop_reason": reason,
            "stop_sequence": stop_string if reason == "stop_sequence" else None,
            "usage": usage}


def stream_events(final: dict[str, Any]) -> list[dict[str, Any]]:
    """The streaming events of a finished message, in order (each has its ``type``, which is
    also the SSE event name).

    The engine returns a turn whole, so each block is started, sent as one delta and stopped.
    """
    usage = final["usage"]
    start = {**final, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**usage, "output_tokens": 0}}
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(final["content"]):
        kind = block["type"]
        if kind == "text":
            first: dict[str, Any] = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        elif kind == "thinking":
            first = {"type": "thinking", "thinking": "", "signature": ""}
            delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        else:
            first = {**block, "input": {}}
            delta = {"type": "input_json_delta",
                     "partial_json": _JSON.encode(block["input"])}
        events += [{"type": "content_block_start", "index": index, "content_block": first},
                   {"type": "content_block_delta", "index": index, "delta": delta}]
        if kind == "thinking":
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": ""}})
        events.append({"type": "content_block_stop", "index": index})
    events += [{"type": "message_delta",
                "delta": {"stop_reason": final["stop_reason"],
                          "stop_sequence": final["stop_sequence"]},
                "usage": usage},
               {"type": "message_stop"}]
    return events


# ----- errors --------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: ProxyError) -> dict[str, Any]:
    """``exc`` in Anthropic's error shape. The type follows the status as Anthropic's does
    (the SDK picks its exception class by status); a refused field or image (404, final)
    keeps ``invalid_request_error``, which is what it is."""
    kind = _ERROR_TYPES.get(exc.status, "api_error")
    if exc.status == 404 and exc.code in ("unsupported_parameter", "invalid_image"):
        kind = "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": exc.message}}
