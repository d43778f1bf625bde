"""The turn routes over HTTP: chat completions, the Responses API and Anthropic's Messages API,
from a decoded body to the answer (JSON, or server-sent events when the request streams).

Each request's fields are checked against the policy (``_policy``: served, enforced by the
engine, or refused), the turn runs in its session (``_turns``), and the reply is written in the
API's wire form (``_wire`` for chat, ``_responses`` for the Responses API, ``_messages`` for
the Messages API). A client that goes
away mid-stream is logged as such, not as an error.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pydantic_core
import structlog
from aiohttp import web
from pydantic import BaseModel

from pipeline.proxy import _messages, _messages_reply
from pipeline.proxy._errors import FinalError
from pipeline.proxy._http import ProxyHost, event_stream, json_response
from pipeline.proxy._policy import (
    CHAT_FIELDS,
    RESPONSES_FIELDS,
    Constraints,
    FieldRule,
    check_fields,
    read_hints,
)
from pipeline.proxy._policy_messages import MESSAGES_FIELDS
from pipeline.proxy._responses import (
    ResponseLink,
    ResponsesRequest,
    conversation_of,
    new_response_id,
    output_items,
    parse_responses,
    reply_message,
    response_body,
    stream_events,
    to_chat,
)
from pipeline.proxy._sessions import Session
from pipeline.proxy._turns import TurnOutcome
from pipeline.proxy._wire import (
    ChatCompletionRequest,
    completion_body,
    parse_request,
    stream_chunks,
    usage_body,
)

_logger = structlog.get_logger("pipeline.proxy")


async def serve_chat(host: ProxyHost, request: web.Request, session: Session, data: Any,
                     large: bool) -> web.StreamResponse:
    """Run a chat completion in ``session`` from the decoded body ``data`` and answer it
    (``large``: validate and render off the event loop)."""
    chat = (await asyncio.to_thread(parse_request, data) if large
            else parse_request(data))
    features = check_fields(data, CHAT_FIELDS, host.enforces)
    chat, ignored = _with_hints(host, data, CHAT_FIELDS, chat)
    constraints = None if not features else Constraints(
        features, response_format=data.get("response_format"),
        tool_choice=data.get("tool_choice"), tools=chat.tool_schemas)
    outcome = await host.turns.run(session, chat, offload=large, constraints=constraints)
    if outcome.turn is not None:
        outcome.turn.ignored_fields = ignored
    _log_split(session, outcome)
    return await _answer(host, request, bool(chat.stream), chat.stream_options is not None
                         and chat.stream_options.include_usage, outcome)


async def serve_responses(host: ProxyHost, request: web.Request, session: Session, data: Any,
                          large: bool) -> web.StreamResponse:
    """Run a Responses API turn in ``session`` from the decoded body ``data`` (following its
    ``previous_response_id``) and answer it."""
    spec = (await asyncio.to_thread(parse_responses, data) if large
            else parse_responses(data))
    features = check_fields(data, RESPONSES_FIELDS, host.enforces)
    prior = conversation_of(session.responses, spec.previous_response_id,
                            host.config.max_turns)
    images = host.turns.processor is not None
    if large:  # validating many messages would block the loop
        chat, added = await asyncio.to_thread(to_chat, spec, prior, images=images)
    else:
        chat, added = to_chat(spec, prior, images=images)
    chat, ignored = _with_hints(host, data, RESPONSES_FIELDS, chat)
    constraints = _responses_constraints(spec, chat, features) if features else None
    outcome = await host.turns.run(session, chat, offload=large, constraints=constraints)
    _log_split(session, outcome)
    rid = new_response_id()
    session.responses[rid] = ResponseLink(spec.previous_response_id,
                                          [*added, reply_message(outcome.reply)])
    if outcome.turn is not None:
        outcome.turn.request.update(api="responses", response_id=rid,
                                    previous_response_id=spec.previous_response_id)
        outcome.turn.ignored_fields = ignored
    final = response_body(
        response_id=rid, model=host.config.model_name, request=spec,
        output=output_items(outcome.reply, outcome.logprobs,
                            outcome.finish_reason == "length"),
        finish_reason=outcome.finish_reason, prompt_tokens=outcome.prompt_tokens,
        completion_tokens=len(outcome.reply.token_ids or ()),
        cached_tokens=outcome.cached_tokens)
    if not spec.stream:
        return json_response(final)
    return await _write_events(request, stream_events(final))


async def serve_messages(host: ProxyHost, request: web.Request, session: Session, data: Any,
                         large: bool) -> web.StreamResponse:
    """Run an Anthropic Messages API turn in ``session`` from the decoded body ``data`` and
    answer it (``_messages``)."""
    spec = (await asyncio.to_thread(_messages.parse_messages, data) if large
            else _messages.parse_messages(data))
    features = check_fields(data, MESSAGES_FIELDS, host.enforces)
    images = host.turns.processor is not None
    if large:  # translating many blocks would block the loop
        chat, extra, image_paths = await asyncio.to_thread(
            _messages.to_chat, spec, session.translated, images=images)
    else:
        chat, extra, image_paths = _messages.to_chat(spec, session.translated, images=images)
    if extra and host.config.strict_fields:
        raise FinalError(f"{extra[0]}: the proxy cannot act on this hint, and strict_fields "
                         "refuses what it would ignore", param=extra[0],
                         code="unsupported_parameter")
    chat, ignored = _with_hints(host, data, MESSAGES_FIELDS, chat)
    constraints = None if not features else Constraints(
        features, response_format=_messages_format(data),
        tool_choice=chat.tool_choice if not isinstance(chat.tool_choice, BaseModel)
        else chat.tool_choice.model_dump(), tools=chat.tool_schemas)
    try:
        outcome = await host.turns.run(session, chat, offload=large, constraints=constraints)
    except FinalError as exc:  # a refused image: named by its block, not its chat part
        renamed = _messages.image_error(exc, image_paths)
        if renamed is exc:
            raise
        raise renamed from None
    _log_split(session, outcome)
    stop_string = None
    if outcome.turn is not None:
        outcome.turn.request.update(api="messages")
        outcome.turn.ignored_fields = (*ignored, *(p for p in extra if p not in ignored))
        stop_string = outcome.turn.stop_string
    final = _messages_reply.message_body(
        message_id=_messages_reply.new_message_id(), model=host.config.model_name,
        reply=outcome.reply, finish_reason=outcome.finish_reason, stop_string=stop_string,
        usage=_messages_reply.usage_body(outcome.prompt_tokens, len(outcome.reply.token_ids or ()),
                                   outcome.cached_tokens))
    if not spec.stream:
        return json_response(final)
    return await _write_events(request, _messages_reply.stream_events(final))


def _messages_format(data: dict[str, Any]) -> dict[str, Any] | None:
    """A Messages request's output format (``output_config.format``, or the older
    ``output_format``) in chat's ``response_format`` shape."""
    config = data.get("output_config")
    fmt = (config or {}).get("format") if isinstance(config, dict) else None
    fmt = fmt or data.get("output_format")
    if not isinstance(fmt, dict):
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"],
                                                   "strict": True}}


