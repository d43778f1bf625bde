"""OpenAI chat-completions wire formats: the request we accept and the bodies we send.

Requests are validated with pydantic; ``null`` is accepted wherever OpenAI's spec allows it (the
official SDK sends it for options agent code forwards unset). What the proxy does with each
field — serve it, have the engine enforce it, or refuse it — is ``_policy``'s table; the model
here types the fields the proxy uses.

Messages are kept as plain dicts at first: the proxy
compares most of them with what it recorded before and validates (:class:`WireMessage`) only
the ones it has to render. Response bodies are plain dicts in OpenAI's shapes, serialised with
``pydantic_core.to_json``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline._data.config import check_template_kwargs, describe_validation_error
from pipeline._data.models import AgentMessage, ToolCall, ToolFunction
from pipeline.proxy._errors import ProxyRequestError


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    """A text part of a list-of-parts content."""

    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    """``image_url`` of an image part (``detail`` is accepted; the processor decides the
    resolution)."""

    url: str
    detail: str | None = None


class ImagePart(_Lenient):
    """An image part (``{"type": "image_url", "image_url": {"url": ...}}``): served by a proxy
    with a vision processor, for data URLs only (``_history``); refused otherwise."""

    type: Literal["image_url"]
    image_url: ImageURL | str

    @property
    def url(self) -> str:
        """The image's URL as sent."""
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class WireFunction(_Lenient):
    """A tool call's function as an agent sends it back (arguments as JSON text or object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class WireToolCall(_Lenient):
    """A tool call of an assistant message in a request."""

    id: str = ""
    type: Literal["function"] = "function"
    function: WireFunction


class WireMessage(_Lenient):
    """A request message, validated before it is rendered by the chat template."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[WireToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def image_parts(self) -> list[tuple[int, ImagePart]]:
        """``(index, part)`` of each image part of the content."""
        if not isinstance(self.content, list):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]

    def to_agent_message(self) -> AgentMessage:
        """The message in the pipeline's own model (``developer`` becomes ``system``)."""
        content: str | list[dict[str, Any]] | None = (
            self.content if not isinstance(self.content, list)
            else [part.model_dump(exclude_none=True) for part in self.content])
        calls = None
        if self.tool_calls:
            calls = [ToolCall(id=c.id, function=ToolFunction(
                name=c.function.name, arguments=_arguments_text(c.function.arguments)))
                     for c in self.tool_calls]
        role = "system" if self.role == "developer" else self.role
        return AgentMessage(role=role, content=content, tool_calls=calls,
                            tool_call_id=self.tool_call_id, name=self.name)


class WireFunctionSchema(_Lenient):
    """The ``function`` part of a tool schema; kept whole for the chat template."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)


class WireTool(_Lenient):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: WireFunctionSchema


class NamedToolChoice(_Lenient):
    """``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: dict[str, Any]


class StreamOptions(_Lenient):
    """``stream_options``; only ``include_usage`` has an effect."""

    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    """The body of ``POST .../v1/chat/completions`` (see the module doc).

    ``tool_choice`` ``required`` or a named function and ``parallel_tool_calls: false`` reach
    here only when the engine enforces them (``_policy``).
    """

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    """The agent's own dicts, not validated here: each one is either equal to a recorded
    message that was validated when first seen, or validated before it is compared or
    rendered (:func:`parse_message`)."""
    tools: list[WireTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """The chat template's own options (vLLM's extension: ``enable_thinking``, ...)."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_template_kwargs(value)

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stop

    @property
    def stops(self) -> list[str]:
        """``stop`` as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """``tools`` as plain dicts, the way the chat template takes them."""
        return None if not self.tools else [t.model_dump() for t in self.tools]

    @property
    def choice(self) -> str:
        """``tool_choice`` as a word: ``none``, ``auto``, ``required`` or ``function``."""
        if self.tool_choice is None:
            return "auto"
        return self.tool_choice if isinstance(self.tool_choice, str) else "function"


def parse_request(data: Any) -> ChatCompletionRequest:
    """Validate a decoded JSON body.

    Raises:
        ProxyRequestError: naming the invalid field's path (:func:`invalid`).
    """
    if not isinstance(data, dict):
        raise ProxyRequestError("the request body must be a JSON object", code="invalid_value")
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc, data) from None


def parse_message(raw: Any, index: int) -> WireMessage:
    """Validate one request message.

    Raises:
        ProxyRequestError: naming the field's path (``messages.<index>.content.0.text``).
    """
    try:
        return WireMessage.model_validate(raw)
    except ValidationError as exc:
        raise invalid(exc, raw, f"messages.{index}") from None


