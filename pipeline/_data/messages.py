"""Chat messages built on the hot path without pydantic's validation when their values are
already what it would produce.

Every sample gets its prompt messages (one per row message), one assistant message per
turn, and in a tool loop a tool call (with its function) and a tool message per call.
Validating builds a field set per message (an object the cyclic collector walks for as long
as the sample lives: in a 100,000-sample batch, every full collection walks them all) and
copies the turn's token ids and logprobs. Plain values (strings, lists of plain ints and
floats, our enums) are built as they are; anything else takes the validating path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline._data.construct import construct
from pipeline._data.models import AgentMessage, FinishReason, ToolCall, ToolFunction

_ROLES = frozenset({"system", "user", "assistant", "tool"})
_PLAIN_KEYS = frozenset({"role", "content", "name", "tool_call_id"})
_OPTIONAL_STR = (str, type(None))


def prompt_message(raw: Mapping[str, Any]) -> AgentMessage:
    """``AgentMessage.model_validate(raw)``, built directly for a plain text message (a dict
    of ``role``, string ``content``, ``name``, ``tool_call_id``)."""
    if (type(raw) is not dict or not raw.keys() <= _PLAIN_KEYS or raw.get("role") not in _ROLES
            or type(raw["role"]) is not str
            or not all(type(v) in _OPTIONAL_STR for v in raw.values())):
        return AgentMessage.model_validate(raw)
    return construct(AgentMessage, {
        "role": raw["role"], "content": raw.get("content"), "tool_calls": None,
        "tool_call_id": raw.get("tool_call_id"), "name": raw.get("name"), "token_ids": None,
        "logprobs": None, "finish_reason": None}, {})


def tool_message(content: Any, tool_call_id: str, name: str,
                 error: str | None = None) -> AgentMessage:
    """A tool's reply to one call; ``error``: the kind of failure (an extra field, only on
    failed calls). A plain string reply without an error is built without validation."""
    if error is None and type(content) is str:
        return prompt_message({"role": "tool", "tool_call_id": tool_call_id, "name": name,
                               "content": content})
    return AgentMessage(role="tool", tool_call_id=tool_call_id, name=name, content=content,
                        **({} if error is None else {"error": error}))


def tool_call(call_id: str, name: str, arguments: str) -> ToolCall:
    """``ToolCall(id=call_id, function=ToolFunction(name=name, arguments=arguments))``, built
    without validation (no field set of their own: six objects less per 3-call sample)."""
    if type(call_id) is not str or type(name) is not str or type(arguments) is not str:
        return ToolCall(id=call_id, function=ToolFunction(name=name, arguments=arguments))
    return construct(ToolCall, {"id": call_id, "type": "function", "function": construct(
        ToolFunction, {"name": name, "arguments": arguments})})


def assistant_message(content: str | None, token_ids: list[int], logprobs: list[float],
                      finish_reason: FinishReason, *, tool_calls: list[ToolCall] | None = None,
                      extra: dict[str, Any] | None = None) -> AgentMessage:
    """An assistant turn as the engine sampled it; ``extra``: its extra fields
    (``reasoning_content``, ...). With plain values (a list of ints, a list of floats) the
    message keeps those lists themselves: do not change them afterwards."""
    extra = {} if extra is None else extra
    if (type(content) in _OPTIONAL_STR and _only(token_ids, int) and _only(logprobs, float)
            and type(finish_reason) is FinishReason
            and (tool_calls is None or (type(tool_calls) is list
                                        and all(type(c) is ToolCall for c in tool_calls)))):
        return construct(AgentMessage, {
            "role": "assistant", "content": content, "tool_calls": tool_calls,
            "tool_call_id": None, "name": None, "token_ids": token_ids, "logprobs": logprobs,
            "finish_reason": finish_reason}, dict(extra))
    return AgentMessage(role="assistant", content=content, tool_calls=tool_calls,
                        token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason,
                        **extra)


def _only(values: Any, kind: type) -> bool:
    # The element types collected in C: about what validating the list costs, without its copy.
    return type(values) is list and set(map(type, values)) <= {kind}
