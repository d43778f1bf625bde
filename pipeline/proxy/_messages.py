"""Anthropic's Messages API (``POST .../v1/messages``): its request as a chat turn.

Claude Code (and ``claude-agent-sdk`` over it) and every tool built on the ``anthropic`` SDK
speak only this API. As for the Responses API, the proxy translates each request into the chat
request it stands for and runs it through the same :class:`~pipeline.proxy._turns.TurnRunner`,
so all three APIs record the same segments, merge by the same rules and yield the same sample:

- ``system`` (a string or text blocks) becomes the first (system) message, a ``system`` message
  among the messages (Claude Code sends its environment notes so) a system message there; Claude
  Code's
  ``x-anthropic-billing-header`` block (a per-request hash: it would split the session at every
  turn) is dropped and listed in ``ignored_fields``;
- a user message's ``tool_result`` blocks become tool messages (in block order), its text
  blocks one user message after them (one block: a string; several: text parts);
- ``image`` blocks (in a user message, or in a ``tool_result``'s content) with a ``base64``
  source become chat's ``image_url`` parts holding the data URL
  (``data:<media_type>;base64,<data>``), in block order among the text parts, on a proxy with
  a vision processor: rendered, checked and recorded as the chat route does (``_history``).
  A ``url`` source (the proxy fetches nothing), a ``file`` source (it holds no files) and any
  image on a proxy without a processor are final errors naming the block; an image the
  processor refuses (not an image, truncated, over ``ImageLimits``) is too, its path the
  Anthropic request's (:func:`image_error`). An image's ``transformations`` is accepted with no
  effect and listed;
- an assistant message's text blocks become its content, its ``tool_use`` blocks its tool calls
  (``input`` kept as an object, compared with the recorded call as parsed JSON), its
  ``thinking`` blocks its ``reasoning_content`` (never compared: the recorded tokens stand for
  the reply); ``redacted_thinking`` is skipped;
- ``tools`` (client tools: ``name``, ``description``, ``input_schema``) become function tools;
  server tools (``web_search_...``, ``bash_...``) are refused;
- ``tool_choice`` ``auto``/``none`` are served, ``any`` and ``{"type": "tool", "name"}`` are
  ``required`` and a named function, ``disable_parallel_tool_use`` is
  ``parallel_tool_calls: false``: constraints the engine must enforce (``_policy``);
- ``stop_sequences`` are chat's ``stop``, ``max_tokens`` chat's ``max_tokens``;
- ``cache_control`` (on blocks or at the top) is accepted with no effect and listed, and so is
  a ``tool_result``'s ``is_error`` (chat's tool messages have no such flag).

The answer, its streaming events and its errors: :mod:`pipeline.proxy._messages_reply`.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, NoReturn

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline._data.config import describe_validation_error
from pipeline.proxy._errors import FinalError, ProxyError, ProxyRequestError
from pipeline.proxy._wire import ChatCompletionRequest, invalid, value_repr

BILLING_HEADER = "x-anthropic-billing-header"
"""The system block Claude Code prefixes with a per-request hash (dropped, listed)."""
_MAX_STOPS = 4  # chat's limit: each stop string is searched in every reply
_MEDIA_TYPE = re.compile(r"image/[A-Za-z0-9.+-]+")


class MessagesRequest(BaseModel):
    """The body of ``POST .../v1/messages``, validated (field policy: ``_policy``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None


def parse_messages(data: Any) -> MessagesRequest:
    """Validate a decoded body.

    Raises:
        ProxyRequestError: naming the first invalid field.
    """
    if not isinstance(data, dict):
        raise ProxyRequestError("the request body must be a JSON object", code="invalid_value")
    try:
        return MessagesRequest.model_validate(data)
    except ValidationError as exc:
        raise invalid(exc, data) from None


class Translated(NamedTuple):
    """One Messages API message and the chat messages it became (kept per session)."""

    raw: Any
    chat: list[dict[str, Any]]
    ignored: frozenset[str]
    images: tuple[tuple[int, int, str], ...] = ()
    """Per image part: its chat message (index in ``chat``), its part index there, and the
    path of the image block it came from (``messages.<i>.content.<j>``)."""


ImagePaths = dict[str, str]
"""Chat part path (``messages.<m>.content.<k>``) -> the image block's path in the Anthropic
request (what :func:`image_error` names instead)."""


def to_chat(request: MessagesRequest, memo: list[Translated] | None = None, *,
            images: bool = False) -> tuple[ChatCompletionRequest, tuple[str, ...], ImagePaths]:
    """The chat request ``request`` stands for, the paths of what it sent that has no
    effect (``cache_control``, ``tool_result.is_error``, Claude Code's billing header, an
    image's ``transformations``), and where each image part came from.

    ``memo``: the session's translations of its last request, reused for every message the
    agent sends again unchanged (one dict comparison instead of a translation each; an agent
    sends its whole history every turn), and updated with this request's. ``images``: image
    blocks are served (the proxy has a vision processor).

    Raises:
        ProxyRequestError: a block, tool or field the proxy cannot translate (``param``
            names its path).
        FinalError: a server tool (refused, ``unsupported_parameter``); an image block
            without ``images`` or with a source other than ``base64`` (naming the block).
    """
    ignored: set[str] = set()
    messages = _system(request.system, ignored)
    previous = list(memo or ())  # a copy: two requests of a session may run at once
    done: list[Translated] = []
    paths: ImagePaths = {}
    for i, message in enumerate(request.messages):
        if i < len(previous) and previous[i].raw == message:
            done.append(previous[i])
        else:
            done.append(_translated(message, f"messages.{i}", images))
            previous = []  # the rest is a new conversation's
        for m, k, path in done[-1].images:
            paths[f"messages.{len(messages) + m}.content.{k}"] = path
        messages += done[-1].chat
        ignored |= done[-1].ignored
    stops = request.stop_sequences or []
    if len(stops) > _MAX_STOPS or any(not s for s in stops):
        raise ProxyRequestError(f"stop_sequences: up to {_MAX_STOPS} non-empty strings are "
                                "served", param="stop_sequences", code="invalid_value")
    choice = request.tool_choice or {}
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "temperature": request.temperature,
        "top_p": request.top_p, "max_tokens": request.max_tokens, "stop": stops or None,
        "stream": bool(request.stream), "tools": _tools(request.tools, ignored),
        "tool_choice": chat_tool_choice(choice),
        "parallel_tool_calls": False if choice.get("disable_parallel_tool_use") else None}
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise ProxyRequestError(describe_validation_error(exc), code="invalid_value") from None
    if memo is not None:
        memo[:] = done
    return chat, tuple(sorted(ignored)), paths


