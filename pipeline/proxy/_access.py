"""Who may call which proxy route, and what they get: one table, read by the server's auth.

A caller is told by the bearer token it sends:

- ``admin``: the server's ``ProxyConfig.api_key`` (the trainer), when one is configured;
- ``own``: the key of the session the route is for (``{sid}`` on session routes; on the
  top-level OpenAI routes, whichever live session the key opens: the agent);
- ``anyone``: no token, a wrong one, or another session's key on a session route.

Each route grants each caller :data:`FULL` (served; records with their token payloads),
:data:`AGENT` (served; records without any token payload: an agent's own view) or
:data:`DENIED` (401). Without a server ``api_key`` there is no admin: routes marked ``open``
(they hold no session's data) are served to anyone, the others keep their rule. A named
route with no rule here is refused, and a test checks every route has one.

=================  ==========  ============  ======  ===========================================
route              admin       own key       open    what it does
=================  ==========  ============  ======  ===========================================
health             full        denied        yes     server status
models             full        full          yes     the served model
chat, responses,   denied      full          no      a turn in the key's session
messages
create(_named)     full        denied        yes     a new session (returns its key)
session_get        full        agent         no      the record
session_complete   full        agent         no      end the session; returns the record
session_delete     full        full          no      forget it, abort its requests
session_models     full        full          no      the served model
session_chat       full        full          no      a turn in ``{sid}``
session_responses  full        full          no      a Responses turn in ``{sid}``
session_messages   full        full          no      a Messages API turn in ``{sid}``
=================  ==========  ============  ======  ===========================================

An agent may end or delete its own session (a ``RemoteAgent`` fills the sample from the session
it holds in-process either way) but never read the token payloads the trainer gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Grant = Literal["full", "agent", "denied"]
FULL: Grant = "full"
"""Served; a record comes with its token payloads."""
AGENT: Grant = "agent"
"""Served; a record comes without any token payload (``_records.AGENT_VIEW``)."""
DENIED: Grant = "denied"
"""Refused with 401."""


@dataclass(frozen=True, slots=True)
class Access:
    """One route's rule: what the server's key and the session's own key get, and whether
    the route is served to anyone when the server has no ``api_key``."""

    admin: Grant
    own: Grant
    open: bool = False

    def grant(self, caller: Literal["admin", "own", "anyone"], server_key: bool) -> Grant:
        """What ``caller`` gets (``server_key``: the server has an ``api_key``)."""
        if caller == "admin":
            return self.admin
        if caller == "own":
            return self.own if server_key or not self.open else FULL
        return FULL if self.open and not server_key else DENIED

    def needs(self) -> str:
        """Who may call the route, for the 401 message."""
        if self.admin == DENIED:
            return "a session key"
        if self.own == DENIED:
            return "the server's key"
        return "the session's key or the server's key"


ROUTE_ACCESS: dict[str, Access] = {
    "health": Access(admin=FULL, own=DENIED, open=True),
    "models": Access(admin=FULL, own=FULL, open=True),
    "chat": Access(admin=DENIED, own=FULL),
    "responses": Access(admin=DENIED, own=FULL),
    "messages": Access(admin=DENIED, own=FULL),
    "create": Access(admin=FULL, own=DENIED, open=True),
    "create_named": Access(admin=FULL, own=DENIED, open=True),
    "session_get": Access(admin=FULL, own=AGENT),
    "session_complete": Access(admin=FULL, own=AGENT),
    "session_delete": Access(admin=FULL, own=FULL),
    "session_models": Access(admin=FULL, own=FULL),
    "session_chat": Access(admin=FULL, own=FULL),
    "session_responses": Access(admin=FULL, own=FULL),
    "session_messages": Access(admin=FULL, own=FULL),
}
"""Route name (as the server names its routes) -> its :class:`Access` (see the module doc)."""

SESSION_ROUTES = frozenset(name for name in ROUTE_ACCESS if name.startswith("session_"))
"""Routes with a ``{sid}``: ``own`` is that session's key."""

ANTHROPIC_ROUTES = frozenset({"messages", "session_messages"})
"""Routes that answer errors in Anthropic's shape (``_messages_reply.error_body``)."""
