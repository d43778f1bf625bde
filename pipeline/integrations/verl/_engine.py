"""Our :class:`~pipeline.engines.Engine` over verl's ``LLMServerClient`` (verl 0.9.1).

verl's client differs from our engines in three ways, each handled here:

- ``TokenOutput.stop_reason`` folds stop and length into ``"completed"``: ``length`` is
  derived from the token count against the turn's ``max_tokens`` (a completion that does not
  end on a stop id), the server's word is kept as ``raw_finish_reason``.
- It sends the server a fresh request id per turn and has no abort, and Ray does not pass an
  asyncio cancellation of ``await ref`` on to the actor: a timed-out sample's server request
  would run on to its ``max_tokens``. The adapter records the ``ObjectRef`` of the server call
  (a subclass of the client's own class whose ``_acquire_server`` wraps the server handle, the
  hook verl's ``FullyAsyncLLMServerClient`` overrides too) and ``ray.cancel``\\s it when the
  sample is cancelled: an async actor's coroutine then gets ``CancelledError``, and vLLM's
  ``AsyncLLM.generate`` aborts the request on it.
- The server's ``extra_fields`` carry ``global_steps`` / ``min_global_steps`` /
  ``max_global_steps`` (verl's staleness control): ``global_steps`` becomes the generation's
  ``policy_version``; the min and max over a sample's turns are kept in a :class:`StepRange`
  that the agent loop copies into the output's ``extra_fields``.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from pipeline._data.config import SamplingParams
from pipeline._data.models import FinishReason
from pipeline._exceptions import EngineError
from pipeline.engines import Generation

_logger = structlog.get_logger("pipeline.integrations.verl")


@dataclass
class StepRange:
    """The weight versions (verl's ``global_steps``) one sample's turns were generated with."""

    min_global_steps: int | None = None
    max_global_steps: int | None = None

    def add(self, extra: Mapping[str, Any]) -> None:
        low = extra.get("min_global_steps", extra.get("global_steps"))
        high = extra.get("max_global_steps", extra.get("global_steps"))
        if isinstance(low, int) and (self.min_global_steps is None or low < self.min_global_steps):
            self.min_global_steps = low
        if isinstance(high, int) and (self.max_global_steps is None
                                      or high > self.max_global_steps):
            self.max_global_steps = high

    def as_fields(self) -> dict[str, int | None]:
        return {"min_global_steps": self.min_global_steps,
                "max_global_steps": self.max_global_steps}


STEPS: contextvars.ContextVar[StepRange | None] = contextvars.ContextVar(
    "pipeline_verl_steps", default=None)
"""The running sample's :class:`StepRange` (set by the agent loop around its sample)."""


@dataclass
class _ServerCall:
    """The server call of one ``generate``: its ObjectRef once submitted."""

    ref: Any = None
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True
        if self.ref is not None:
            import ray

            ray.cancel(self.ref)


_CALL: contextvars.ContextVar[_ServerCall | None] = contextvars.ContextVar(
    "pipeline_verl_call", default=None)


class _RecordedMethod:
    def __init__(self, method: Any, call: _ServerCall) -> None:
        self._method, self._call = method, call

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        ref = self._method.remote(*args, **kwargs)
        self._call.ref = ref
        if self._call.cancelled:  # cancelled between acquiring the server and the call
            self._call.cancel()
        return ref


class _RecordedServer:
    """A server actor handle whose ``generate.remote`` leaves its ObjectRef in the call."""

    def __init__(self, handle: Any, call: _ServerCall) -> None:
        self._handle, self._call = handle, call

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._handle, name)
        return _RecordedMethod(attr, self._call) if name == "generate" else attr


class _RecordsServerCall:
    """Mixed in before the client's own class: only ``_acquire_server`` changes."""

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        server_id, handle = await super()._acquire_server(request_id, **extra)  # type: ignore[misc]
        call = _CALL.get()
        return server_id, handle if call is None else _RecordedServer(handle, call)


_CANCELLABLE: dict[type, type] = {}


def cancellable_client(client: Any) -> Any:
    """``client`` as an instance of a subclass that records its server calls (same state).

    The new object shares the client's attribute dict (load balancer handle, config), so
    it is the same client with one more hook. A client without ``_acquire_server`` (not an
    ``LLMServerClient``) is returned as it is: its calls cannot be cancelled.
    """
    cls = type(client)
    if isinstance(client, _RecordsServerCall):
        return client
    if not callable(getattr(client, "_acquire_server", None)) or not hasattr(client, "__dict__"):
        _logger.warning("verl_client_not_cancellable", client=cls.__name__)
        return client
    sub = _CANCELLABLE.get(cls)
    if sub is None:
        sub = _CANCELLABLE[cls] = type(f"Cancellable{cls.__name__}", (_RecordsServerCall, cls),
                                       {"__module__": __name__})
    clone: Any = object.__new__(sub)
    clone.__dict__ = client.__dict__
    return clone