def image_error(exc: ProxyError, paths: ImagePaths) -> ProxyError:
    """``exc`` naming the Anthropic request's image block where it names a chat image part
    (the processor refused an image: the chat route's path means nothing to this agent)."""
    path = paths.get(exc.param or "")
    if path is None or not isinstance(exc, FinalError):
        return exc
    return FinalError(exc.message.replace(exc.param or "", path, 1), param=path, code=exc.code)


def chat_tool_choice(choice: dict[str, Any]) -> str | dict[str, Any] | None:
    """Anthropic's ``tool_choice`` in chat's shape (``_policy`` checked it)."""
    kind = choice.get("type")
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return kind if kind in ("auto", "none") else None


def _system(system: str | list[Any] | None, ignored: set[str]) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    texts = []
    for j, block in enumerate(system):
        text = _text_block(block, f"system.{j}", ignored)
        if text.startswith(BILLING_HEADER):
            ignored.add(f"system.{BILLING_HEADER}")
        elif text:
            texts.append(text)
    return [{"role": "system", "content": "".join(texts)}] if texts else []


def _translated(message: Any, where: str, images: bool) -> Translated:
    ignored: set[str] = set()
    chat = _message(message, where, ignored, images)
    found = []
    for m, out in enumerate(chat):
        content = out["content"]
        for k, part in enumerate(content if isinstance(content, list) else ()):
            marker = part.pop("_block", None)
            if marker is not None:
                found.append((m, k, marker))
    return Translated(message, chat, frozenset(ignored), tuple(found))


def _message(message: Any, where: str, ignored: set[str],
             images: bool) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user message with tool results: the tool
    messages, then the user's text and images). ``images``: image blocks are served."""
    if not isinstance(message, dict):
        raise _bad(where, f"a message is an object, got {value_repr(message)}")
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise _bad(f"{where}.role", "must be 'user', 'assistant' or 'system', got "
                                    f"{value_repr(role)}")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if role == "system":  # Claude Code sends its environment notes as one, after the task
        return _system(content if isinstance(content, list) else _bad_content(where, content),
                       ignored)
    if not isinstance(content, list):
        _bad_content(where, content)
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and image parts in block order (user turns)
    out: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        path = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(block, dict) and block.get("cache_control") is not None:
            ignored.add("cache_control")
        if kind == "text":
            texts.append(_text_block(block, path, ignored))
            parts.append({"type": "text", "text": texts[-1]})
        elif role == "user" and kind == "image":
            parts.append(_image(block, path, ignored, images))
        elif role == "user" and kind == "tool_result":
            out.append(_tool_result(block, path, ignored, images))
        elif role == "assistant" and kind == "tool_use":
            calls.append(_tool_use(block, path))
        elif role == "assistant" and kind == "thinking":
            thinking.append(_string(block, "thinking", path))
        elif role == "assistant" and kind == "redacted_thinking":
            continue  # opaque; the recorded tokens stand for the reply
        else:
            raise _bad(path, f"{role} content blocks of type {value_repr(kind)} are not served "
                             "(text, image, tool_use, tool_result, thinking are)")
    if role == "user":
        if len(parts) > len(texts):  # images among the blocks: the parts, in block order
            out.append({"role": "user", "content": parts})
        elif texts or not out:
            out.append({"role": "user", "content": _joined(texts)})
        return out
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        reply["tool_calls"] = calls
    if thinking:
        reply["reasoning_content"] = "".join(thinking)
    return [reply]


