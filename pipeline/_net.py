"""Binding server sockets without flaky "address already in use" failures.

A port just released by a previous run (or a test) can stay busy for a moment; a fixed port
is retried a few times on ``EADDRINUSE`` before giving up with an error that names it. Port
0 lets the OS pick a free port, which is what tests and the proxy's per-run servers use.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import time
from typing import TYPE_CHECKING

import structlog

from pipeline._exceptions import AddressInUseError

if TYPE_CHECKING:
    from aiohttp import web

_logger = structlog.get_logger("pipeline.diagnostics")


def bind_socket(host: str = "127.0.0.1", port: int = 0, *, attempts: int = 20,
                retry_delay_s: float = 0.25, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``(host, port)``; ``port=0`` lets the OS choose.

    Retries a busy port ``attempts`` times, ``retry_delay_s`` apart (blocking; from async
    code use :func:`bind_socket_async`). Read the chosen port with ``sock.getsockname()[1]``.

    Raises:
        AddressInUseError: the port stayed busy.
        OSError: any other bind failure (a bad host, no permission for a low port).
    """
    for attempt in range(1, attempts + 1):
        try:
            return _bind_once(host, port, backlog)
        except OSError as exc:
            _check_retry(exc, host, port, attempt, attempts, retry_delay_s)
            time.sleep(retry_delay_s)
    raise AssertionError("unreachable")  # pragma: no cover


async def bind_socket_async(host: str = "127.0.0.1", port: int = 0, *, attempts: int = 20,
                            retry_delay_s: float = 0.25, backlog: int = 128) -> socket.socket:
    """:func:`bind_socket` that waits between attempts without blocking the event loop.

    Raises:
        AddressInUseError: the port stayed busy.
        OSError: any other bind failure.
    """
    for attempt in range(1, attempts + 1):
        try:
            return _bind_once(host, port, backlog)
        except OSError as exc:
            _check_retry(exc, host, port, attempt, attempts, retry_delay_s)
            await asyncio.sleep(retry_delay_s)
    raise AssertionError("unreachable")  # pragma: no cover


async def start_site(runner: web.AppRunner, host: str = "127.0.0.1", port: int = 0, *,
                     attempts: int = 20, retry_delay_s: float = 0.25) -> tuple[web.SockSite, int]:
    """Start an aiohttp site for ``runner`` (already ``setup()``) on a retried bind.

    Returns:
        ``(site, port)``: the started site and the port it listens on.

    Raises:
        AddressInUseError: the port stayed busy.
    """
    from aiohttp import web

    sock = await bind_socket_async(host, port, attempts=attempts, retry_delay_s=retry_delay_s)
    site = web.SockSite(runner, sock)
    try:
        await site.start()
    except BaseException:
        sock.close()
        raise
    return site, sock.getsockname()[1]


def _check_retry(exc: OSError, host: str, port: int, attempt: int, attempts: int,
                 delay: float) -> None:
    """Return to retry a busy fixed port; raise for anything else or the last attempt."""
    if exc.errno != errno.EADDRINUSE or port == 0:
        raise exc
    if attempt >= attempts:
        raise AddressInUseError(f"{host}:{port} is still in use after {attempts} attempts "
                                f"{delay}s apart; pick another port or port 0") from exc
    _logger.info("bind_retry", host=host, port=port, attempt=attempt)


def _bind_once(host: str, port: int, backlog: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
