"""``ProxyServer``: the proxy's sessions, its engine turns and its aiohttp server, run together.

A server owns a :class:`~pipeline.proxy.SessionStore` (``_sessions``), a turn runner on the
engine (``_turns``) and the application (``_app``, which reads the server through
``_http.ProxyHost``). It binds and serves, sweeps idle sessions away (aborting their engine
requests), and offers the sessions API in-process too (what :class:`~pipeline.proxy.RemoteAgent`
uses). The routes, auth and limits are described in ``_app``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import structlog
from aiohttp import web
from pydantic import ValidationError

from pipeline._concurrency.cancel import abort_request
from pipeline._data.config import SamplingParams, describe_validation_error
from pipeline._exceptions import ConfigError
from pipeline._net import start_site
from pipeline._runner.context import Resources
from pipeline._text.tokenizer import Tokenizer
from pipeline.engines import Engine
from pipeline.multimodal import VisionProcessor
from pipeline.proxy._app import build_app
from pipeline.proxy._config import ProxyConfig
from pipeline.proxy._policy import (
    CALL_FORMATS,
    TOOL_CONSTRAINTS,
    engine_enforces,
    template_hints,
)
from pipeline.proxy._records import SessionRecord, session_record
from pipeline.proxy._sessions import Session, SessionStore
from pipeline.proxy._turns import TurnRunner
from pipeline.tools import HermesToolParser, ToolParser, make_tool_parser

_logger = structlog.get_logger("pipeline.proxy")


class ProxyServer:
    """An OpenAI-compatible proxy that records token-exact sessions (see the module doc).

    Use it as ``async with ProxyServer(engine, tokenizer) as proxy: ...`` or call
    :meth:`start` and :meth:`aclose`.

    Args:
        engine: the engine replies come from.
        tokenizer: the engine's tokenizer (its chat template renders the messages).
        config: a :class:`ProxyConfig` or a dict; keyword ``options`` override its fields.
        parser: finds tool calls in replies (default :class:`HermesToolParser`, or the
            family's).
        eos_token_id: the template's end-of-turn token (default: the tokenizer's eos).
        family: a name of :data:`pipeline.families.FAMILIES`: replies are read with the
            family's tool and reasoning parsers (vLLM's, as :class:`~pipeline.Generate`
            does; reasoning reaches the agent as the message's ``reasoning_content``), and
            every session stops on the family's stop ids (gpt-oss's ``<|call|>``, Llama
            3.1's ``<|eom_id|>``), which end a turn as the eos does.
        processor: a vision-language model's processor (a Hugging Face processor or a
            :class:`~pipeline.multimodal.VisionProcessor`; ``tokenizer`` must be its
            tokenizer): image parts of requests are served, for data URLs only (a web URL or
            a file path is refused: the proxy fetches nothing and reads no host file),
            expanded to the model's image tokens as ``BuildPrompt(processor=...)`` does and
            handed to the engine (``generate(..., multi_modal=...)``); records keep each
            image's hash, size and token count. Without one, image parts are refused.

    The engine and tokenizer go through the same check as a ``Pipeline``'s
    (:func:`pipeline._runner.context.check_resources`): a :class:`~pipeline.SimulatedEngine` built
    without ``eos_token_id`` takes the tokenizer's, one with another eos is refused.

    Raises:
        ConfigError: an invalid option, naming the field; an engine or tokenizer a
            ``Pipeline`` would refuse; an unknown family, or its vLLM parsers missing; a
            ``processor`` whose tokenizer is not ``tokenizer``.
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer,
                 config: ProxyConfig | Mapping[str, Any] | None = None, *,
                 parser: ToolParser | None = None, eos_token_id: int | None = None,
                 family: str | None = None, processor: Any = None, **options: Any) -> None:
        Resources(engine=engine, tokenizer=tokenizer)  # the Pipeline's check (eos pairing)
        base = (config.model_dump() if isinstance(config, ProxyConfig)
                else dict(config or {}))
        try:
            self.config = ProxyConfig.model_validate({**base, **options})
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, "proxy")) from None
        cfg = self.config
        self.engine = engine
        stop_token_ids: tuple[int, ...] = ()
        if family is not None:
            from pipeline.families import get_family  # plain records, cheap

            try:
                record = get_family(family)
            except KeyError as exc:
                raise ConfigError(f"proxy: family: {exc.args[0]}", field="family") from None
            stop_token_ids = record.stop_token_ids
            if parser is None:
                parser = make_tool_parser(tokenizer, record.tool_parser or "hermes",
                                          record.reasoning_parser)
        self.sessions = SessionStore(tokenizer, max_sessions=cfg.max_sessions,
                                     idle_timeout_s=cfg.idle_timeout_s, sampling=cfg.sampling,
                                     eos_token_id=eos_token_id, stop_token_ids=stop_token_ids)
        self.processor = _agent_processor(processor, tokenizer)
        """Renders image parts (None: they are refused)."""
        self.turns = TurnRunner(engine, tokenizer, parser or HermesToolParser(),
                                max_tokens=cfg.max_tokens, max_turns=cfg.max_turns,
                                offload_chars=cfg.offload_chars,
                                abort_timeout_s=cfg.abort_timeout_s,
                                check_integrity=cfg.token_integrity_checks,
                                processor=self.processor)
        self.enforces = engine_enforces(engine)
        """Decoding constraints the engine declared it enforces (``_policy``), less the tool
        constraints where the model's call format is not one they are built for."""
        call_format = getattr(self.turns.parser, "tool_parser_name", None) or "hermes"
        if call_format not in CALL_FORMATS:
            self.enforces -= TOOL_CONSTRAINTS
        self.template_hints = template_hints(tokenizer)
        """Chat-template options request hints may set (``reasoning_effort`` where the
        template reads it: ``_policy.read_hints``)."""
        self.app = build_app(self)
        """The aiohttp application (``_app``)."""
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
        self._forget_route(session_id)
        return session_record(session)

    async def delete_session(self, session_id: str) -> None:
        """Forget the session and abort its engine requests; unknown ids are ignored."""
        session = self.sessions.find(session_id)
        if session is None:
            return
        self.sessions.remove(session_id)
        self._forget_route(session_id)
        await self._abort(session)

    async def _abort(self, session: Session) -> None:
        for request_id in list(session.inflight):
            await abort_request(self.engine, request_id, self.config.abort_timeout_s,
                                session=session.id)

    def _forget_route(self, session_id: str) -> None:
        """An ended session's server is forgotten by an engine that routes by session (its
        table stays bounded however many sessions a run makes)."""
        if self.turns.routes_sessions:
            self.engine.forget_session(session_id)  # type: ignore[attr-defined]

    async def _sweep(self) -> None:
        interval = min(max(self.config.idle_timeout_s / 4, 0.01), 30.0)
        while True:
            await asyncio.sleep(interval)
            for session in self.sessions.idle():
                if self.sessions.find(session.id) is not session:
                    continue
                self.sessions.expire(session.id)
                self._forget_route(session.id)
                await self._abort(session)
                _logger.info("session_expired", session=session.id, turns=len(session.turns))


def _agent_processor(processor: Any, tokenizer: Tokenizer) -> VisionProcessor | None:
    """The proxy's vision processor: one that never reads a file (what an agent sends is not
    trusted with the host's files), on the proxy's tokenizer."""
    if processor is None:
        return None
    vision = processor if isinstance(processor, VisionProcessor) else VisionProcessor(processor)
    if vision.tokenizer is not tokenizer:
        raise ConfigError("proxy: processor: its tokenizer must be the proxy's tokenizer "
                          "(ProxyServer(engine, processor.tokenizer, processor=processor))",
                          field="processor")
    if vision.limits.allow_files:
        vision = VisionProcessor(vision.processor, threads=vision.threads,
                                 limits=dataclasses.replace(vision.limits, allow_files=False))
    return vision
