"""A simulated engine: no model, seeded latency and fault model, for benchmarks and chaos tests.

It is named as simulated everywhere it is used: figures measured on it show the pipeline's own
cost, never a model's. Two timing models: a per-request latency (the default), or a decoder
with a capacity and a KV budget (``max_running=``, :mod:`pipeline.engines._capacity`) for
benchmarks where engine load matters (flow control, asynchronous RL).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import math
import random
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline._data.config import SamplingParams
from pipeline._data.models import FinishReason
from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._base import RECENT_ABORTS, EngineLoad, Generation
from pipeline.engines._capacity import DecodeRequest, DecodeScheduler
from pipeline.engines._weight_sync import PauseMode, check_pause_mode, next_version

_UPDATES_KEPT = 64
"""Weight updates remembered for the latency model's per-token versions (newest last)."""

Responder = Callable[[list[int], random.Random], list[int]]
"""Makes the simulated reply: ``(prompt_ids, rng) -> token_ids`` (end with the eos id to stop)."""


class SimulatedEngine:
    """Simulated inference engine with a heavy-tailed latency model and fault injection.

    Every decision (latency, length, tokens, faults) is drawn from a RNG seeded by ``seed``,
    ``sampling.seed`` and the prompt length (or the request id for unseeded requests), so a
    seeded batch replays identically.

    Timing: by default each request takes its own latency (``latency_s`` and the tail model),
    however many run. With ``max_running`` the engine is a batched decoder instead: at most
    that many sequences sample one token per ``token_time_s`` each, the rest wait, and with
    ``kv_capacity_tokens`` the youngest running sequence is preempted when their KV outgrows
    the budget (:mod:`pipeline.engines._capacity`); the reply's length sets its duration, and
    :meth:`load` reports running, waiting, KV use and preemptions as vLLM's scheduler would.

    Weight sync (:class:`~pipeline.engines.WeightSync`): there are no weights, so
    ``update_weights`` accepts any source (or none) and bumps ``policy_version``; every
    generation reports the version of each token in ``token_versions`` (None when one version
    sampled them all: ``policy_version``). A ``"keep"`` pause
    freezes the decoder (capacity mode) or holds replies until ``resume`` (latency mode, where
    a request's tokens are taken as sampled evenly over its latency).

    Args:
        latency_s: median latency of one request.
        latency_sigma: log-normal spread of the latency (0 = every request takes latency_s).
        tail_prob: probability that a request is a straggler.
        tail_factor: how much longer a straggler takes.
        error_rate: probability that a request raises :class:`EngineError`.
        hang_rate: probability that a request never returns (until aborted or cancelled).
        vocab_size: random tokens are drawn from ``[0, vocab_size)``, eos excluded.
        eos_token_id: appended when a random reply stops, and the id it stops on. Left out
            (None), whatever pairs the engine with a tokenizer sets it to the tokenizer's eos
            (:class:`pipeline.Pipeline`, :class:`pipeline.proxy.ProxyServer`,
            ``make_engine("simulated")``; a different one is refused there, since replies
            would never stop); used alone it is 0.
        responder: makes the reply tokens instead of random ones.
        seed: base seed.
        max_running: capacity mode: sequences decoded at once (None: the latency model).
        token_time_s: capacity mode: the time of one decode step.
        kv_capacity_tokens: capacity mode: KV slots (tokens of context) across running
            sequences; None for no KV limit.
        prefill_tokens_per_step: capacity mode: context tokens prefilled per step when a
            sequence is admitted or readmitted after a preemption.
    """

    def __init__(
        self,
        *,
        latency_s: float = 0.02,
        latency_sigma: float = 0.5,
        tail_prob: float = 0.01,
        tail_factor: float = 20.0,
        error_rate: float = 0.0,
        hang_rate: float = 0.0,
        vocab_size: int = 256,
        eos_token_id: int | None = None,
        responder: Responder | None = None,
        seed: int = 0,
        max_running: int | None = None,
        token_time_s: float = 0.001,
        kv_capacity_tokens: int | None = None,
        prefill_tokens_per_step: int = 2048,
    ) -> None:
        _check_numbers(latency_s=latency_s, latency_sigma=latency_sigma, tail_prob=tail_prob,
                       tail_factor=tail_factor, error_rate=error_rate, hang_rate=hang_rate)
        for name, rate in (("error_rate", error_rate), ("hang_rate", hang_rate),
                           ("tail_prob", tail_prob)):
            if not 0.0 <= rate <= 1.0:
                raise ConfigError(f"SimulatedEngine: {name} must be in [0, 1], got {rate}",
                                  field=name)
        if latency_s < 0 or latency_sigma < 0 or tail_factor < 1:
            raise ConfigError("SimulatedEngine: latency_s and latency_sigma must be >= 0 and "
                              "tail_factor >= 1", field="latency_s")
        for name, value, low in (("vocab_size", vocab_size, 1), ("eos_token_id", eos_token_id, 0),
                                 ("seed", seed, None)):
            if value is None and name == "eos_token_id":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or (
                    low is not None and value < low):
                raise ConfigError(f"SimulatedEngine: {name} must be an int"
                                  f"{'' if low is None else f' >= {low}'}, got {value!r}",
                                  field=name)
        _check_capacity(max_running=max_running, token_time_s=token_time_s,
                        kv_capacity_tokens=kv_capacity_tokens,
                        prefill_tokens_per_step=prefill_tokens_per_step)
        if responder is not None and not callable(responder):
            raise ConfigError(f"SimulatedEngine: responder must be callable "
                              f"(prompt_ids, rng) -> token_ids, got {responder!r}",
                              field="responder")
        self.latency_s = latency_s
        self.latency_sigma = latency_sigma
        self.tail_prob = tail_prob
        self.tail_factor = tail_factor
        self.error_rate = error_rate
        self.hang_rate = hang_rate
        self.vocab_size = vocab_size
        self.eos_token_id: int | None = eos_token_id
        self.responder = responder
        self.seed = seed
        self.in_flight: dict[str, asyncio.Future[bool]] = {}
        self.aborted: collections.deque[str] = collections.deque(maxlen=RECENT_ABORTS)
        """The most recent ids of requests stopped early (``abort`` or a cancelled caller),
        oldest first; bounded, so a long run does not grow it."""
        self.calls = 0
        self.policy_version: int | None = 0
        self._pause_mode: PauseMode | None = None
        self._opened: asyncio.Event | None = None  # made by the first pause: set while open
        self._drained: asyncio.Event | None = None  # set when nothing is in flight
        self._updates: collections.deque[tuple[float, int, int]] = collections.deque(
            maxlen=_UPDATES_KEPT)
        """(time, version before, version after) of the latest weight updates."""
        self._decoding: dict[str, DecodeRequest] = {}
        self.scheduler: DecodeScheduler | None = None
        """The capacity model's decoder (None in latency mode)."""
        if max_running is not None:
            self.scheduler = DecodeScheduler(
                max_running=max_running, token_time_s=token_time_s,
                kv_capacity_tokens=kv_capacity_tokens,
                prefill_tokens_per_step=prefill_tokens_per_step)

    def _rng(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str
    ) -> random.Random:
        # Seeded requests replay identically across runs (uids are random, so they are not
        # part of the key); the prompt length tells turns of one conversation apart.
        key = f"{sampling.seed}:{len(prompt_ids)}" if sampling.seed is not None else request_id
        return random.Random(zlib.crc32(f"{self.seed}:{key}".encode()))

    def _latency(self, rng: random.Random) -> float:
        latency = self.latency_s
        if self.latency_sigma:
            latency *= math.exp(rng.gauss(0.0, self.latency_sigma))
        if rng.random() < self.tail_prob:
            latency *= self.tail_factor
        return latency

    def _reply(self, prompt_ids: list[int], rng: random.Random, max_tokens: int) -> list[int]:
        if self.responder is not None:
            return self.responder(prompt_ids, rng)
        length = rng.randint(1, max_tokens + max_tokens // 4 + 1)
        eos = self.eos_token_id or 0
        tokens = [rng.randrange(self.vocab_size) for _ in range(length)]
        tokens = [t if t != eos else (t + 1) % self.vocab_size for t in tokens]
        return [*tokens, eos]

    def _complete(self, reply: list[int], sampling: SamplingParams
                  ) -> tuple[list[int], FinishReason]:
        stop_ids = {self.eos_token_id or 0, *sampling.stop_token_ids}
        for i, tok in enumerate(reply[: sampling.max_tokens]):
            if tok in stop_ids:
                return reply[: i + 1], FinishReason.STOP
        return reply[: sampling.max_tokens], FinishReason.LENGTH

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str, *,
        multi_modal: Any = None,
    ) -> Generation:
        """Simulate one request (see class doc): seeded tokens after the simulated time.
        ``multi_modal`` (a vision-language prompt's images) is accepted and ignored: the
        image tokens in ``prompt_ids`` count like any other."""
        while self._pause_mode is not None and self._opened is not None:
            await self._opened.wait()  # paused: new requests wait for resume
        self.calls += 1
        rng = self._rng(prompt_ids, sampling, request_id)
        latency = self._latency(rng)
        fault = rng.random()
        hang = fault < self.hang_rate
        tokens: list[int] = []
        logprobs: list[float] = []
        reason = FinishReason.STOP
        if not hang and (fault >= self.hang_rate + self.error_rate or self.scheduler is not None):
            # A reply is drawn only for a request that returns one (or, in capacity mode,
            # decodes before it fails): a random reply costs up to a millisecond.
            tokens, reason = self._complete(
                self._reply(list(prompt_ids), rng, sampling.max_tokens), sampling)
            # Only the comprehension's outermost iterable may name ``rng``: a name read inside
            # it becomes a cell of this frame, one object more per request in flight.
            logprobs = [-x for x in map(rng.expovariate, [2.0] * len(tokens))]
        # Everything is drawn before the wait: a live generator (2.5 KB of Mersenne Twister
        # state) held by every request in flight would weigh more than its reply does.
        del rng
        if self.scheduler is not None and not hang:
            versions, aborted = await self._decode(request_id, len(prompt_ids), tokens)
        else:
            started = asyncio.get_running_loop().time()
            # The drawn reply waits as tuples: the collector stops tracking a tuple of plain
            # values at its first young pass, where two lists per request in flight were
            # two objects more for every full pass to walk. The lists are made again after.
            drawn_ids, drawn_logprobs = tuple(tokens), tuple(logprobs)
            del tokens, logprobs
            # Awaited here, not in a coroutine of its own: one frame less per request in
            # flight for the collector to walk.
            outcome, timer = self._submit(request_id, None if hang else latency)
            try:
                aborted = await outcome
                while not aborted and self._pause_mode == "keep" and self._opened is not None:
                    await self._opened.wait()  # a kept request finishes after resume
            except asyncio.CancelledError:
                self.aborted.append(request_id)  # the caller went away: the request is dropped
                raise
            finally:
                if timer is not None:
                    timer.cancel()
                self._left(request_id)
            tokens, logprobs = list(drawn_ids), list(drawn_logprobs)
            versions = self._versions_between(
                started, asyncio.get_running_loop().time(), len(tokens))
        if aborted:
            # What was sampled before the abort is returned (none in latency mode).
            kept = len(versions) if self.scheduler is not None else 0
            versions = versions[:kept]
            tokens, logprobs, reason = tokens[:kept], logprobs[:kept], FinishReason.ABORT
        elif fault < self.hang_rate + self.error_rate:
            raise EngineError(f"simulated engine fault on request {request_id}")
        oldest = min(versions, default=self.policy_version)
        # One version for every token is the common case: no per-token list to carry then.
        per_token = versions if versions and max(versions) != oldest else None
        return Generation(tokens, logprobs, reason, reason.value, policy_version=oldest,
                          token_versions=per_token)

    def _submit(self, request_id: str, latency: float | None
                ) -> tuple[asyncio.Future[bool], asyncio.TimerHandle | None]:
        """The latency model: a future that ends ``False`` after ``latency`` (None: never;
        ``True`` when aborted), and its timer."""
        loop = asyncio.get_running_loop()
        # A bare future plus a timer handle: far cheaper than a task per request, which
        # matters when this engine is the baseline of overhead benchmarks.
        outcome: asyncio.Future[bool] = loop.create_future()
        timer = None if latency is None else loop.call_later(latency, _finish, outcome,
                                                             context=_timer_context())
        self.in_flight[request_id] = outcome
        return outcome, timer

    async def _decode(self, request_id: str, prompt_len: int, tokens: list[int]
                      ) -> tuple[list[int], bool]:
        """The capacity model: decode ``tokens`` in the scheduler; (versions, aborted)."""
        assert self.scheduler is not None
        request = self.scheduler.submit(request_id, prompt_len, len(tokens))
        self.in_flight[request_id] = request.done
        self._decoding[request_id] = request
        try:
            aborted = await request.done
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise
        finally:
            self.scheduler.remove(request)
            self._decoding.pop(request_id, None)
            self._left(request_id)
        return request.versions, aborted

    def _left(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        if not self.in_flight and self._drained is not None:
            self._drained.set()

    def _versions_between(self, started: float, ended: float, count: int) -> list[int]:
        """The latency model's per-token versions: token i sampled at ``started + (i + 1) /
        count`` of the way to ``ended``, under the version in effect then."""
        updates = [u for u in self._updates if u[0] > started]
        if not updates:
            return [self.policy_version or 0] * count
        version, pending = updates[0][1], collections.deque(updates)
        versions = []
        for i in range(count):
            at = started + (ended - started) * (i + 1) / count
            while pending and pending[0][0] <= at:
                version = pending.popleft()[2]
            versions.append(version)
        return versions

    def load(self) -> EngineLoad:
        """Running and waiting sequences, KV use and preemptions (capacity mode); in the
        latency model only the requests in flight."""
        if self.scheduler is not None:
            return self.scheduler.load()
        return EngineLoad(running=len(self.in_flight))

    async def abort(self, request_id: str) -> None:
        """End ``request_id`` now with ``finish_reason=abort``; unknown ids are ignored."""
        outcome = self.in_flight.get(request_id)
        if outcome is not None and not outcome.done():
            self.aborted.append(request_id)
            request = self._decoding.get(request_id)
            if request is not None and self.scheduler is not None:
                self.scheduler.remove(request)
            outcome.set_result(True)

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Hold new requests; abort, wait for or keep (frozen) those in flight."""
        mode = check_pause_mode(mode)
        self._pause_mode = mode
        if self._opened is None:
            self._opened = asyncio.Event()
        self._opened.clear()
        if mode == "keep":
            if self.scheduler is not None:
                self.scheduler.freeze()
            return
        if mode == "abort":
            for request_id in list(self.in_flight):
                await self.abort(request_id)
        self._drained = asyncio.Event()
        if self.in_flight:
            await self._drained.wait()

    async def resume(self) -> None:
        """Admit requests again; kept ones go on."""
        self._pause_mode = None
        if self.scheduler is not None:
            self.scheduler.thaw()
        if self._opened is not None:
            self._opened.set()

    async def update_weights(self, state_dict: Mapping[str, Any] | None = None,
                             path: str | Path | None = None, *,
                             version: int | None = None) -> int:
        """Bump ``policy_version`` (there are no weights: the source is not read)."""
        before = self.policy_version or 0
        self.policy_version = next_version(self.policy_version, version)
        self._updates.append((asyncio.get_running_loop().time(), before, self.policy_version))
        if self.scheduler is not None:
            self.scheduler.policy_version = self.policy_version
        return self.policy_version

    async def reset_prefix_cache(self) -> bool:
        """Nothing cached: True."""
        return True

    async def aclose(self) -> None:
        """Abort everything still in flight and stop the decoder's clock."""
        for request_id in list(self.in_flight):
            await self.abort(request_id)
        if self.scheduler is not None:
            await self.scheduler.aclose()


def _check_numbers(**values: object) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ConfigError(f"SimulatedEngine: {name} must be a number, got {value!r}",
                              field=name)


def _check_capacity(*, max_running: int | None, token_time_s: float,
                    kv_capacity_tokens: int | None, prefill_tokens_per_step: int) -> None:
    for name, value, optional in (("max_running", max_running, True),
                                  ("kv_capacity_tokens", kv_capacity_tokens, True),
                                  ("prefill_tokens_per_step", prefill_tokens_per_step, False)):
        if value is None and optional:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"SimulatedEngine: {name} must be an int >= 1"
                              f"{' or None' if optional else ''}, got {value!r}", field=name)
    _check_numbers(token_time_s=token_time_s)
    if token_time_s <= 0:
        raise ConfigError(f"SimulatedEngine: token_time_s must be > 0, got {token_time_s}",
                          field="token_time_s")


_TIMERS = threading.local()


def _timer_context() -> contextvars.Context:
    """One empty context per thread for the latency timers (``_finish`` reads no variable):
    without one, each ``call_later`` copies the caller's, an object per request in flight.
    Per thread, since a context cannot be entered twice at once."""
    context: contextvars.Context | None = getattr(_TIMERS, "context", None)
    if context is None:
        context = _TIMERS.context = contextvars.Context()
    return context


def _finish(outcome: asyncio.Future[bool]) -> None:
    if not outcome.done():
        outcome.set_result(False)
