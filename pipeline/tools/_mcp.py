"""Tools served over the Model Context Protocol, through the official ``mcp`` SDK.

An :class:`MCPServer` owns one server: a subprocess spoken to over stdio, or a streamable-HTTP
endpoint. ``async with MCPServer(...) as server`` connects (and starts the process), lists the
server's tools, and makes each a tool of the registry (``server.tools``) with the server's own
JSON schema. The connection lives in a task of its own that the server object owns (the SDK's
transports are anyio task groups that must be entered and left in one task); ``aclose`` ends it
and stops the process.

Calls go through ``CallTools`` like any tool: the limiter (the tool's key ``tool:<name>`` and
the server's ``mcp:<server>``), the per-call timeout, fault isolation. A server that dies
mid-call is a tool error the model sees (with the tail of the server's stderr), and the server is
started again in the background (a call that finds it still down waits for that start within
its own timeout). A server that hangs is a timeout error for that call. With
``scope="trajectory"`` every sample gets its own server process, started at the sample's first
call of one of its tools and stopped when the sample ends (on every outcome).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Literal

import structlog

from pipeline._exceptions import ConfigError, PipelineError

_logger = structlog.get_logger("pipeline.tools")


class MCPServerError(PipelineError):
    """An MCP server could not be started, died, or answered with an error."""


@dataclass(frozen=True, kw_only=True)
class MCPTool:
    """One tool of an :class:`MCPServer` (``scope="worker"``), as the tool registry sees
    it: calls share the server's one connection."""

    name: str
    remote_name: str
    description: str
    parameters: Mapping[str, Any]
    server: MCPServer
    timeout_s: float
    rate: float | None = None
    burst: int | None = None
    max_concurrency: int | None = None
    fairness_key: str | None = None
    shared_limits: tuple[tuple[str, float, int | None], ...] = field(default=())

    async def __call__(self, arguments: Mapping[str, Any]) -> Any:
        """Call the tool on the server's shared connection."""
        return await self.server.call(self.remote_name, arguments)


@dataclass(frozen=True, kw_only=True)
class MCPTrajectoryTool(MCPTool):
    """A tool of an :class:`MCPServer` with ``scope="trajectory"``: a
    :class:`~pipeline.tools.TrajectoryTool` whose resource is the sample's own server
    (one per sample for all the server's tools: ``resource_key``)."""

    @property
    def resource_key(self) -> str:
        """Tools of one server share one per-trajectory connection."""
        return f"mcp:{self.server.name}"

    async def __call__(self, arguments: Mapping[str, Any]) -> Any:
        """Refused: the sample's server is started by CallTools."""
        raise RuntimeError(f"tool {self.name!r} has a server per trajectory: it runs "
                           "through CallTools")

    async def create_for(self, item: Any) -> tuple[Any, bool]:
        """Start the sample's own server."""
        connection = _Connection(self.server)
        try:
            await connection.start()
        except BaseException:
            await connection.aclose()
            raise
        return connection, False

    async def call_with(self, resource: Any, arguments: Mapping[str, Any]) -> Any:
        """One call on the sample's own connection."""
        return await resource.call(self.remote_name, arguments, self.timeout_s)

    async def release_resource(self, resource: Any) -> None:
        """Stop the sample's server."""
        await resource.aclose()


