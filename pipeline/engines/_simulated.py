"""A simulated engine: no model, seeded latency and fault model, for benchmarks and chaos tests.

It is named as simulated everywhere it is used: figures measured on it show the pipeline's own
cost, never a model's.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import zlib
from collections.abc import Callable, Sequence

from pipeline._data.config import SamplingParams
from pipeline._data.models import FinishReason
from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._base import RECENT_ABORTS, Generation

Responder = Callable[[list[int], random.Random], list[int]]
"""Makes the simulated reply: ``(prompt_ids, rng) -> token_ids`` (end with the eos id to stop)."""


class SimulatedEngine:
    """Simulated inference engine with a heavy-tailed latency model and fault injection.

    Every decision (latency, length, tokens, faults) is drawn from a RNG seeded by ``seed``,
    ``sampling.seed`` and the prompt length (or the request id for unseeded requests), so a
    seeded batch replays identically.

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

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str
    ) -> Generation:
        """Wait for the simulated latency, then return seeded tokens (see class doc)."""
        self.calls += 1
        rng = self._rng(prompt_ids, sampling, request_id)
        latency = self._latency(rng)
        fault = rng.random()
        loop = asyncio.get_running_loop()
        # A bare future plus a timer handle: far cheaper than a task per request, which
        # matters when this engine is the baseline of overhead benchmarks.
        outcome: asyncio.Future[bool] = loop.create_future()
        timer = None if fault < self.hang_rate else loop.call_later(latency, _finish, outcome)
        self.in_flight[request_id] = outcome
        try:
            aborted = await outcome
        except asyncio.CancelledError:
            self.aborted.append(request_id)  # the caller went away: the request is dropped
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self.in_flight.pop(request_id, None)
        if aborted:
            return Generation([], [], FinishReason.ABORT, "abort")
        if fault < self.hang_rate + self.error_rate:
            raise EngineError(f"simulated engine fault on request {request_id}")
        reply = self._reply(list(prompt_ids), rng, sampling.max_tokens)
        stop_ids = {self.eos_token_id or 0, *sampling.stop_token_ids}
        for i, tok in enumerate(reply[: sampling.max_tokens]):
            if tok in stop_ids:
                tokens, reason = reply[: i + 1], FinishReason.STOP
                break
        else:
            tokens, reason = reply[: sampling.max_tokens], FinishReason.LENGTH
        logprobs = [-rng.expovariate(2.0) for _ in tokens]
        return Generation(tokens, logprobs, reason, reason.value)

    async def abort(self, request_id: str) -> None:
        """End ``request_id`` now with ``finish_reason=abort``; unknown ids are ignored."""
        outcome = self.in_flight.get(request_id)
        if outcome is not None and not outcome.done():
            self.aborted.append(request_id)
            outcome.set_result(True)

    async def aclose(self) -> None:
        """Abort everything still in flight."""
        for request_id in list(self.in_flight):
            await self.abort(request_id)


def _check_numbers(**values: object) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ConfigError(f"SimulatedEngine: {name} must be a number, got {value!r}",
                              field=name)


def _finish(outcome: asyncio.Future[bool]) -> None:
    if not outcome.done():
        outcome.set_result(False)
