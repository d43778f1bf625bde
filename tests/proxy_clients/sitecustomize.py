"""Network audit for agent programs run by the proxy tests (loaded through PYTHONPATH).

Every ``socket.connect`` and name lookup of the process is appended to the file named by
``PROXY_NET_LOG`` (one JSON line each); a connection to anything but the loopback range is
refused before it is made (the audit hook raises), so a client that tries to reach the
internet fails loudly instead of leaking. Unix sockets are recorded and allowed.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from typing import Any

_LOG = os.environ.get("PROXY_NET_LOG")


def _loopback(host: Any) -> bool:
    if host in ("localhost", "", None):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def _record(kind: str, target: Any, allowed: bool) -> None:
    if _LOG is None:
        return
    host = target[0] if isinstance(target, tuple) else target
    with open(_LOG, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"pid": os.getpid(), "event": kind, "target": repr(target),
                             "host": host if isinstance(host, str) else repr(host),
                             "allowed": allowed}) + "\n")


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple):
            allowed = _loopback(address[0])
            _record("connect", address[:2], allowed)
            if not allowed:
                raise PermissionError(f"network audit: connect to {address[:2]} refused "
                                      "(only 127.0.0.1 is allowed in these tests)")
        else:
            _record("connect", address, True)
    elif event == "socket.getaddrinfo":
        host = args[0]
        allowed = _loopback(host.decode() if isinstance(host, bytes) else host)
        _record("getaddrinfo", host, allowed)
        if not allowed:
            raise PermissionError(f"network audit: lookup of {host!r} refused")


if _LOG is not None:
    sys.addaudithook(_hook)