def invalid(exc: ValidationError, raw: Any, prefix: str = "") -> ProxyRequestError:
    """The 400 for a request value that failed validation: its ``param`` and message name the
    most specific field's path in the request as sent (``input.0.content.1.text``: pydantic's
    union labels such as ``list[TextPart]`` dropped), and what was wrong with it."""
    best: tuple[int, str, dict[str, Any]] | None = None
    for err in exc.errors(include_url=False):
        depth, path = field_path(raw, err["loc"], missing=err["type"] == "missing")
        if best is None or depth > best[0]:
            best = (depth, path, dict(err))
    if best is None:  # pragma: no cover - a ValidationError has at least one error
        return ProxyRequestError(describe_validation_error(exc, prefix), param=prefix or None,
                                 code="invalid_value")
    _, path, chosen = best
    where = ".".join(p for p in (prefix, path) if p)
    got = "" if chosen["type"] == "missing" else f" (got {value_repr(chosen.get('input'))})"
    return ProxyRequestError(f"{where or 'the body'}: {chosen['msg']}{got}",
                             param=where or None, code="invalid_value")


def field_path(raw: Any, loc: Sequence[int | str], *, missing: bool = False) -> tuple[int, str]:
    """How deep ``loc`` (a pydantic error location) goes into ``raw``, and its path there.

    Steps that are no key or index of the value at that point are pydantic's union labels
    and are dropped, except the last step of a ``missing`` error (the absent field).
    """
    parts: list[str] = []
    value = raw
    for i, step in enumerate(loc):
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and isinstance(step, int) and 0 <= step < len(value):
            value = value[step]
        elif not (missing and i == len(loc) - 1 and isinstance(value, dict)):
            continue
        parts.append(str(step))
    return len(parts), ".".join(parts)


def value_repr(value: Any) -> str:
    """A request value as an error message shows it: its JSON type and a short repr."""
    kind = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string",
            list: "array", dict: "object"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r:.60}" if value is not None else "null"


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


# ----- response bodies ---------------------------------------------------------------------


def message_body(message: AgentMessage) -> dict[str, Any]:
    """An assistant reply in OpenAI's ``message`` shape; reasoning a family's parser split
    off as ``reasoning_content`` (vLLM's server's field)."""
    body: dict[str, Any] = {"role": "assistant", "content": message.content}
    reasoning = (message.model_extra or {}).get("reasoning_content")
    if reasoning is not None:
        body["reasoning_content"] = reasoning
    if message.tool_calls:
        body["tool_calls"] = [call.model_dump(mode="json") for call in message.tool_calls]
    return body


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """``usage``; ``cached_tokens`` counts prompt tokens reused from the session's record."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(*, completion_id: str, model: str, message: AgentMessage,
                    finish_reason: str, usage: dict[str, Any],
                    logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    return {
        "id": completion_id, "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message_body(message),
                     "logprobs": None if logprobs is None else {"content": logprobs},
                     "finish_reason": finish_reason}],
        "usage": usage,
    }


def stream_chunks(*, completion_id: str, model: str, message: AgentMessage,
                  finish_reason: str, usage: dict[str, Any] | None,
                  logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed reply, in order.

    The engine returns a turn whole, so the stream is: the role, the content, one chunk per
    tool call (id, name and all arguments), the finish reason, and the usage chunk (empty
    ``choices``) when ``stream_options.include_usage`` asked for it.
    """
    created = int(time.time())
    with_usage = usage is not None

    def chunk(delta: dict[str, Any], finish: str | None = None,
              chunk_logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": completion_id, "object": "chat.completion.chunk", "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta,
                         "logprobs": None if chunk_logprobs is None
                         else {"content": chunk_logprobs},
                         "finish_reason": finish}]}
        if with_usage:
            body["usage"] = None
        return body

    chunks = [chunk({"role": "assistant", "content": ""})]
    reasoning = (message.model_extra or {}).get("reasoning_content")
    if reasoning:
        chunks.append(chunk({"reasoning_content": reasoning}))
    if message.content:
        chunks.append(chunk({"content": message.content}, chunk_logprobs=logprobs))
    elif logprobs:
        chunks.append(chunk({"content": ""}, chunk_logprobs=logprobs))
    for i, call in enumerate(message.tool_calls or ()):
        chunks.append(chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                             "function": {"name": call.function.name,
                                                          "arguments": call.function.arguments}}]}))
    chunks.append(chunk({}, finish_reason))
    if usage is not None:
        chunks.append({"id": completion_id, "object": "chat.completion.chunk",
                       "created": created, "model": model, "choices": [], "usage": usage})
    return chunks


def models_body(model: str) -> dict[str, Any]:
    """``GET /v1/models``: the one model the proxy serves."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                        "owned_by": "pipeline"}]}
