"""Ports for the servers tests start on 127.0.0.1 and bind later (a subprocess, a server
stopped and started again on the same port).

A port taken from the kernel (``bind(("127.0.0.1", 0))``) and released is in its ephemeral
range, which it hands out again to every client socket and port-0 server of the tests running
beside: a vLLM server binds 30-60 s after its start, and in that window another test could
get the same port, so that the first test then talked to the other's server (seen as two
tests failing at once). These ports are drawn outside that range instead.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FALLBACK_EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range


def _ephemeral() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _FALLBACK_EPHEMERAL


def free_port() -> int:
    """A port free now on 127.0.0.1, below the kernel's ephemeral range (at random, so that
    tests in parallel rarely draw the same one)."""
    low = 20000
    high = min(_ephemeral()[0], 32768)
    draw = random.SystemRandom()
    for _ in range(500):
        port = draw.randrange(low, high)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) on 127.0.0.1")
