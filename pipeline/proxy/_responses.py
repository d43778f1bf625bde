"""The Responses API (``POST .../v1/responses``): its request as a chat turn, its answer and
its streaming events.

openai-agents' default model and newer coding agents speak only this API. The proxy serves the
subset agents use by translating each request into the chat request it stands for and running
it through the same :class:`~pipeline.proxy._turns.TurnRunner`, so both APIs record the same
segments, merge by the same rules and yield the same sample:

- ``instructions`` becomes the first (system) message;
- input items become chat messages: a ``message`` item (``input_text``/``output_text`` parts),
  an assistant ``message`` followed by ``function_call`` items becomes one assistant message
  with tool calls (consecutive calls: one message, as the model wrote them), a
  ``function_call_output`` becomes a tool message; a user message's ``input_image`` parts
  (``image_url`` a data URL) become chat's ``image_url`` parts, on a proxy with a vision
  processor (else, and for ``file_id`` or a web URL, a final error naming the part);
- ``previous_response_id`` (a response of the same session) prepends that response's
  conversation (its input and output, not its instructions, as OpenAI specifies);
- function ``tools`` become chat tool schemas.

The answer is a ``response`` object whose ``output`` holds a ``message`` item (when the reply
has text, or no call) and one ``function_call`` item per tool call; streamed, it is the event
sequence the SDK's accumulator expects (``response.created`` ... ``response.completed``, or
``response.incomplete`` when the reply hit its token limit).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline._data.config import describe_validation_error
from pipeline._data.models import AgentMessage
from pipeline.proxy._errors import FinalError, ProxyRequestError
from pipeline.proxy._wire import ChatCompletionRequest, invalid, message_body, value_repr

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class ResponsesRequest(BaseModel):
    """The body of ``POST .../v1/responses``, validated (field policy: ``_policy``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = False
    previous_response_id: str | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = None


@dataclass(slots=True)
class ResponseLink:
    """One answered response of a session: what ``previous_response_id`` refers to.

    ``messages`` are the chat messages the request added (without its instructions) and the
    reply; the whole conversation is found by following ``previous``.
    """

    previous: str | None
    messages: list[dict[str, Any]]


def parse_responses(data: Any) -> ResponsesRequest:
    """Validate a decoded body.

    Raises:
        ProxyRequestError: naming the first invalid field.
    """
    if not isinstance(data, dict):
        raise ProxyRequestError("the request body must be a JSON object", code="invalid_value")
    try:
        return ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc, data) from None


def conversation_of(links: dict[str, ResponseLink], response_id: str | None,
                    limit: int) -> list[dict[str, Any]]:
    """The chat messages of ``response_id``'s conversation, oldest first.

    Raises:
        FinalError: no response of this session has that id (404,
            ``previous_response_not_found``).
    """
    parts: list[list[dict[str, Any]]] = []
    current = response_id
    while current is not None and len(parts) <= limit:
        link = links.get(current)
        if link is None:
            raise FinalError(f"previous response {current!r} is not a response of this "
                             "session", param="previous_response_id",
                             code="previous_response_not_found")
        parts.append(link.messages)
        current = link.previous
    return [m for part in reversed(parts) for m in part]


