"""Which server of an :class:`~pipeline.engines.OpenAIEngine` a request goes to.

A request may carry a :class:`Route`: its *session* (the requests of one conversation: a
pipeline sample's turns, a proxy session's requests) and its *group* (the sessions that share
a prompt prefix: the n rollouts of one prompt). The :class:`Router` keeps two bounded tables,
session -> server and group -> server, so that a session's turns hit one server's prefix cache
and a group's sessions find their shared prompt cached where the first one put it:

- a live session goes to its server while :class:`~pipeline.engines.ServerHealth` (the one
  owner of health) says it is up; when it is down the session moves, and stays on the new
  server after the old one comes back;
- a new session goes to its group's server, unless that server is overloaded: more than
  ``overload_factor`` x the requests in flight of the least busy healthy server, plus
  ``overload_slack`` (the load is this engine's requests in flight). Then it goes to the least
  busy server and the group's later sessions follow it there: load moves a group, never a live
  session. The bound compares with the least busy server, not with the mean, because with two
  servers one of them can never hold more than twice the mean;
- a new group, and a request without a route, go to the least busy healthy server (fewest
  requests in flight, then fewest failures, then fewest requests so far).

Sessions end (:meth:`Router.forget`, which the proxy calls when a session is completed,
deleted or expires); both tables are also bounded (least recently used entries dropped), so
routes that are never forgotten (the pipeline's own samples) cannot grow them without end.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._health import ServerHealth


@dataclass(frozen=True, slots=True)
class Route:
    """The routing key of a request: its session and its group.

    Engines that honour it declare ``routes_sessions = True`` and take it as
    ``generate(..., route=Route(...))``; the proxy passes one per request (its session id,
    and the session's ``metadata["group_id"]``, or the session id when there is none).

    Attributes:
        session: requests of one conversation (kept on one server).
        group: sessions sharing a prompt prefix (placed together).
    """

    session: str
    group: str


def pipeline_group_key(request_id: str) -> str:
    """The group of a pipeline request id ``{group_id}-{k}-{turn}`` (the id itself if it
    has another shape)."""
    parts = request_id.rsplit("-", 2)
    return parts[0] if len(parts) == 3 else request_id


def pipeline_route(request_id: str) -> Route | None:
    """The route of a pipeline request id ``{group_id}-{k}-{turn}``: session
    ``{group_id}-{k}``, group ``{group_id}``; None (no route) for ids of another shape."""
    parts = request_id.rsplit("-", 2)
    if len(parts) != 3:
        return None
    return Route(session=f"{parts[0]}-{parts[1]}", group=parts[0])


class ServerError(EngineError):
    """A server answered with an error status, or could not be reached after retries.

    Attributes:
        status: the HTTP status, or None when no answer came.
        url: the server's base URL.
    """

    def __init__(self, message: str, *, status: int | None, url: str) -> None:
        super().__init__(message)
        self.status = status
        self.url = url


@dataclass(eq=False)
class Server:
    """One server as the engine counts it."""

    url: str
    in_flight: int = 0
    requests: int = 0
    failures: int = 0


class Router:
    """The affinity tables and the choice of a server (see the module doc).

    Args:
        servers: the engine's servers.
        health: who says which server is up.
        capacity: most entries of each table (least recently used dropped first).
        affinity: False routes every request to the least busy server (no tables).
        overload_factor: see the module doc (>= 1).
        overload_slack: see the module doc (>= 0).

    Raises:
        ConfigError: a bound out of range, naming the field.
    """

    def __init__(self, servers: list[Server], health: ServerHealth, *, capacity: int = 65536,
                 affinity: bool = True, overload_factor: float = 2.0,
                 overload_slack: int = 8) -> None:
        if capacity < 1:
            raise ConfigError(f"sticky_capacity must be >= 1, got {capacity!r}",
                              field="sticky_capacity")
        if not overload_factor >= 1.0:
            raise ConfigError(f"overload_factor must be >= 1, got {overload_factor!r}",
                              field="overload_factor")
        if overload_slack < 0:
            raise ConfigError(f"overload_slack must be >= 0, got {overload_slack!r}",
                              field="overload_slack")
        self.servers = servers
        self.health = health
        self.capacity = capacity
        self.affinity = affinity
        self.overload_factor = overload_factor
        self.overload_slack = overload_slack
        self.sessions: collections.OrderedDict[str, Server] = collections.OrderedDict()
        """Live session -> its server (most recently used last)."""
        self.groups: collections.OrderedDict[str, Server] = collections.OrderedDict()
        """Group -> the server its new sessions go to (most recently used last)."""
        self.moved = 0
        """Sessions moved off a server that went down."""
        self.spilled = 0
        """New sessions placed away from their group's overloaded server."""

    def pick(self, route: Route | None) -> Server:
        """The server for a request with ``route`` (see the module doc); the tables are
        updated to remember it.

        Raises:
            ServerError: every server is down and held out for stale weights.
        """
        if route is None or not self.affinity:
            return self._least_busy()
        server = self.sessions.get(route.session)
        if server is not None and self.health.is_healthy(server.url):
            self.sessions.move_to_end(route.session)
            self._remember(self.groups, route.group, self.groups.get(route.group, server))
            return server
        moving = server is not None
        server = self.groups.get(route.group)
        if server is None or not self.health.is_healthy(server.url):
            server = self._least_busy()
        else:
            least = self._least_busy()
            if server.in_flight > self.overload_factor * least.in_flight + self.overload_slack:
                server = least
                self.spilled += 1
        self.moved += moving
        self._remember(self.sessions, route.session, server)
        self._remember(self.groups, route.group, server)
        return server

    def forget(self, session: str) -> None:
        """Drop a session that ended (its group stays, for the group's later sessions);
        unknown sessions are ignored."""
        self.sessions.pop(session, None)

    def _remember(self, table: collections.OrderedDict[str, Server], key: str,
                  server: Server) -> None:
        table[key] = server
        table.move_to_end(key)
        if len(table) > self.capacity:
            table.popitem(last=False)

    def _least_busy(self) -> Server:
        """The least busy healthy server. When none is healthy, the least busy of those not
        held out for stale weights: the request then tries it, with its retries, rather than
        fail unsent."""
        healthy = [s for s in self.servers if self.health.is_healthy(s.url)] or [
            s for s in self.servers if not self.health.held_out(s.url)]
        if not healthy:
            states = self.health.state()
            raise ServerError("every server is down or back with stale weights: " + "; ".join(
                f"{url}: {state['error']}" for url, state in states.items()),
                status=None, url=self.servers[0].url)
        return min(healthy, key=lambda s: (s.in_flight, s.failures, s.requests))
