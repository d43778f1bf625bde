"""The proxy's HTTP plumbing: what its routes need of the server, request bodies, JSON answers.

:class:`ProxyHost` is the part of :class:`~pipeline.proxy.ProxyServer` the routes use (``_app``
and ``_completions`` read the server through it, so they never import it). Bodies must arrive
within ``read_timeout_s`` (408) and are decoded off the event loop above ``offload_bytes``;
every error is answered as an OpenAI-style JSON body (``_errors``), final ones with
``x-should-retry: false``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

import pydantic_core
from aiohttp import web

from pipeline._data.config import SamplingParams
from pipeline.proxy._config import ProxyConfig
from pipeline.proxy._errors import ProxyError, ProxyRequestError
from pipeline.proxy._messages_reply import error_body
from pipeline.proxy._records import SessionRecord
from pipeline.proxy._sessions import Session, SessionStore
from pipeline.proxy._turns import TurnRunner


class ProxyHost(Protocol):
    """What the proxy's routes need of the server (:class:`~pipeline.proxy.ProxyServer`)."""

    config: ProxyConfig
    sessions: SessionStore
    turns: TurnRunner
    enforces: frozenset[str]
    template_hints: frozenset[str]

    def session_url(self, session: Session | str) -> str: ...

    def create_session(self, session_id: str | None = None, *,
                       sampling: SamplingParams | None = None, lock_sampling: bool = False,
                       metadata: Mapping[str, Any] | None = None,
                       held: bool = False) -> Session: ...

    async def complete_session(self, session_id: str) -> SessionRecord: ...

    async def delete_session(self, session_id: str) -> None: ...


async def read_body(request: web.Request, config: ProxyConfig) -> bytes:
    """The raw body.

    Raises:
        ProxyRequestError: it did not arrive within ``read_timeout_s`` (408).
    """
    try:
        async with asyncio.timeout(config.read_timeout_s):
            return await request.read()
    except TimeoutError:
        raise ProxyRequestError(f"the request body did not arrive within read_timeout_s="
                                f"{config.read_timeout_s:g} s", status=408,
                                code="request_timeout") from None


async def read_json(request: web.Request, config: ProxyConfig) -> tuple[Any, bool]:
    """The decoded JSON body, and whether it is large (then decoded off the loop)."""
    body = await read_body(request, config)
    large = len(body) > config.offload_bytes
    if large:  # decoding many messages would block the loop
        return await asyncio.to_thread(decode, body), large
    return decode(body), large


def bearer(request: web.Request) -> str | None:
    """The request's key, if it sent one: its bearer token, else its ``x-api-key`` header
    (how the ``anthropic`` SDK and Claude Code send an API key)."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer":
        return token.strip() or None
    return request.headers.get("x-api-key", "").strip() or None


def decode(body: bytes) -> Any:
    """Decode a JSON body.

    Raises:
        ProxyRequestError: it is not valid JSON.
    """
    try:
        return pydantic_core.from_json(body)
    except ValueError as exc:
        raise ProxyRequestError(f"the body is not valid JSON: {str(exc)[:200]}",
                                code="invalid_json") from None


def json_response(data: Any, status: int = 200) -> web.Response:
    """``data`` as a JSON answer."""
    return web.Response(body=pydantic_core.to_json(data), status=status,
                        content_type="application/json")


def error_response(exc: ProxyError) -> web.Response:
    """The OpenAI-style answer of ``exc`` (``WWW-Authenticate`` on 401, ``x-should-retry:
    false`` when final)."""
    response = json_response(exc.body(), status=exc.status)
    if exc.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    if exc.final:
        response.headers["x-should-retry"] = "false"
    return response


def anthropic_error_response(exc: ProxyError) -> web.Response:
    """:func:`error_response` in Anthropic's error shape (the Messages routes)."""
    response = error_response(exc)
    response.body = pydantic_core.to_json(error_body(exc))
    return response


def event_stream() -> web.StreamResponse:
    """A server-sent events answer, not yet prepared."""
    return web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