def to_chat(request: ResponsesRequest, prior: list[dict[str, Any]], *, images: bool = False
            ) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat request ``request`` stands for, and the messages its own input added.
    ``images``: the proxy serves image parts (it has a vision processor).

    Raises:
        ProxyRequestError: an input item or tool the proxy cannot translate (``param`` names
            it).
        FinalError: an image part the proxy refuses (see :func:`input_messages`).
    """
    added = input_messages(request.input, images=images)
    messages = ([{"role": "system", "content": request.instructions}]
                if request.instructions is not None else [])
    messages += prior + added
    if not messages:
        raise ProxyRequestError("the request has no input", param="input", code="invalid_value")
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "temperature": request.temperature,
        "top_p": request.top_p, "max_tokens": request.max_output_tokens,
        "stream": bool(request.stream), "tools": chat_tools(request.tools),
        "tool_choice": chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "logprobs": "message.output_text.logprobs" in (request.include or ()),
        "top_logprobs": request.top_logprobs}
    try:
        return ChatCompletionRequest.model_validate(body), added
    except ValidationError as exc:
        raise ProxyRequestError(describe_validation_error(exc), code="invalid_value") from None


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in chat's shape (the same dict a chat client sends for them)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise FinalError(f"tools.{i}: only function tools are served (hosted tools such "
                             f"as {tool.get('type')!r} are not)", param=f"tools.{i}",
                             code="unsupported_parameter")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``tool_choice`` in chat's shape (``{"type": "function", "name"}`` gets nested)."""
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def input_messages(items: str | list[Any], *, images: bool = False) -> list[dict[str, Any]]:
    """Input items as chat messages (see the module doc). ``images``: a user message's
    ``input_image`` parts are served (as chat ``image_url`` parts).

    Raises:
        ProxyRequestError: an item of a kind the proxy does not serve (files, reasoning,
            item references, hosted tool calls), naming ``input.<i>``.
        FinalError: an ``input_image`` part without ``images``, or one that names no data
            URL (a ``file_id``, a web URL, a path), naming ``input.<i>.content.<j>``.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    calls_open = False  # the last message is an assistant turn that function_calls extend
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad_item(i, "an input item is an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad_item(i, f"role {role!r} is not one of {list(_ROLES)}")
            where = f"input.{i}.content"
            content = item.get("content")
            if role == "user" and isinstance(content, list) and _has_image(content):
                out.append({"role": role, "content": _with_images(content, where, images)})
            else:
                out.append({"role": role, "content": _text(content, where)})
            calls_open = role == "assistant"
        elif kind == "function_call":
            call = {"id": _call_id(item, i),
                    "type": "function",
                    "function": {"name": _string(item, "name", i),
                                 "arguments": _string(item, "arguments", i)}}
            if calls_open:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                calls_open = True
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                        "content": _text(item.get("output"), f"input.{i}.output")})
            calls_open = False
        else:
            raise _bad_item(i, f"items of type {kind!r} are not served (messages, "
                               "function_call and function_call_output are)")
    return out


def _text(content: Any, where: str) -> str:
    """The text of a content (a string or a list of text parts), every part's text checked:
    a null or non-string text is refused naming its path, never turned into "None"."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, f"must be a string or a list of text parts, got {value_repr(content)}")
    return "".join(_part_text(part, f"{where}.{j}") for j, part in enumerate(content))


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise _bad(where, f"content parts of type {kind!r} are not served (only text)")
    return _string(part, "refusal" if kind == "refusal" else "text", where)


def _has_image(content: list[Any]) -> bool:
    return any(isinstance(p, dict) and p.get("type") == "input_image" for p in content)