async def _write_events(request: web.Request,
                        events: list[dict[str, Any]]) -> web.StreamResponse:
    """Server-sent events named by their ``type`` (Responses and Messages streams)."""
    response = event_stream()
    try:
        await response.prepare(request)
        for event in events:
            await response.write(b"event: " + event["type"].encode() + b"\ndata: "
                                 + pydantic_core.to_json(event) + b"\n\n")
        await response.write_eof()
    except ConnectionResetError:
        _logger.info("proxy_client_gone", path=request.path, streamed=True)
    return response


def _with_hints(host: ProxyHost, data: Any, rules: dict[str, FieldRule],
                chat: ChatCompletionRequest) -> tuple[ChatCompletionRequest, tuple[str, ...]]:
    """The chat request with the template options the body's hints become (the agent's own
    ``chat_template_kwargs`` win over them), and the hints ignored.

    Raises:
        FinalError: a hint would be ignored and ``strict_fields`` is on.
    """
    hints = read_hints(data, rules, host.template_hints, strict=host.config.strict_fields)
    if hints.options:
        chat = chat.model_copy(update={"chat_template_kwargs": {
            **hints.options, **(chat.chat_template_kwargs or {})}})
    return chat, hints.ignored


def _responses_constraints(spec: ResponsesRequest, chat: ChatCompletionRequest,
                           features: frozenset[str]) -> Constraints:
    """The constraints of a Responses request, in the chat form the engine is given."""
    fmt = (spec.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {
            k: v for k, v in fmt.items() if k != "type"}}
    return Constraints(features, response_format=fmt,
                       tool_choice=chat.tool_choice if isinstance(
                           chat.tool_choice, str) else
                       None if chat.tool_choice is None
                       else chat.tool_choice.model_dump(),
                       tools=chat.tool_schemas)


def _log_split(session: Session, outcome: TurnOutcome) -> None:
    if outcome.turn is not None and not outcome.turn.merged and outcome.turn.segment > 0:
        _logger.info("session_split", session=session.id, reason=outcome.turn.split_reason,
                     segment=outcome.turn.segment)


async def _answer(host: ProxyHost, request: web.Request, stream: bool, stream_usage: bool,
                  outcome: TurnOutcome) -> web.StreamResponse:
    tokens = len(outcome.reply.token_ids or ())
    usage = usage_body(outcome.prompt_tokens, tokens, outcome.cached_tokens)
    cid = "chatcmpl-" + uuid.uuid4().hex
    model = host.config.model_name
    if not stream:
        return json_response(completion_body(completion_id=cid, model=model,
                                             message=outcome.reply,
                                             finish_reason=outcome.finish_reason, usage=usage,
                                             logprobs=outcome.logprobs))
    response = event_stream()
    try:
        await response.prepare(request)
        await _write_stream(response, cid, model, outcome, usage, stream_usage)
    except ConnectionResetError:
        _logger.info("proxy_client_gone", path=request.path, streamed=True)
    return response


async def _write_stream(response: web.StreamResponse, cid: str, model: str,
                        outcome: TurnOutcome, usage: dict[str, Any],
                        stream_usage: bool) -> None:
    for chunk in stream_chunks(completion_id=cid, model=model, message=outcome.reply,
                               finish_reason=outcome.finish_reason,
                               usage=usage if stream_usage else None,
                               logprobs=outcome.logprobs):
        await response.write(b"data: " + pydantic_core.to_json(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
