"""The proxy's aiohttp application: OpenAI routes per session, the sessions API, auth, limits.

Routes (``{sid}`` is a session id)::

    POST   /sessions/{sid}/v1/chat/completions   chat (stream true or false)
    POST   /sessions/{sid}/v1/responses          the Responses API (see ``_responses``)
    POST   /sessions/{sid}/v1/messages           Anthropic's Messages API (see ``_messages``)
    GET    /sessions/{sid}/v1/models             the served model
    POST   /v1/chat/completions                  chat; the session is the one the key opens
    POST   /v1/responses                         responses; the session the key opens
    POST   /v1/messages                          messages; the session the key opens
    GET    /v1/models
    GET    /health
    POST   /sessions                             create (server-generated id)
    POST   /sessions/{sid}                       create with a chosen id
    GET    /sessions/{sid}                       the record (see below)
    POST   /sessions/{sid}/complete              mark completed; returns the record
    DELETE /sessions/{sid}                       forget it; aborts its engine requests

Auth: one table, ``_access.ROUTE_ACCESS``, says per route what the server's ``api_key``, the
session's own key and anyone else get; the middleware applies it and nothing else decides
access. In short: a session's routes take that key or the server's key, never another
session's; ``/health``, ``/v1/models`` and creating sessions need the server's key when one is
configured (``/v1/models`` also takes any session key).

A key is sent as ``Authorization: Bearer ...`` or, as the ``anthropic`` SDK sends it, as
``x-api-key``. Every error is an OpenAI-style JSON body (Anthropic's shape on the Messages
routes) with a 4xx/5xx status; an unexpected error is logged
with its traceback and answered 500 without one; errors an agent must not retry are *final*
(404 with ``x-should-retry: false``, see ``_errors``). A client that goes away mid-answer is
logged as such, not as an error.

The record: with the server's key, segments with their token ids and turns with their
lengths (``?turn_tokens=true`` adds each turn's prompt ids: large, the prompt repeats per turn);
with the session's own key (``GET`` and ``complete``), the same without any token payload
(``_records.AGENT_VIEW``: no token lists, rendered prompt, or message token ids/logprobs).

Hostile or buggy agents: a reply is capped at ``max_tokens`` (default 16384), a request body
must arrive within ``read_timeout_s`` (408), bodies over ``offload_bytes`` are decoded,
validated and matched off the event loop (``_http``).

Every request field is served, enforced by the engine (its optional ``enforces`` attribute)
or refused with a final error; none is silently ignored (``_policy``, applied by the turn
routes in ``_completions``).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline._data.config import SamplingParams, describe_validation_error
from pipeline.proxy._access import (
    AGENT,
    ANTHROPIC_ROUTES,
    DENIED,
    FULL,
    ROUTE_ACCESS,
    SESSION_ROUTES,
    Grant,
)
from pipeline.proxy._completions import serve_chat, serve_messages, serve_responses
from pipeline.proxy._errors import ProxyAuthError, ProxyError, ProxyRequestError
from pipeline.proxy._http import (
    ProxyHost,
    anthropic_error_response,
    bearer,
    decode,
    error_response,
    json_response,
    read_body,
    read_json,
)
from pipeline.proxy._records import agent_view, session_record
from pipeline.proxy._sessions import Session
from pipeline.proxy._wire import models_body

_logger = structlog.get_logger("pipeline.proxy")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SessionCreate(BaseModel):
    """Body of ``POST /sessions`` (all optional)."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingParams | None = None
    lock_sampling: bool = False


def build_app(host: ProxyHost) -> web.Application:
    """The application serving ``host``'s sessions (see the module doc)."""
    routes = _Routes(host)
    app = web.Application(client_max_size=host.config.max_body_bytes,
                          middlewares=[routes.guard])
    add = app.router.add_route
    add("GET", "/health", routes.health, name="health")
    add("GET", "/v1/models", routes.models, name="models")
    add("POST", "/v1/chat/completions", routes.chat, name="chat")
    add("POST", "/v1/responses", routes.responses, name="responses")
    add("POST", "/v1/messages", routes.messages, name="messages")
    add("POST", "/sessions", routes.create, name="create")
    add("POST", "/sessions/{sid}", routes.create, name="create_named")
    add("GET", "/sessions/{sid}", routes.get, name="session_get")
    add("DELETE", "/sessions/{sid}", routes.delete, name="session_delete")
    add("POST", "/sessions/{sid}/complete", routes.complete, name="session_complete")
    add("GET", "/sessions/{sid}/v1/models", routes.models, name="session_models")
    add("POST", "/sessions/{sid}/v1/chat/completions", routes.chat, name="session_chat")
    add("POST", "/sessions/{sid}/v1/responses", routes.responses, name="session_responses")
    add("POST", "/sessions/{sid}/v1/messages", routes.messages, name="session_messages")
    return app