class _Connection:
    """One live session with the server, held open by an owned task."""

    def __init__(self, server: MCPServer) -> None:
        self.server = server
        self.session: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._ready: asyncio.Future[None] | None = None
        self._stderr: IO[str] | None = None
        self.dead = False
        self.error_type: type[Exception] = Exception

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._task = loop.create_task(self._hold(), name=f"mcp:{self.server.name}")
        try:
            async with asyncio.timeout(self.server.start_timeout_s):
                await asyncio.shield(self._ready)
        except TimeoutError:
            raise MCPServerError(f"MCP server {self.server.name!r} did not start within "
                                 f"{self.server.start_timeout_s}s{self.stderr_tail()}") from None

    async def _hold(self) -> None:
        assert self._ready is not None
        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self._transport())
                from mcp import ClientSession
                from mcp.shared.exceptions import MCPError

                self.error_type = MCPError  # imported once per connection, not per call
                session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await session.initialize()
                self.session = session
                self._ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:
            self.dead = True
            if not self._ready.done():
                self._ready.set_exception(MCPServerError(
                    f"MCP server {self.server.name!r} failed to start: "
                    f"{type(exc).__name__}: {exc}{self.stderr_tail()}"))
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise
        finally:
            self.dead = True

    def _transport(self) -> Any:
        server = self.server
        if server.url is not None:
            from mcp.client.streamable_http import streamable_http_client

            return streamable_http_client(server.url)
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        assert server.command is not None
        self._stderr = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        params = StdioServerParameters(command=server.command, args=list(server.args),
                                       env=dict(server.env) if server.env else None,
                                       cwd=server.cwd)
        return stdio_client(params, errlog=self._stderr)

    def stderr_tail(self, chars: int = 400) -> str:
        """The end of the server's stderr, for error messages (empty without any)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._stderr.flush()
            self._stderr.seek(0)
            text = self._stderr.read()[-chars:].strip()
            return f"; server stderr: {text}" if text else ""
        return ""

    async def call(self, name: str, arguments: Mapping[str, Any], timeout_s: float) -> Any:
        if self.dead or self.session is None:
            raise MCPServerError(f"MCP server {self.server.name!r} is not running")
        try:
            # The SDK's own timeout a second later: the caller's (CallTools') ends the call
            # first and reports it as a timeout; this one only frees the request.
            result = await self.session.call_tool(name, dict(arguments),
                                                  read_timeout_seconds=timeout_s + 1.0)
        except self.error_type as exc:
            if self._task is None or self._task.done() or "closed" in str(exc).lower():
                self.dead = True
                raise MCPServerError(f"MCP server {self.server.name!r} died during the call "
                                     f"({exc}){self.stderr_tail()}") from None
            raise MCPServerError(f"MCP server {self.server.name!r}: {exc}") from None
        return _read_result(self.server.name, name, result)

    async def aclose(self) -> None:
        self._closing.set()
        task, self._task = self._task, None
        if task is not None and not task.done():
            try:
                async with asyncio.timeout(self.server.stop_timeout_s):
                    await asyncio.shield(task)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._stderr is not None:
            self._stderr.close()


def _read_result(server: str, tool: str, result: Any) -> Any:
    """The text the model sees; an ``isError`` result raises (a tool error for the model)."""
    texts: list[str] = []
    for part in getattr(result, "content", None) or ():
        kind = getattr(part, "type", None)
        if kind == "text":
            texts.append(str(getattr(part, "text", "")))
        else:
            texts.append(f"[{kind or type(part).__name__} content]")
    text = "\n".join(texts)
    is_error = getattr(result, "is_error", getattr(result, "isError", False))
    if is_error:
        raise MCPServerError(f"tool {tool!r} of MCP server {server!r} failed: {text[:500]}")
    structured = getattr(result, "structured_content", getattr(result, "structuredContent", None))
    if not texts and structured is not None:
        return structured
    return text


class MCPServer:
    """A connection to one MCP server; its tools join the registry (see the module doc).

    Give ``command`` (a stdio server started as a subprocess) or ``url`` (streamable HTTP).

    Args:
        name: the server's name (limiter key ``mcp:<name>``, logs, errors).
        command: the executable of a stdio server, e.g. ``sys.executable``.
        args: its arguments.
        env: extra environment variables for the process.
        cwd: its working directory.
        url: a streamable-HTTP endpoint (``http://127.0.0.1:PORT/mcp``).
        scope: ``"worker"``: one server for the whole pipeline, started by ``async with``;
            ``"trajectory"``: one per sample (see the module doc).
        prefix: prepended to the server's tool names in the registry (avoids clashes).
        call_timeout_s: one call's limit.
        rate: the server's shared rate limit (calls per second, all its tools together),
            limiter key ``mcp:<name>``.
        burst: calls allowed at once above ``rate``.
        tool_rate: each tool's own rate limit, limiter key ``tool:<name>``.
        tool_burst: each tool's calls allowed at once above ``tool_rate``.
        max_concurrency: calls running at once per tool.
        fairness_key: what the limits are shared fairly across (as ``FunctionTool``).
        start_timeout_s: connecting (and, for stdio, starting the process) may take this long.
        stop_timeout_s: how long ``aclose`` waits for the transport to wind down.

    Raises:
        ConfigError: a bad argument, naming the field.
    """

    def __init__(self, name: str, *, command: str | None = None, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 url: str | None = None, scope: Literal["worker", "trajectory"] = "worker",
                 prefix: str = "", call_timeout_s: float = 30.0, rate: float | None = None,
                 burst: int | None = None, tool_rate: float | None = None,
                 tool_burst: int | None = None, max_concurrency: int | None = None,
                 fairness_key: str | None = None, start_timeout_s: float = 30.0,
                 stop_timeout_s: float = 5.0) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"MCPServer: name must be a non-empty string, got {name!r}",
                              field="name")
        if (command is None) == (url is None):
            raise ConfigError(f"MCPServer {name!r}: give command (stdio) or url (streamable "
                              "HTTP), exactly one", field="command")
        if scope not in ("worker", "trajectory"):
            raise ConfigError(f"MCPServer {name!r}: scope must be 'worker' or 'trajectory', "
                              f"got {scope!r}", field="scope")
        for key, value in (("call_timeout_s", call_timeout_s), ("start_timeout_s",
                           start_timeout_s), ("stop_timeout_s", stop_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"MCPServer {name!r}: {key} must be a number > 0, got "
                                  f"{value!r}", field=key)
        self.name, self.command, self.args, self.env, self.cwd = name, command, args, env, cwd
        self.url, self.scope, self.prefix = url, scope, prefix
        self.call_timeout_s, self.start_timeout_s = float(call_timeout_s), float(start_timeout_s)
        self.stop_timeout_s = float(stop_timeout_s)
        self.rate, self.burst, self.tool_rate, self.tool_burst = rate, burst, tool_rate, tool_burst
        self.max_concurrency, self.fairness_key = max_concurrency, fairness_key
        self.tools: list[MCPTool] = []
        """The server's tools, once started (pass them to ``Pipeline(tools=...)``)."""
        self.restarts = 0
        self._connection: _Connection | None = None
        self._restarting = asyncio.Lock()
        self._restarter: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect, list the tools; for ``scope="trajectory"`` the listing's connection is
        closed again (each sample starts its own).

        Raises:
            MCPServerError: the server did not start or could not list its tools.
        """
        connection = _Connection(self)
        try:
            await connection.start()
            listed = await connection.session.list_tools()
        except BaseException:
            await connection.aclose()
            raise
        self.tools = [self._tool(t) for t in listed.tools]
        if self.scope == "trajectory":
            await connection.aclose()
        else:
            self._connection = connection

    def _tool(self, remote: Any) -> MCPTool:
        schema = getattr(remote, "input_schema", None) or getattr(remote, "inputSchema", None)
        shared: tuple[tuple[str, float, int | None], ...] = (
            ((f"mcp:{self.name}", self.rate, self.burst),) if self.rate is not None else ())
        kind = MCPTrajectoryTool if self.scope == "trajectory" else MCPTool
        return kind(name=f"{self.prefix}{remote.name}", remote_name=remote.name,
                    description=remote.description or "",
                    parameters=dict(schema or {"type": "object", "properties": {}}),
                    server=self, timeout_s=self.call_timeout_s, rate=self.tool_rate,
                    burst=self.tool_burst, max_concurrency=self.max_concurrency,
                    fairness_key=self.fairness_key, shared_limits=shared)

    async def call(self, name: str, arguments: Mapping[str, Any]) -> Any:
        """Call a tool on the shared connection, starting the server again if it died.

        Raises:
            MCPServerError: the server died during the call, could not be restarted, or the
                tool reported an error.
        """
        connection = self._connection
        if connection is None or connection.dead:
            connection = await self._restart(connection)
        try:
            return await connection.call(name, arguments, self.call_timeout_s)
        finally:
            if connection.dead and self._restarter is None:
                # Start it again now, not in the next sample's call (owned: aclose ends it).
                self._restarter = asyncio.get_running_loop().create_task(
                    self._restart_in_background(connection))

    async def _restart_in_background(self, dead: _Connection) -> None:
        try:
            await self._restart(dead)
        except Exception as exc:  # the next call tries again and reports it to the model
            _logger.warning("mcp_server_restart_failed", server=self.name,
                            error=f"{type(exc).__name__}: {exc}")
        finally:
            self._restarter = None

    async def _restart(self, dead: _Connection | None) -> _Connection:
        async with self._restarting:  # the calls that found it dead restart it once
            if self._connection is not dead and self._connection is not None:
                return self._connection
            if dead is None and not self.tools:
                raise MCPServerError(f"MCP server {self.name!r} is not started: use "
                                     "'async with MCPServer(...)'")
            if dead is not None:
                await dead.aclose()
            _logger.warning("mcp_server_restart", server=self.name)
            connection = _Connection(self)
            try:
                await connection.start()
            except BaseException:
                await connection.aclose()
                raise
            self._connection = connection
            self.restarts += 1
            return connection

    async def aclose(self) -> None:
        """Close the connection and stop the server process."""
        restarter, self._restarter = self._restarter, None
        if restarter is not None:
            restarter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await restarter
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.aclose()

    async def __aenter__(self) -> MCPServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