class VerlServerEngine:
    """An :class:`~pipeline.engines.Engine` over verl's ``LLMServerClient.generate``.

    Requests are routed by the sample's uid (the request id without its ``-turn`` suffix),
    so verl's sticky load balancer keeps a trajectory's turns on one server (prefix cache),
    as verl's own agent loops do. Logprobs are always asked for (the trainer gets the
    sampled tokens' logprobs whatever ``rollout.calculate_log_probs`` says).

    Args:
        client: the ``server_manager`` verl hands its agent loops.
        eos_token_ids: stop ids of the model (with each request's ``stop_token_ids``): a
            completion ending on one is ``stop``, else, at ``max_tokens`` tokens, ``length``.
        max_model_len: context limit the ``Generate`` stage budgets against.
        base_params: sampling fields verl sets that ours do not have
            (``repetition_penalty``), sent with every request.
    """

    def __init__(self, client: Any, *, eos_token_ids: Iterable[int] = (),
                 max_model_len: int | None = None,
                 base_params: Mapping[str, Any] | None = None) -> None:
        self.client = cancellable_client(client)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_model_len = max_model_len
        self.base_params = dict(base_params or {})
        self._calls: dict[str, _ServerCall] = {}
        self.aborted: deque[str] = deque(maxlen=4096)
        """Request ids whose server call was cancelled (newest last)."""

    def _params(self, sampling: SamplingParams) -> dict[str, Any]:
        params = {**self.base_params, "temperature": sampling.temperature,
                  "top_p": sampling.top_p, "top_k": sampling.top_k,
                  "max_tokens": sampling.max_tokens, "logprobs": True}
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        return params

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str) -> Generation:
        """One server call; cancelling it cancels the server's coroutine (see module doc).

        Raises:
            EngineError: the server call failed, or returned logprobs that do not match.
        """
        call = _ServerCall()
        self._calls[request_id] = call
        token = _CALL.set(call)
        sticky = request_id.rpartition("-")[0] or request_id
        try:
            output = await self.client.generate(sticky, prompt_ids=list(prompt_ids),
                                                sampling_params=self._params(sampling))
        except asyncio.CancelledError:
            self._cancel(request_id, call)
            raise
        except Exception as exc:
            raise EngineError(f"request {request_id}: verl server call failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        finally:
            _CALL.reset(token)
            self._calls.pop(request_id, None)
        return self._generation(output, sampling, request_id)

    def _generation(self, output: Any, sampling: SamplingParams, request_id: str) -> Generation:
        token_ids = [int(t) for t in output.token_ids]
        logprobs = [float(x) for x in (output.log_probs or ())]
        if len(logprobs) != len(token_ids):
            raise EngineError(f"request {request_id}: the server returned {len(logprobs)} "
                              f"logprobs for {len(token_ids)} tokens")
        extra = dict(output.extra_fields or {})
        steps = STEPS.get()
        if steps is not None:
            steps.add(extra)
        raw = output.stop_reason
        stops = self.eos_token_ids | set(sampling.stop_token_ids)
        if raw in ("aborted", "abort"):
            reason = FinishReason.ABORT
        elif token_ids and token_ids[-1] in stops:
            reason = FinishReason.STOP
        elif len(token_ids) >= sampling.max_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = FinishReason.STOP
        version = extra.get("global_steps")
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                          raw_finish_reason=None if raw is None else str(raw),
                          routed_experts=output.routed_experts,
                          policy_version=version if isinstance(version, int) else None)

    def _cancel(self, request_id: str, call: _ServerCall) -> None:
        try:
            call.cancel()
        except Exception as exc:  # a dead server: nothing left to stop
            _logger.warning("verl_cancel_failed", request_id=request_id, error=repr(exc))
        self.aborted.append(request_id)

    async def abort(self, request_id: str) -> None:
        """Cancel ``request_id``'s server call if it still runs; a no-op otherwise."""
        call = self._calls.get(request_id)
        if call is not None and not call.cancelled:
            self._cancel(request_id, call)

    async def aclose(self) -> None:
        """Nothing to release: the client belongs to verl's worker."""
