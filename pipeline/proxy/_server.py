"""The proxy's aiohttp server: OpenAI routes per session, the sessions API, auth, limits.

Routes (``{sid}`` is a session id)::

    POST   /sessions/{sid}/v1/chat/completions   chat (stream true or false)
    POST   /sessions/{sid}/v1/responses          the Responses API (see ``_responses``)
    GET    /sessions/{sid}/v1/models             the served model
    POST   /v1/chat/completions                  chat; the session is the one the key opens
    POST   /v1/responses                         responses; the session the key opens
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

Every error is an OpenAI-style JSON body with a 4xx/5xx status; an unexpected error is logged
with its traceback and answered 500 without one; errors an agent must not retry are *final*
(404 with ``x-should-retry: false``, see ``_errors``). A client that goes away mid-answer is
logged as such, not as an error.

The record: with the server's key, segments with their token ids and turns with their
lengths (``?turn_tokens=true`` adds each turn's prompt ids: large, the prompt repeats per turn);
with the session's own key (``GET`` and ``complete``), the same without any token payload
(``_records.AGENT_VIEW``: no token lists, rendered prompt, or message token ids/logprobs).

Hostile or buggy agents: a reply is capped at ``max_tokens`` (default 16384), a request body
must arrive within ``read_timeout_s`` (408), bodies over ``offload_bytes`` are decoded,
validated and matched off the event loop.

Every request field is served, enforced by the engine (its optional ``enforces`` attribute)
or refused with a final error; none is silently ignored (``_policy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import uuid
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

import pydantic_core
import structlog
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline._concurrency.cancel import abort_request
from pipeline._data.config import SamplingParams, describe_validation_error
from pipeline._exceptions import ConfigError
from pipeline._net import start_site
from pipeline._runner.context import Resources
from pipeline._text.tokenizer import Tokenizer
from pipeline.engines import Engine
from pipeline.proxy._access import AGENT, DENIED, FULL, ROUTE_ACCESS, SESSION_ROUTES, Grant
from pipeline.proxy._errors import ProxyAuthError, ProxyError, ProxyRequestError
from pipeline.proxy._policy import (
    CHAT_FIELDS,
    RESPONSES_FIELDS,
    Constraints,
    check_fields,
    engine_enforces,
)
from pipeline.proxy._records import SessionRecord, agent_view, session_record
from pipeline.proxy._responses import (
    ResponseLink,
    conversation_of,
    new_response_id,
    output_items,
    parse_responses,
    reply_message,
    response_body,
    stream_events,
    to_chat,
)
from pipeline.proxy._sessions import Session, SessionStore
from pipeline.proxy._turns import TurnOutcome, TurnRunner
from pipeline.proxy._wire import (
    completion_body,
    models_body,
    parse_request,
    stream_chunks,
    usage_body,
)
from pipeline.tools import HermesToolParser, ToolParser

_logger = structlog.get_logger("pipeline.proxy")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProxyConfig(BaseModel):
    """Options of a :class:`ProxyServer`.

    Attributes:
        host / port: where to listen (127.0.0.1 by default; port 0 lets the OS choose, a
            fixed port is retried while busy).
        api_key: the server's bearer token (None: the routes that need it are open).
        model_name: the model id the proxy reports.
        max_sessions: sessions held at once.
        max_turns: chat completions per session.
        max_body_bytes: largest request body (413 above it).
        idle_timeout_s: sessions idle this long expire.
        max_tokens: cap on one reply, whatever the agent asks (None: no cap beyond the
            session's sampling; the engine's context applies anyway).
        sampling: sampling of sessions created over HTTP without their own.
        offload_chars: render in a worker thread when a request's new messages hold more text.
        abort_timeout_s: bound on one engine abort (a client gone, a session deleted); a
            failed or slow abort is logged, never an error of the request.
        read_timeout_s: a request body must arrive within this (408 after it).
        offload_bytes: decode, validate and match larger bodies in a worker thread.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    api_key: str | None = Field(None, min_length=8)
    model_name: str = "pipeline-proxy"
    max_sessions: int = Field(4096, ge=1)
    max_turns: int = Field(512, ge=1)
    max_body_bytes: int = Field(16 * 2**20, ge=1024)
    idle_timeout_s: float = Field(900.0, gt=0)
    max_tokens: int | None = Field(16384, ge=1)
    sampling: SamplingParams = SamplingParams()
    offload_chars: int = Field(32768, ge=0)
    abort_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(60.0, gt=0)
    offload_bytes: int = Field(256 * 1024, ge=0)


