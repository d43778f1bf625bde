"""The simulated engine's capacity model: a batched decoder with a slot limit and a KV budget.

``SimulatedEngine(max_running=C, ...)`` decodes through one :class:`DecodeScheduler`, so that
"the engine is idle" and "the KV cache thrashes" mean something in benchmarks of flow control
and asynchronous RL. The model, in vLLM's terms:

- time advances in steps of ``token_time_s``; each step every running sequence samples one
  token (a batched decode step costs the same however many sequences it holds);
- at most ``max_running`` sequences run; the others wait in FIFO order;
- a sequence admitted to run first prefills ``ceil(context / prefill_tokens_per_step)`` steps
  (its prompt, plus the tokens it had sampled when it was preempted);
- with a KV budget (``kv_capacity_tokens``), a running sequence holds one KV slot per token of
  its context; a waiting sequence is admitted only while its context fits, and when the
  running sequences outgrow the budget the youngest is preempted (recompute, as vLLM V1
  does: back to the front of the queue, its sampled tokens kept, its KV rebuilt on return);
- a ``keep`` pause freezes the clock: nothing is sampled until ``resume``, and tokens sampled
  after a weight update carry the new version.

Steps run on a fixed-rate clock: a wake-up that comes late runs the steps it missed, so the
simulated throughput does not depend on the event loop's timer slack.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from dataclasses import dataclass, field

from pipeline.engines._base import EngineLoad

_MAX_CATCH_UP_STEPS = 256
"""A wake-up never runs more steps than this (a loop stalled for seconds does not replay them)."""


@dataclass(slots=True, eq=False)
class DecodeRequest:
    """One request in the scheduler: how much it must sample and what it has sampled."""

    request_id: str
    prompt_len: int
    target: int
    """Tokens to sample before it finishes."""
    done: asyncio.Future[bool]
    """Set to False when the request has sampled ``target`` tokens, True when aborted."""
    versions: list[int] = field(default_factory=list)
    """The policy version of each token sampled so far."""
    prefill_left: int = 0
    admitted: int = 0
    """Admission order: the largest is the youngest, preempted first."""

    @property
    def context(self) -> int:
        """Tokens of KV this request holds while it runs."""
        return self.prompt_len + len(self.versions)


class DecodeScheduler:
    """Slots, a KV budget and a fixed-rate step clock for simulated requests (module doc)."""

    def __init__(self, *, max_running: int, token_time_s: float,
                 kv_capacity_tokens: int | None, prefill_tokens_per_step: int) -> None:
        self.max_running = max_running
        self.token_time_s = token_time_s
        self.kv_capacity_tokens = kv_capacity_tokens
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.policy_version = 0
        self.running: list[DecodeRequest] = []
        self.waiting: collections.deque[DecodeRequest] = collections.deque()
        self.kv_used = 0
        self.preemptions = 0
        self.sampled_tokens = 0
        self.busy_s = 0.0
        self.slot_s = 0.0
        self._admissions = 0
        self._frozen = False
        self._thawed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def load(self) -> EngineLoad:
        """The scheduler's state now (see :class:`~pipeline.engines.EngineLoad`)."""
        kv = (None if self.kv_capacity_tokens is None
              else min(1.0, self.kv_used / self.kv_capacity_tokens))
        return EngineLoad(running=len(self.running), waiting=len(self.waiting), kv_usage=kv,
                          preemptions=self.preemptions, sampled_tokens=self.sampled_tokens,
                          busy_s=self.busy_s, slot_s=self.slot_s, max_running=self.max_running)

    def submit(self, request_id: str, prompt_len: int, target: int) -> DecodeRequest:
        """Queue a request that samples ``target`` tokens; await its ``done`` future."""
        request = DecodeRequest(request_id, prompt_len, target,
                                asyncio.get_running_loop().create_future())
        if target <= 0:
            request.done.set_result(False)
            return request
        if (self.kv_capacity_tokens is not None
                and prompt_len + target > self.kv_capacity_tokens):
            # It could never run to its end: vLLM refuses such a prompt up front too.
            request.done.set_exception(ValueError(
                f"request {request_id} needs {prompt_len + target} KV slots, the simulated "
                f"engine has {self.kv_capacity_tokens}"))
            return request
        self.waiting.append(request)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="simulated-engine-scheduler")
        return request

    def remove(self, request: DecodeRequest) -> None:
        """Drop ``request`` wherever it is (aborted or its caller went away)."""
        if request in self.running:
            self.running.remove(request)
            self.kv_used -= request.context
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        if not (self.running or self.waiting) and self._task is not None:
            # Nothing left to decode: stop the clock now rather than after its next step, so
            # a closed run leaves no task behind.
            self._task.cancel()
            self._task = None

    def requests(self) -> list[DecodeRequest]:
        """Every request not finished yet, running first."""
        return [*self.running, *self.waiting]

    def freeze(self) -> None:
        """Stop the clock (a ``keep`` pause): nothing is sampled until :meth:`thaw`."""
        self._frozen = True
        if self._thawed is not None:
            self._thawed.clear()

    def thaw(self) -> None:
        """Start the clock again."""
        self._frozen = False
        if self._thawed is not None:
            self._thawed.set()

    async def aclose(self) -> None:
        """Stop the clock task (requests still queued are the caller's to abort)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        # The clock runs while there is work and stops when there is none; submit restarts it.
        loop = asyncio.get_running_loop()
        last = loop.time()
        while self.running or self.waiting:
            if self._frozen:
                if self._thawed is None:
                    self._thawed = asyncio.Event()
                await self._thawed.wait()
                last = loop.time()
                continue
            self._admit()
            await asyncio.sleep(max(0.0, last + self.token_time_s - loop.time()))
            now = loop.time()
            steps = min(_MAX_CATCH_UP_STEPS, max(1, int((now - last) / self.token_time_s)))
            last = max(last + steps * self.token_time_s, now - self.token_time_s)
            for _ in range(steps):
                if self._frozen or not (self.running or self.waiting):
                    break
                self._step()
                self._admit()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            if (self.kv_capacity_tokens is not None and self.running
                    and self.kv_used + request.context + 1 > self.kv_capacity_tokens):
                return  # no room for its KV yet: FIFO, nobody overtakes it
            self.waiting.popleft()
            request.prefill_left = math.ceil(request.context / self.prefill_tokens_per_step)
            self._admissions += 1
            request.admitted = self._admissions
            self.running.append(request)
            self.kv_used += request.context

    def _step(self) -> None:
        if self.running:
            self.busy_s += self.token_time_s
            self.slot_s += self.token_time_s * len(self.running)
        finished: list[DecodeRequest] = []
        for request in self.running:
            if request.prefill_left:
                request.prefill_left -= 1
                continue
            request.versions.append(self.policy_version)
            self.kv_used += 1
            self.sampled_tokens += 1
            if len(request.versions) >= request.target:
                finished.append(request)
        for request in finished:
            self.running.remove(request)
            self.kv_used -= request.context
            if not request.done.done():
                request.done.set_result(False)
        self._preempt_over_budget()

    def _preempt_over_budget(self) -> None:
        if self.kv_capacity_tokens is None:
            return
        while self.kv_used > self.kv_capacity_tokens and len(self.running) > 1:
            youngest = max(self.running, key=lambda r: r.admitted)
            self.running.remove(youngest)
            self.kv_used -= youngest.context
            self.waiting.appendleft(youngest)
            self.preemptions += 1
