"""What OpenAI-compatible vLLM servers say about their load and health: their Prometheus
``/metrics`` read into one :class:`~pipeline.engines.EngineLoad` for flow control, and
:class:`ServerHealth`, which servers are up (probed on ``/health``) for routing.

vLLM's metric names (V1 engine, vllm 0.24 to 0.32): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a 0..1 fraction despite the
name) and the counter ``vllm:num_preemptions`` (exposed as ``..._total``). The text format is
parsed by ``prometheus_client`` (a dependency of vLLM itself), not by hand. Several servers
add up: running, waiting and preemptions are summed, KV use is the fullest server's (the
one that preempts first).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog

from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._base import EngineLoad

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"

_logger = structlog.get_logger("pipeline.engines._health")


def parse_metrics(text: str) -> dict[str, float]:
    """The vLLM load figures in one ``/metrics`` page, summed over label sets (one per model
    or engine); names missing from the page are missing from the result."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {RUNNING, WAITING, KV_USAGE, PREEMPTIONS}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if sample.name in (family.name, family.name + "_total"):
                out[family.name] = out.get(family.name, 0.0) + float(sample.value)
    return out


async def scrape_load(session: aiohttp.ClientSession, urls: Sequence[str], *,
                      timeout_s: float = 2.0) -> EngineLoad | None:
    """The servers' load read from their ``/metrics`` (concurrently, each within
    ``timeout_s``); None when no server answered with vLLM's figures.

    Raises:
        EngineError: never for a server that fails to answer (it is left out); only
            when ``urls`` is empty.
    """
    if not urls:
        raise EngineError("scrape_load needs at least one server URL")

    async def one(url: str) -> dict[str, float] | None:
        try:
            async with asyncio.timeout(timeout_s), session.get(url + "/metrics") as resp:
                if resp.status != 200:
                    return None
                return parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    pages = [page for page in await asyncio.gather(*(one(url) for url in urls))
             if page and (RUNNING in page or KV_USAGE in page)]
    if not pages:
        return None
    kv = [page[KV_USAGE] for page in pages if KV_USAGE in page]
    preemptions = [page[PREEMPTIONS] for page in pages if PREEMPTIONS in page]
    return EngineLoad(
        running=int(sum(page.get(RUNNING, 0.0) for page in pages)),
        waiting=int(sum(page.get(WAITING, 0.0) for page in pages)),
        kv_usage=max(kv) if kv else None,
        preemptions=int(sum(preemptions)) if preemptions else None)


@dataclass
class _ServerState:
    healthy: bool = True
    error: str | None = None
    down_since: float | None = None
    downs: int = 0
    held: bool = False
    last_answer: float = field(default_factory=time.monotonic)
    """When the server last answered anything (a probe, a request); monotonic clock."""
    late_probes: int = 0
    """Probes timed out in a row while the server was not silent."""