def _with_images(content: list[Any], where: str, images: bool) -> list[dict[str, Any]]:
    """A user message's parts with images, as chat parts (text and ``image_url``)."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "input_image"):
            out.append({"type": "text", "text": _part_text(part, f"{where}.{j}")})
            continue
        spot = f"{where}.{j}"
        if not images:
            raise FinalError(f"{spot}: image parts are not served: this proxy has no vision "
                             "processor (ProxyServer(processor=...))", param=f"{spot}.type",
                             code="unsupported_parameter")
        url = part.get("image_url")
        if not isinstance(url, str) or not url.startswith("data:"):
            raise FinalError(f"{spot}: only images sent as data URLs (image_url "
                             "'data:image/...;base64,...') are served; the proxy fetches no "
                             f"URL, reads no file and holds no file_id (got "
                             f"{value_repr(url if url is not None else part.get('file_id'))})",
                             param=f"{spot}.image_url", code="invalid_image")
        out.append({"type": "image_url", "image_url": {"url": url}})
    return out


def _call_id(item: dict[str, Any], index: int) -> str:
    """A ``function_call``'s id: ``call_id``, else ``id``, else one made up; a given one must
    be a string."""
    for name in ("call_id", "id"):
        if item.get(name) is not None:
            return _string(item, name, f"input.{index}")
    return f"call_{index}"


def _string(item: dict[str, Any], name: str, where: str | int) -> str:
    where = f"input.{where}" if isinstance(where, int) else where
    value = item.get(name)
    if not isinstance(value, str):
        raise _bad(f"{where}.{name}", f"must be a string, got {value_repr(value)}")
    return value


def _bad_item(index: int, why: str) -> ProxyRequestError:
    return _bad(f"input.{index}", why)


def _bad(where: str, why: str) -> ProxyRequestError:
    return ProxyRequestError(f"{where}: {why}", param=where, code="invalid_value")


# ----- the answer ----------------------------------------------------------------------------


def new_response_id() -> str:
    """A fresh response id."""
    return "resp_" + uuid.uuid4().hex


def reply_message(reply: AgentMessage) -> dict[str, Any]:
    """The reply as the chat message a later ``previous_response_id`` request continues."""
    return message_body(reply)


def output_items(reply: AgentMessage, logprobs: list[dict[str, Any]] | None,
                 incomplete: bool) -> list[dict[str, Any]]:
    """The ``output`` of a response: a message item (text, or no call) and one
    ``function_call`` item per tool call."""
    items: list[dict[str, Any]] = []
    text = reply.content if isinstance(reply.content, str) else ""
    if text or not reply.tool_calls:
        items.append({"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                      "status": "incomplete" if incomplete else "completed",
                      "content": [{"type": "output_text", "text": text, "annotations": [],
                                   "logprobs": logprobs or []}]})
    for call in reply.tool_calls or ():
        items.append({"id": "fc_" + uuid.uuid4().hex, "type": "function_call",
                      "call_id": call.id, "name": call.function.name,
                      "arguments": call.function.arguments, "status": "completed"})
    return items


def response_body(*, response_id: str, model: str, request: ResponsesRequest,
                  output: list[dict[str, Any]], finish_reason: str, prompt_tokens: int,
                  completion_tokens: int, cached_tokens: int,
                  status: Literal["completed", "in_progress"] = "completed") -> dict[str, Any]:
    """A whole ``response`` object (``status`` ``incomplete`` after a token limit)."""
    incomplete = finish_reason == "length"
    final = "incomplete" if incomplete and status == "completed" else status
    return {
        "id": response_id, "object": "response", "created_at": time.time(),
        "status": final, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if final == "incomplete" else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "model": model, "output": output if status == "completed" else [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": request.store is not False,
        "temperature": request.temperature, "top_p": request.top_p,
        "text": {"format": {"type": "text"}},
        "tool_choice": request.tool_choice or "auto", "tools": request.tools or [],
        "truncation": "disabled", "user": request.user, "metadata": request.metadata or {},
        "usage": None if status != "completed" else {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens},
    }


def stream_events(final: dict[str, Any]) -> list[dict[str, Any]]:
    """The streaming events of a finished response, in order, with ``sequence_number``.

    The engine returns a turn whole, so each item is announced, its text or arguments sent
    as one delta, and closed; the last event carries the whole response.
    """
    start = {**final, "status": "in_progress", "output": [], "usage": None,
             "incomplete_details": None}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": start},
                                    {"type": "response.in_progress", "response": start}]
    for index, item in enumerate(final["output"]):
        item_id = item["id"]
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", "item_id": item_id,
                 "output_index": index, "content_index": 0,
                 "part": {"type": "output_text", "text": "", "annotations": [],
                          "logprobs": []}},
                {"type": "response.output_text.delta", "item_id": item_id,
                 "output_index": index, "content_index": 0, "delta": part["text"],
                 "logprobs": part["logprobs"]},
                {"type": "response.output_text.done", "item_id": item_id,
                 "output_index": index, "content_index": 0, "text": part["text"],
                 "logprobs": part["logprobs"]},
                {"type": "response.content_part.done", "item_id": item_id,
                 "output_index": index, "content_index": 0, "part": part}]
        else:
            events += [
                {"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "arguments": "", "status": "in_progress"}},
                {"type": "response.function_call_arguments.delta", "item_id": item_id,
                 "output_index": index, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "item_id": item_id,
                 "output_index": index, "name": item["name"],
                 "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": item})
    events.append({"type": f"response.{final['status']}", "response": final})
    for number, event in enumerate(events):
        event["sequence_number"] = number
    return events