class SessionCreate(BaseModel):
    """Body of ``POST /sessions`` (all optional)."""

    model_config = ConfigDict(extra="forbid")

    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling: SamplingParams | None = None
    lock_sampling: bool = False


class ProxyServer:
    """An OpenAI-compatible proxy that records token-exact sessions (see the module doc).

    Use it as ``async with ProxyServer(engine, tokenizer) as proxy: ...`` or call
    :meth:`start` and :meth:`aclose`.

    Args:
        engine: the engine replies come from.
        tokenizer: the engine's tokenizer (its chat template renders the messages).
        config: a :class:`ProxyConfig` or a dict; keyword ``options`` override its fields.
        parser: finds tool calls in replies (default :class:`HermesToolParser`).
        eos_token_id: the template's end-of-turn token (default: the tokenizer's eos).

    The engine and tokenizer go through the same check as a ``Pipeline``'s
    (:func:`pipeline._runner.context.check_resources`): a :class:`~pipeline.SimulatedEngine` built
    without ``eos_token_id`` takes the tokenizer's, one with another eos is refused.

    Raises:
        ConfigError: an invalid option, naming the field; an engine or tokenizer a
            ``Pipeline`` would refuse.
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer,
                 config: ProxyConfig | Mapping[str, Any] | None = None, *,
                 parser: ToolParser | None = None, eos_token_id: int | None = None,
                 **options: Any) -> None:
        Resources(engine=engine, tokenizer=tokenizer)  # the Pipeline's check (eos pairing)
        base = (config.model_dump() if isinstance(config, ProxyConfig)
                else dict(config or {}))
        try:
            self.config = ProxyConfig.model_validate({**base, **options})
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, "proxy")) from None
        cfg = self.config
        self.engine = engine
        self.sessions = SessionStore(tokenizer, max_sessions=cfg.max_sessions,
                                     idle_timeout_s=cfg.idle_timeout_s, sampling=cfg.sampling,
                                     eos_token_id=eos_token_id)
        self.turns = TurnRunner(engine, tokenizer, parser or HermesToolParser(),
                                max_tokens=cfg.max_tokens, max_turns=cfg.max_turns,
                                offload_chars=cfg.offload_chars,
                                abort_timeout_s=cfg.abort_timeout_s)
        self.enforces = engine_enforces(engine)
        """Decoding constraints the engine declared it enforces (``_policy``)."""
        self.app = self._build_app()
        self._runner: web.AppRunner | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._url: str | None = None

    # ----- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://host:port`` once started."""
        if self._url is None:
            raise RuntimeError("the proxy is not started: call 'await proxy.start()'")
        return self._url

    async def start(self) -> str:
        """Bind (retrying a busy fixed port), serve, and return the URL.

        Raises:
            AddressInUseError: a fixed port stayed busy.
        """
        if self._runner is not None:
            return self.url
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            _, port = await start_site(runner, self.config.host, self.config.port)
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        host = self.config.host
        self._url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._sweeper = asyncio.create_task(self._sweep(), name="proxy-session-sweeper")
        _logger.info("proxy_started", url=self._url, auth=self.config.api_key is not None)
        return self._url

    async def aclose(self) -> None:
        """Abort in-flight engine requests, stop the sweeper and the server."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for session in self.sessions.all():
            await self._abort(session)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # ----- in-process sessions API -------------------------------------------------------

    def session_url(self, session: Session | str) -> str:
        """The OpenAI base URL of a session (``.../sessions/{sid}/v1``)."""
        sid = session if isinstance(session, str) else session.id
        return f"{self.url}/sessions/{sid}/v1"

    def create_session(self, session_id: str | None = None, *,
                       sampling: SamplingParams | None = None, lock_sampling: bool = False,
                       metadata: Mapping[str, Any] | None = None,
                       held: bool = False) -> Session:
        """Create a session in-process (what ``POST /sessions`` does).

        ``held=True``: the session never expires while ``session.held`` stays True (its owner
        releases it by setting it False or deleting the session).

        Raises:
            ProxyRequestError: a malformed or taken ``session_id``.
            ProxyLimitError: too many sessions.
        """
        return self.sessions.create(session_id, sampling=sampling, lock_sampling=lock_sampling,
                                    metadata=metadata, held=held)

    def record(self, session_id: str) -> SessionRecord:
        """The session's record (``GET /sessions/{sid}``)."""
        return session_record(self.sessions.get(session_id))

    async def complete_session(self, session_id: str) -> SessionRecord:
        """Mark the session completed once its running turn is done; returns its record."""
        session = self.sessions.get(session_id)
        async with session.lock:
            self.sessions.complete(session_id)
        return session_record(session)

    async def delete_session(self, session_id: str) -> None:
        """Forget the session and abort its engine requests; unknown ids are ignored."""
        session = self.sessions.find(session_id)
        if session is None:
            return
        self.sessions.remove(session_id)
        await self._abort(session)

    async def _abort(self, session: Session) -> None:
        for request_id in list(session.inflight):
            await abort_request(self.engine, request_id, self.config.abort_timeout_s,
                                session=session.id)

    async def _sweep(self) -> None:
        interval = min(max(self.config.idle_timeout_s / 4, 0.01), 30.0)
        while True:
            await asyncio.sleep(interval)
            for session in self.sessions.idle():
                if self.sessions.find(session.id) is not session:
                    continue
                self.sessions.expire(session.id)
                await self._abort(session)
                _logger.info("session_expired", session=session.id, turns=len(session.turns))

    # ----- HTTP --------------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes,
                              middlewares=[self._guard])
        add = app.router.add_route
        add("GET", "/health", self._health, name="health")
        add("GET", "/v1/models", self._models, name="models")
        add("POST", "/v1/chat/completions", self._chat, name="chat")
        add("POST", "/v1/responses", self._responses, name="responses")
        add("POST", "/sessions", self._create, name="create")
        add("POST", "/sessions/{sid}", self._create, name="create_named")
        add("GET", "/sessions/{sid}", self._get, name="session_get")
        add("DELETE", "/sessions/{sid}", self._delete, name="session_delete")
        add("POST", "/sessions/{sid}/complete", self._complete, name="session_complete")
        add("GET", "/sessions/{sid}/v1/models", self._models, name="session_models")
        add("POST", "/sessions/{sid}/v1/chat/completions", self._chat, name="session_chat")
        add("POST", "/sessions/{sid}/v1/responses", self._responses, name="session_responses")
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            self._authorize(request)
            return await handler(request)
        except ProxyError as exc:
            return _error(exc)
        except ConnectionResetError:  # the client went away while we wrote the answer
            _logger.info("proxy_client_gone", path=request.path)
            raise
        except web.HTTPException as exc:  # routing (404, 405) and body size (413)
            if exc.status < 400:
                raise
            return _error(ProxyRequestError(exc.reason, status=exc.status,
                                            code=exc.reason.lower().replace(" ", "_")))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            _logger.error("proxy_internal_error", path=request.path, error=repr(exc),
                          exc_info=True)
            return _error(ProxyError("internal error in the proxy; see its log",
                                     code="internal_error"))

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
        token = _bearer(request)
        admin = self.config.api_key
        if admin is not None and token is not None and hmac.compare_digest(
                token.encode(), admin.encode()):
            grant = rule.grant("admin", server_key=True)
        elif self._opens(name, request, token):
            grant = rule.grant("own", server_key=admin is not None)
        else:
            grant = rule.grant("anyone", server_key=admin is not None)
        if grant == DENIED:
            if token is not None and rule.own != DENIED and (
                    name not in SESSION_ROUTES
                    or self.sessions.find(request.match_info["sid"]) is None):
                self.sessions.raise_expired(token)  # its own key: tell it the session expired
            raise ProxyAuthError(f"this route needs {rule.needs()} (Authorization: Bearer ...)",
                                 code="invalid_api_key")
        return grant

    def _opens(self, name: str, request: web.Request, token: str | None) -> bool:
        """Whether ``token`` is the route's session's own key (on a route without ``{sid}``:
        any live session's key, the session it opens)."""
        if token is None:
            return False
        if name not in SESSION_ROUTES:
            return self.sessions.by_key(token) is not None
        session = self.sessions.find(request.match_info["sid"])
        return session is not None and hmac.compare_digest(token.encode(),
                                                            session.api_key.encode())

    def _session_of(self, request: web.Request) -> Session:
        """The session an authorised request is for (by its id, or by the key it sent)."""
        sid = request.match_info.get("sid")
        if sid is not None:
            return self.sessions.get(sid)
        session = self.sessions.by_key(_bearer(request) or "")
        if session is None:  # deleted while the request was read
            raise ProxyAuthError("the session of this key is gone", code="invalid_api_key")
        return session

    async def _health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "sessions": len(self.sessions)})

    async def _models(self, request: web.Request) -> web.Response:
        return _json(models_body(self.config.model_name))

    async def _create(self, request: web.Request) -> web.Response:
        body = await self._read(request)
        data = _decode(body) if body.strip() else {}
        try:
            spec = SessionCreate.model_validate(data)
        except ValidationError as exc:
            raise ProxyRequestError(describe_validation_error(exc), code="invalid_value") from None
        session = self.create_session(request.match_info.get("sid"), sampling=spec.sampling,
                                      lock_sampling=spec.lock_sampling, metadata=spec.metadata)
        return _json({"id": session.id, "api_key": session.api_key,
                      "base_url": self.session_url(session), "created_at": session.created_at,
                      "idle_timeout_s": self.config.idle_timeout_s}, status=201)

    async def _get(self, request: web.Request) -> web.Response:
        session = self._session_of(request)
        if self._authorize(request) == AGENT:  # the agent's own key: no token payloads
            return _json(agent_view(session_record(session, turn_tokens=False)))
        turn_tokens = request.query.get("turn_tokens", "").lower() in ("1", "true")
        return _json(session_record(session, turn_tokens=turn_tokens).model_dump(mode="json"))

    async def _complete(self, request: web.Request) -> web.Response:
        session, grant = self._session_of(request), self._authorize(request)
        record = await self.complete_session(session.id)
        if grant == AGENT:
            return _json(agent_view(record))
        return _json(record.model_dump(mode="json"))

    async def _delete(self, request: web.Request) -> web.Response:
        session = self._session_of(request)
        await self.delete_session(session.id)
        return _json({"id": session.id, "deleted": True})

    async def _read(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(self.config.read_timeout_s):
                return await request.read()
        except TimeoutError:
            raise ProxyRequestError(f"the request body did not arrive within read_timeout_s="
                                    f"{self.config.read_timeout_s:g} s", status=408,
                                    code="request_timeout") from None

    async def _body(self, request: web.Request) -> tuple[Any, bool]:
        """The decoded JSON body, and whether it is large (then decoded off the loop)."""
        body = await self._read(request)
        large = len(body) > self.config.offload_bytes
        if large:  # decoding many messages would block the loop
            return await asyncio.to_thread(_decode, body), large
        return _decode(body), large

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session_of(request)
        data, large = await self._body(request)
        chat = (await asyncio.to_thread(parse_request, data) if large
                else parse_request(data))
        features = check_fields(data, CHAT_FIELDS, self.enforces)
        constraints = None if not features else Constraints(
            features, response_format=data.get("response_format"),
            tool_choice=data.get("tool_choice"), tools=chat.tool_schemas)
        outcome = await self.turns.run(session, chat, offload=large, constraints=constraints)
        self._log_split(session, outcome)
        return await self._answer(request, bool(chat.stream), chat.stream_options is not None
                                  and chat.stream_options.include_usage, outcome)

    def _log_split(self, session: Session, outcome: TurnOutcome) -> None:
        if outcome.turn is not None and not outcome.turn.merged and outcome.turn.segment > 0:
            _logger.info("session_split", session=session.id, reason=outcome.turn.split_reason,
                         segment=outcome.turn.segment)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        session = self._session_of(request)
        data, large = await self._body(request)
        spec = (await asyncio.to_thread(parse_responses, data) if large
                else parse_responses(data))
        features = check_fields(data, RESPONSES_FIELDS, self.enforces)
        prior = conversation_of(session.responses, spec.previous_response_id,
                                self.config.max_turns)
        if large:  # validating many messages would block the loop
            chat, added = await asyncio.to_thread(to_chat, spec, prior)
        else:
            chat, added = to_chat(spec, prior)
        constraints = None
        if features:
            fmt = (spec.text or {}).get("format")
            if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
                fmt = {"type": "json_schema", "json_schema": {
                    k: v for k, v in fmt.items() if k != "type"}}
            constraints = Constraints(features, response_format=fmt,
                                      tool_choice=chat.tool_choice if isinstance(
                                          chat.tool_choice, str) else
                                      None if chat.tool_choice is None
                                      else chat.tool_choice.model_dump(),
                                      tools=chat.tool_schemas)
        outcome = await self.turns.run(session, chat, offload=large, constraints=constraints)
        self._log_split(session, outcome)
        rid = new_response_id()
        session.responses[rid] = ResponseLink(spec.previous_response_id,
                                              [*added, reply_message(outcome.reply)])
        if outcome.turn is not None:
            outcome.turn.request.update(api="responses", response_id=rid,
                                        previous_response_id=spec.previous_response_id)
        final = response_body(
            response_id=rid, model=self.config.model_name, request=spec,
            output=output_items(outcome.reply, outcome.logprobs,
                                outcome.finish_reason == "length"),
            finish_reason=outcome.finish_reason, prompt_tokens=outcome.prompt_tokens,
            completion_tokens=len(outcome.reply.token_ids or ()),
            cached_tokens=outcome.cached_tokens)
        if not spec.stream:
            return _json(final)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            for event in stream_events(final):
                await response.write(b"event: " + event["type"].encode() + b"\ndata: "
                                     + pydantic_core.to_json(event) + b"\n\n")
            await response.write_eof()
        except ConnectionResetError:
            _logger.info("proxy_client_gone", path=request.path, streamed=True)
        return response

    async def _answer(self, request: web.Request, stream: bool, stream_usage: bool,
                      outcome: TurnOutcome) -> web.StreamResponse:
        tokens = len(outcome.reply.token_ids or ())
        usage = usage_body(outcome.prompt_tokens, tokens, outcome.cached_tokens)
        cid = "chatcmpl-" + uuid.uuid4().hex
        model = self.config.model_name
        if not stream:
            return _json(completion_body(completion_id=cid, model=model, message=outcome.reply,
                                         finish_reason=outcome.finish_reason, usage=usage,
                                         logprobs=outcome.logprobs))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            await self._write_stream(response, cid, model, outcome, usage, stream_usage)
        except ConnectionResetError:
            _logger.info("proxy_client_gone", path=request.path, streamed=True)
        return response

    async def _write_stream(self, response: web.StreamResponse, cid: str, model: str,
                            outcome: TurnOutcome, usage: dict[str, Any],
                            stream_usage: bool) -> None:
        for chunk in stream_chunks(completion_id=cid, model=model, message=outcome.reply,
                                   finish_reason=outcome.finish_reason,
                                   usage=usage if stream_usage else None,
                                   logprobs=outcome.logprobs):
            await response.write(b"data: " + pydantic_core.to_json(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def _decode(body: bytes) -> Any:
    try:
        return pydantic_core.from_json(body)
    except ValueError as exc:
        raise ProxyRequestError(f"the body is not valid JSON: {str(exc)[:200]}",
                                code="invalid_json") from None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=pydantic_core.to_json(data), status=status,
                        content_type="application/json")


def _error(exc: ProxyError) -> web.Response:
    response = _json(exc.body(), status=exc.status)
    if exc.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    if exc.final:
        response.headers["x-should-retry"] = "false"
    return response