class ServerHealth:
    """Which servers of an :class:`~pipeline.engines.OpenAIEngine` are up: the one owner of
    that fact, asked by routing (``is_healthy``) and kept current by a watch task.

    The watch probes every server's ``GET /health`` every ``interval_s`` with a limit of
    ``timeout_s``. vLLM answers it 200 while its engine core is alive and 503 once the core
    died (``EngineDeadError``), without scheduling anything: a probe costs the server no
    generation slot, unlike a one-token completion, which would also queue behind a full
    batch and read a loaded server as dead. A hung-but-alive core is left to the request
    timeouts. A server is marked down by a failed probe (an error status other than 404 or
    405, which a live server without the endpoint answers; a connection error) or by the
    engine when a real request hit a connection error there, or a 5xx answer followed by a
    failed probe; it is re-admitted when a probe answers again and ``readmit`` lets it in.
    Servers start healthy: the first request does not wait for a probe.

    A *timeout* (of a probe or a request) is not death: a server streaming thousands of
    requests can answer ``/health`` late (seen on an H200 at 4,096 requests in flight: the
    server was marked down for 6-12 s each time, and the batch lost that time). A timeout
    marks the server down only once it has been silent, answering neither a probe nor a
    request (the engine reports its answers: :meth:`answered`), for ``silence_s`` (slime's
    default: 30 s without an answer).

    The probes use a small connection pool of their own, so a request pool saturated by a
    large batch cannot delay them into a false "down".

    Args:
        urls: the servers' base URLs.
        interval_s: seconds between rounds of probes.
        timeout_s: limit of one probe.
        silence_s: seconds without any answer after which a timeout marks a server down.
        path: the probe's path.
        readmit: asked before a down server that answers is routed to again; returns why
            it must stay out (its weights are not the current ones), or None.
    """

    def __init__(self, urls: Sequence[str], *, interval_s: float = 5.0,
                 timeout_s: float = 2.0, silence_s: float = 30.0, path: str = "/health",
                 readmit: Callable[[str], Awaitable[str | None]] | None = None) -> None:
        if interval_s <= 0:
            raise ConfigError(f"health_interval_s must be > 0, got {interval_s!r}",
                              field="health_interval_s")
        if timeout_s <= 0:
            raise ConfigError(f"health_timeout_s must be > 0, got {timeout_s!r}",
                              field="health_timeout_s")
        if silence_s < 0:
            raise ConfigError(f"health_silence_s must be >= 0, got {silence_s!r}",
                              field="health_silence_s")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.silence_s = silence_s
        self.path = path
        self.readmit = readmit
        self.probes = 0
        """Probes sent so far."""
        self._states = {url: _ServerState() for url in urls}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def is_healthy(self, url: str) -> bool:
        """Whether ``url`` (a base URL as the engine holds it) is up; unknown URLs are not."""
        state = self._states.get(url)
        return state is not None and state.healthy

    def held_out(self, url: str) -> bool:
        """Whether ``url`` answers but ``readmit`` kept it out (its weights are stale): not
        to be used even when no server is healthy."""
        state = self._states.get(url)
        return state is not None and state.held

    def healthy(self) -> list[str]:
        """The URLs that are up, in the engine's order."""
        return [url for url, state in self._states.items() if state.healthy]

    def answered(self, url: str) -> None:
        """Record that ``url`` answered a request (evidence that it is alive, however slow
        its probes are)."""
        state = self._states.get(url)
        if state is not None:
            state.last_answer = time.monotonic()
            state.late_probes = 0

    def timed_out(self, url: str, reason: str) -> bool:
        """A probe or a request to ``url`` timed out (or lost its connection): mark it down
        if it has been silent for ``silence_s``, else count the late probe. True when it is
        (now) down."""
        state = self._states[url]
        if time.monotonic() - state.last_answer >= self.silence_s:
            self.mark_down(url, f"{reason} (no answer for {self.silence_s:g} s)")
        else:
            state.late_probes += 1
            if state.late_probes == 1:
                _logger.info("engine server slow to answer, kept", url=url, reason=reason)
        return not state.healthy

    def mark_down(self, url: str, reason: str) -> None:
        """Take ``url`` out of routing until a probe answers again."""
        state = self._states[url]
        state.error = reason
        if state.healthy:
            state.healthy = False
            state.down_since = time.time()
            state.downs += 1
            _logger.warning("engine server down", url=url, reason=reason)

    def mark_up(self, url: str) -> None:
        """Route to ``url`` again."""
        state = self._states[url]
        if not state.healthy:
            _logger.info("engine server back", url=url,
                         down_s=round(time.time() - (state.down_since or time.time()), 3))
            state.healthy = True
            state.down_since = None
        state.held = False

    def state(self) -> dict[str, dict[str, Any]]:
        """Per URL: ``healthy``, the last ``error``, ``down_since`` (wall clock), ``downs``
        (times it went down), ``held_out`` and ``late_probes`` (timed out in a row while the
        server still answered requests); a plain dict for logs, dumps and metrics."""
        return {url: {"healthy": s.healthy, "error": s.error, "down_since": s.down_since,
                      "downs": s.downs, "held_out": s.held, "late_probes": s.late_probes}
                for url, s in self._states.items()}

    async def probe(self, url: str) -> bool:
        """Probe ``url`` once and record the outcome; True when it is up. After
        :meth:`aclose` (a request still in flight may ask) the probe opens and closes a
        session of its own, so nothing is left open."""
        if self._closed:
            async with aiohttp.ClientSession() as session:
                return await self._probe(session, url)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=max(4, len(self._states))))
        return await self._probe(self._session, url)

    async def _probe(self, session: aiohttp.ClientSession, url: str) -> bool:
        self.probes += 1
        try:
            async with asyncio.timeout(self.timeout_s), \
                    session.get(url + self.path) as resp:
                # 404/405: a server with no health endpoint answered, so it is alive.
                alive = resp.status in (200, 404, 405)
                reason = f"GET {url}{self.path} answered {resp.status}"
        except TimeoutError:
            return not self.timed_out(url, f"GET {url}{self.path} took over "
                                           f"{self.timeout_s:g} s")
        except aiohttp.ClientError as exc:
            alive, reason = False, f"GET {url}{self.path} failed: {type(exc).__name__}: {exc}"
        if alive and not self.is_healthy(url) and self.readmit is not None:
            refused = await self.readmit(url)  # outside the probe's limit: it may reload
            alive, reason = refused is None, refused or reason
            self._states[url].held = refused is not None
        if alive:
            self.answered(url)
            self.mark_up(url)
        else:
            self.mark_down(url, reason)
        return alive

    def start(self) -> None:
        """Start the watch (idempotent; needs a running event loop). :meth:`aclose` ends it."""
        self._closed = False
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._watch(), name="pipeline-engine-health")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            # Each probe is bounded by timeout_s and records its own outcome; none raises.
            await asyncio.gather(*(self.probe(url) for url in self._states))

    async def aclose(self) -> None:
        """Stop the watch and close the probes' session (idempotent); the cleanup runs to
        its end even when the caller is cancelled meanwhile."""
        self._closed = True
        task, self._task = self._task, None
        session, self._session = self._session, None
        await asyncio.shield(_stop(task, session))


async def _stop(task: asyncio.Task[None] | None,
                session: aiohttp.ClientSession | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if session is not None:
        await session.close()