class _Routes:
    """The handlers and the access middleware of one server's application."""

    def __init__(self, host: ProxyHost) -> None:
        self.host = host

    @web.middleware
    async def guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            self._authorize(request)
            return await handler(request)
        except ProxyError as exc:
            if request.match_info.route.name in ANTHROPIC_ROUTES:
                return anthropic_error_response(exc)
            return error_response(exc)
        except ConnectionResetError:  # the client went away while we wrote the answer
            _logger.info("proxy_client_gone", path=request.path)
            raise
        except web.HTTPException as exc:  # routing (404, 405) and body size (413)
            if exc.status < 400:
                raise
            return error_response(ProxyRequestError(exc.reason, status=exc.status,
                                                    code=exc.reason.lower().replace(" ", "_")))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _logger.error("proxy_internal_error", path=request.path, error=repr(exc),
                          exc_info=True)
            internal = ProxyError("internal error in the proxy; see its log",
                                  code="internal_error")
            if request.match_info.route.name in ANTHROPIC_ROUTES:
                return anthropic_error_response(internal)
            return error_response(internal)

    def _authorize(self, request: web.Request) -> Grant:
        """The request's grant under its route's rule (``_access.ROUTE_ACCESS``, the one
        place access is decided; handlers that serve records ask again for the view).

        Raises:
            ProxyAuthError: the rule denies this caller (401).
            SessionNotFound: the key is of a session that expired (404, final).
        """
        name = request.match_info.route.name
        if name is None:
            return FULL  # no route: the handler answers 404/405
        rule = ROUTE_ACCESS.get(name)
        if rule is None:  # a route without a rule is served to nobody
            raise ProxyAuthError(f"route {name!r} has no access rule", code="invalid_api_key")
        token = bearer(request)
        admin = self.host.config.api_key
        if admin is not None and token is not None and hmac.compare_digest(
                token.encode(), admin.encode()):
            grant = rule.grant("admin", server_key=True)
        elif self._opens(name, request, token):
            grant = rule.grant("own", server_key=admin is not None)
        else:
            grant = rule.grant("anyone", server_key=admin is not None)
        if grant == DENIED:
            sessions = self.host.sessions
            if token is not None and rule.own != DENIED and (
                    name not in SESSION_ROUTES
                    or sessions.find(request.match_info["sid"]) is None):
                sessions.raise_expired(token)  # its own key: tell it the session expired
            raise ProxyAuthError(f"this route needs {rule.needs()} (Authorization: Bearer ...)",
                                 code="invalid_api_key")
        return grant

    def _opens(self, name: str, request: web.Request, token: str | None) -> bool:
        """Whether ``token`` is the route's session's own key (on a route without ``{sid}``:
        any live session's key, the session it opens)."""
        if token is None:
            return False
        if name not in SESSION_ROUTES:
            return self.host.sessions.by_key(token) is not None
        session = self.host.sessions.find(request.match_info["sid"])
        return session is not None and hmac.compare_digest(token.encode(),
                                                            session.api_key.encode())

    def _session_of(self, request: web.Request) -> Session:
        """The session an authorised request is for (by its id, or by the key it sent)."""
        sid = request.match_info.get("sid")
        if sid is not None:
            return self.host.sessions.get(sid)
        session = self.host.sessions.by_key(bearer(request) or "")
        if session is None:  # deleted while the request was read
            raise ProxyAuthError("the session of this key is gone", code="invalid_api_key")
        return session

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok", "sessions": len(self.host.sessions)})

    async def models(self, request: web.Request) -> web.Response:
        return json_response(models_body(self.host.config.model_name))

    async def create(self, request: web.Request) -> web.Response:
        body = await read_body(request, self.host.config)
        data = decode(body) if body.strip() else {}
        try:
            spec = SessionCreate.model_validate(data)
        except ValidationError as exc:
            raise ProxyRequestError(describe_validation_error(exc), code="invalid_value") from None
        session = self.host.create_session(request.match_info.get("sid"), sampling=spec.sampling,
                                           lock_sampling=spec.lock_sampling,
                                           metadata=spec.metadata)
        return json_response({"id": session.id, "api_key": session.api_key,
                              "base_url": self.host.session_url(session),
                              "created_at": session.created_at,
                              "idle_timeout_s": self.host.config.idle_timeout_s}, status=201)

    async def get(self, request: web.Request) -> web.Response:
        session = self._session_of(request)
        if self._authorize(request) == AGENT:  # the agent's own key: no token payloads
            return json_response(agent_view(session_record(session, turn_tokens=False)))
        turn_tokens = request.query.get("turn_tokens", "").lower() in ("1", "true")
        return json_response(session_record(session, turn_tokens=turn_tokens)
                             .model_dump(mode="json"))

    async def complete(self, request: web.Request) -> web.Response:
        session, grant = self._session_of(request), self._authorize(request)
        record = await self.host.complete_session(session.id)
        if grant == AGENT:
            return json_response(agent_view(record))
        return json_response(record.model_dump(mode="json"))

    async def delete(self, request: web.Request) -> web.Response:
        session = self._session_of(request)
        await self.host.delete_session(session.id)
        return json_response({"id": session.id, "deleted": True})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session_of(request)
        data, large = await read_json(request, self.host.config)
        return await serve_chat(self.host, request, session, data, large)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        session = self._session_of(request)
        data, large = await read_json(request, self.host.config)
        return await serve_responses(self.host, request, session, data, large)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        session = self._session_of(request)
        data, large = await read_json(request, self.host.config)
        return await serve_messages(self.host, request, session, data, large)
