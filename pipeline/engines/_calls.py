"""How an :class:`~pipeline.engines.OpenAIEngine` calls its servers: one JSON call with
bounded, jittered retries that reports what it saw to the servers' health, and a completion
that moves to another healthy server once when its server died under it.

What counts as dead: a refused connection at once; a timeout, or a connection a live server
dropped mid-request, only after ``health_silence_s`` without an answer (slow is not dead, see
:class:`~pipeline.engines.ServerHealth`); a 5xx answer once the server also fails a health
probe (vLLM answers 500 to the requests in flight when its engine core dies, and 503 to
``/health``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import structlog

from pipeline.engines._health import ServerHealth
from pipeline.engines._image_wire import GENERATE_PATH
from pipeline.engines._routing import Route, Server, ServerError

_logger = structlog.get_logger("pipeline.engines._openai")

RETRY_STATUSES = frozenset({500, 502, 503, 504})


class ServerCalls:
    """The calls of one engine to its servers.

    Args:
        servers: the engine's servers.
        health: which are up; told of every answer and failure.
        session: the engine's pooled session (raises once the engine is closed).
        route: the server for a request id and its route (the engine's routing).
        max_retries: retries after the first attempt, on connection errors and 5xx.
        backoff_s: first retry delay; doubled each time up to ``max_backoff_s``, jittered.
        max_backoff_s: the longest retry delay.
    """

    def __init__(self, servers: Sequence[Server], health: ServerHealth,
                 session: Callable[[], aiohttp.ClientSession],
                 route: Callable[[str, Route | None], Server], *, max_retries: int,
                 backoff_s: float, max_backoff_s: float) -> None:
        self.servers = servers
        self.health = health
        self.session = session
        self.route = route
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.retries = 0
        """Attempts repeated after a connection error or a 5xx answer."""
        self.failovers = 0
        """Requests sent to a second server after the first one could not be reached."""

    async def call(self, server: Server, method: str, path: str,
                   body: Mapping[str, Any] | None, *, retry: bool = True,
                   failover: bool = False) -> dict[str, Any]:
        """One JSON call with bounded retries on connection errors and 5xx answers (what
        marks the server down: see the module doc). With ``failover`` the error of a server
        that is down is raised at once while another server is healthy (the caller goes
        there instead).
        """
        session = self.session()
        attempts = self.max_retries + 1 if retry else 1
        for attempt in range(attempts):
            dropped = False  # a live server dropped this connection: retry it there
            try:
                async with session.request(method, server.url + path, json=body) as resp:
                    self.health.answered(server.url)
                    if resp.status < 400:
                        if resp.content_type != "application/json":
                            return {}
                        answer: dict[str, Any] = await resp.json()
                        return answer
                    text = (await resp.text())[:500]
                    error = ServerError(f"{method} {server.url}{path} answered {resp.status}: "
                                        f"{text}", status=resp.status, url=server.url)
                    if resp.status not in RETRY_STATUSES:
                        raise error
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                    TimeoutError) as exc:
                error = ServerError(f"{method} {server.url}{path} failed: "
                                    f"{type(exc).__name__}: {exc}", status=None, url=server.url)
                if isinstance(exc, aiohttp.ClientConnectorError):  # nobody listens there
                    self.health.mark_down(server.url, str(error))
                else:  # slow or dropped is not dead while it answers: see ServerHealth
                    down = self.health.timed_out(server.url, str(error))
                    dropped = not down and not isinstance(exc, TimeoutError)
            server.failures += 1
            if failover and not dropped \
                    and (error.status is None or not await self.health.probe(server.url)) \
                    and any(self.health.is_healthy(s.url) for s in self.servers):
                raise error
            if attempt + 1 < attempts:
                self.retries += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** attempt)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
        raise error

    async def complete(self, request_id: str, path: str, body: Mapping[str, Any],
                       route: Route | None) -> dict[str, Any]:
        """The answer to ``body`` at ``path`` from the routed server; when that server went
        down under the request, once more from another healthy server with the same body.

        Raises:
            ServerError: as :meth:`call`; for the image endpoint, a 403/404/405 says how to
                get it (vLLM's scale-out endpoints).
        """
        try:
            return await self._failover(request_id, path, body, route)
        except ServerError as exc:
            if path == GENERATE_PATH and exc.status in (403, 404, 405):
                raise ServerError(
                    f"{exc} (images go to vLLM's token-in endpoint {GENERATE_PATH}, with "
                    f"the prompt's token ids unchanged: start vLLM 0.32 or later with "
                    f"--enable-scale-out, or use the in-process VLLMEngine)",
                    status=exc.status, url=exc.url) from exc
            raise

    async def _failover(self, request_id: str, path: str, body: Mapping[str, Any],
                        route: Route | None) -> dict[str, Any]:
        server = self.route(request_id, route)
        first: ServerError | None = None
        while True:
            server.in_flight += 1
            server.requests += 1
            try:
                return await self.call(server, "POST", path, body, failover=first is None)
            except ServerError as exc:
                error = exc
            finally:
                server.in_flight -= 1
            if first is not None:
                raise ServerError(f"{error} (retried there after {first})",
                                  status=error.status, url=error.url) from error
            try:
                nxt = self.route(request_id, route)
            except ServerError:  # none left to go to
                nxt = server
            if self.health.is_healthy(server.url) or not self.health.is_healthy(nxt.url) \
                    or nxt is server:
                if len(self.servers) > 1 and not self.health.is_healthy(server.url):
                    raise ServerError(f"{error} (no other healthy server to retry on)",
                                      status=error.status, url=error.url) from error
                raise error
            first = error
            self.failovers += 1
            _logger.warning("request moved to another server", request_id=request_id,
                            dead=server.url, to=nxt.url)
            server = nxt