def _bad_content(where: str, content: Any) -> NoReturn:
    raise _bad(f"{where}.content", "must be a string or a list of content blocks, got "
                                   f"{value_repr(content)}")


def _joined(texts: list[str]) -> str | list[dict[str, Any]]:
    """Text blocks as chat content: one is a string, several are text parts."""
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def _text_block(block: Any, where: str, ignored: set[str]) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise _bad(where, "must be a text block")
    if block.get("cache_control") is not None:
        ignored.add("cache_control")
    return _string(block, "text", where)


def _tool_result(block: dict[str, Any], where: str, ignored: set[str],
                 images: bool) -> dict[str, Any]:
    """A ``tool_result`` as a tool message: its text blocks joined by newlines, or, when
    it holds images, its text and image parts in block order."""
    content = block.get("content")
    result: str | list[dict[str, Any]]
    if content is None:
        result = ""
    elif isinstance(content, str):
        result = content
    elif isinstance(content, list):
        parts = [_image(part, f"{where}.content.{k}", ignored, images)
                 if isinstance(part, dict) and part.get("type") == "image"
                 else {"type": "text", "text": _text_block(part, f"{where}.content.{k}", ignored)}
                 for k, part in enumerate(content)]
        if any(p["type"] == "image_url" for p in parts):
            result = parts
        else:
            result = "\n".join(p["text"] for p in parts)
    else:
        raise _bad(f"{where}.content", "must be a string or a list of text and image blocks, "
                                       f"got {value_repr(content)}")
    if block.get("is_error") is not None:
        ignored.add("tool_result.is_error")
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where),
            "content": result}


def _image(block: dict[str, Any], where: str, ignored: set[str],
           images: bool) -> dict[str, Any]:
    """An image block as chat's ``image_url`` part holding its data URL; the part carries
    a ``_block`` marker (its path) that :func:`_translated` takes out again.

    Raises:
        FinalError: no vision processor (``images`` false), or a source other than base64.
        ProxyRequestError: a malformed source.
    """
    if not images:
        raise FinalError(f"{where}: image blocks are not served: this proxy has no vision "
                         "processor (ProxyServer(processor=...))", param=f"{where}.type",
                         code="unsupported_parameter")
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{where}.source", f"must be an object, got {value_repr(source)}")
    kind = source.get("type")
    if kind != "base64":
        raise FinalError(f"{where}.source: only base64 image sources are served; the proxy "
                         f"fetches no URL and holds no file (got type {value_repr(kind)})",
                         param=f"{where}.source.type", code="invalid_image")
    media_type = _string(source, "media_type", f"{where}.source")
    if not _MEDIA_TYPE.fullmatch(media_type):  # it becomes a data URL's header
        raise FinalError(f"{where}.source.media_type: an image type is served "
                         f"('image/png', 'image/jpeg', ...), got {value_repr(media_type)}",
                         param=f"{where}.source.media_type", code="invalid_image")
    data = _string(source, "data", f"{where}.source")
    if block.get("transformations") is not None:
        ignored.add("image.transformations")
    # the processor decodes and checks the image (_history); errors come back to this path
    return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"},
            "_block": where}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise _bad(f"{where}.input", f"must be an object, got {value_repr(arguments)}")
    # the arguments stay an object: they are compared as parsed JSON, and written as JSON
    # text only where the message is rendered (never, once it matched the recorded reply)
    return {"id": _string(block, "id", where), "type": "function",
            "function": {"name": _string(block, "name", where), "arguments": arguments}}


def _tools(tools: list[Any] | None, ignored: set[str]) -> list[dict[str, Any]] | None:
    """Client tools in chat's shape; server tools are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _bad(where, f"a tool is an object, got {value_repr(tool)}")
        if tool.get("type") not in (None, "custom"):
            raise FinalError(f"{where}: only client tools are served (server tools such as "
                             f"{tool.get('type')!r} are not)", param=where,
                             code="unsupported_parameter")
        if tool.get("cache_control") is not None:
            ignored.add("cache_control")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema", f"must be an object, got {value_repr(schema)}")
        function: dict[str, Any] = {"name": _string(tool, "name", where), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = _string(tool, "description", where)
        out.append({"type": "function", "function": function})
    return out


def _string(block: dict[str, Any], name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise _bad(f"{where}.{name}", f"must be a string, got {value_repr(value)}")
    return value


def _bad(where: str, why: str) -> ProxyRequestError:
    return ProxyRequestError(f"{where}: {why}", param=where, code="invalid_value")
