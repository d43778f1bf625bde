"""vLLM's dev-mode control endpoints on every server of an
:class:`~pipeline.engines.OpenAIEngine`: pause, resume, weight reload, prefix-cache reset, and
bringing a server that comes back from a restart to the engine's weights before it is routed
to again.

Those endpoints exist on a vLLM server started with ``VLLM_SERVER_DEV_MODE=1``; on another
server a call answers 404, turned into a clear :class:`~pipeline.EngineError`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import structlog

from pipeline._exceptions import EngineError
from pipeline.engines._health import ServerHealth
from pipeline.engines._routing import Server, ServerError

_logger = structlog.get_logger("pipeline.engines._openai")


class Call(Protocol):
    """The engine's one JSON call to a server (``OpenAIEngine._call``)."""

    def __call__(self, server: Server, method: str, path: str,
                 body: Mapping[str, Any] | None, *, retry: bool = ...
                 ) -> Awaitable[dict[str, Any]]: ...


class ServerControl:
    """The control calls of one engine's servers.

    Args:
        servers: the engine's servers.
        health: which are up (a down one is skipped, and brought up to date by
            :meth:`readmit` when it answers again).
        call: the engine's JSON call.
        version: the engine's policy version now.
    """

    def __init__(self, servers: Sequence[Server], health: ServerHealth, call: Call,
                 version: Callable[[], int | None]) -> None:
        self.servers = servers
        self.health = health
        self.call = call
        self.version = version
        self.weights_path: str | None = None
        """The checkpoint of the last weight update through the engine."""

    async def everywhere(self, path: str, body: Mapping[str, Any] | None = None) -> list[Any]:
        """``POST path`` on every server that is up; their answers.

        Raises:
            EngineError: a server without the endpoint (not in dev mode), or failing.
        """
        answers = []
        for server in self.servers:
            if not self.health.is_healthy(server.url):
                continue
            try:
                answers.append(await self.call(server, "POST", path, body, retry=False))
            except ServerError as exc:
                if exc.status == 404:
                    raise EngineError(f"{server.url} has no {path.split('?')[0]} endpoint: "
                                      f"start vLLM with VLLM_SERVER_DEV_MODE=1 (or pass "
                                      f"server_control=False)") from exc
                raise
        return answers

    async def readmit(self, url: str) -> str | None:
        """Why a server that answers again must stay out, or None. After a weight update
        through the engine, a server back from a restart holds the weights it was started
        with: it gets the last checkpoint again (as ``update_weights`` sends it) and is
        routed to only when its ``/weight_info`` reads the engine's policy version."""
        if self.weights_path is None:
            return None
        server = next(s for s in self.servers if s.url == url)
        want = str(self.version())
        try:
            got = (await self.call(server, "GET", "/weight_info", None,
                                   retry=False)).get("weight_version")
            reload = str(got) != want
            if reload:
                for path, body in (
                        ("/collective_rpc", {"method": "reload_weights",
                                             "kwargs": {"weights_path": self.weights_path}}),
                        ("/reset_prefix_cache", None),
                        ("/update_weight_version", {"new_version": want})):
                    await self.call(server, "POST", path, body, retry=False)
                got = (await self.call(server, "GET", "/weight_info", None,
                                       retry=False)).get("weight_version")
        except EngineError as exc:
            return f"{url} is back but its weights could not be brought to version {want}: {exc}"
        if str(got) != str(self.version()):  # an update may have run meanwhile
            return f"{url} is back with weights version {got}, the engine is at {self.version()}"
        if reload:
            _logger.info("engine server weights reloaded", url=url, version=want)
        return None
