"""The engine protocol: token ids in, token ids and logprobs out.

An engine is one ``generate`` method plus ``abort`` and ``aclose`` (httpx's transport idea).
The pipeline never re-tokenizes model output; stops are token ids, never strings. Engines
that trainers update between steps also implement
:class:`pipeline.engines._weight_sync.WeightSync` (``pause``, ``update_weights``, ``resume``,
``reset_prefix_cache``, ``policy_version``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pipeline._data.config import SamplingParams
from pipeline._data.models import FinishReason

RECENT_ABORTS = 4096
"""How many aborted request ids an engine remembers (its ``aborted`` deque), for tests and
diagnostics; older ones are forgotten."""


@dataclass(slots=True)
class Generation:
    """What one generate call produced.

    Attributes:
        token_ids: the sampled tokens, stop token included when generation stopped on one.
        logprobs: logprob of each sampled token under the distribution actually sampled from
            (after temperature / top-p processing), aligned with ``token_ids``.
        finish_reason: ``stop``, ``length`` or ``abort``.
        raw_finish_reason: the engine's own word for it.
        routed_experts: MoE router choices ``[prompt_len + len(token_ids), num_layers, topk]``
            when the engine reports them, else None.
        policy_version: version of the weights that produced these tokens, if tracked; the
            oldest one when a weight update fell inside the request.
        token_versions: the version of the weights that sampled each token, aligned with
            ``token_ids``, when they differ (a request that ran across a weight update,
            paused with ``"keep"``); None when every token has ``policy_version`` (engines
            may also report a list of one value), or versions are not tracked.
        text: the engine's own detokenization of ``token_ids``, when it reports one; the
            token-integrity check compares it with the tokenizer's decode.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    raw_finish_reason: str | None = None
    routed_experts: Any = None
    policy_version: int | None = None
    text: str | None = None
    token_versions: list[int] | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """How loaded an engine is now, from its own scheduler: what flow control reads.

    Engines that can tell implement ``load() -> EngineLoad``; fields an engine cannot measure
    are None.

    Attributes:
        running: sequences being decoded (or prefilled) now.
        waiting: sequences queued inside the engine, not yet running.
        kv_usage: fraction of the KV cache in use, 0..1.
        preemptions: sequences preempted so far (cumulative): a running sequence evicted for
            lack of KV space and recomputed later.
        sampled_tokens: tokens sampled so far (cumulative).
        busy_s: wall time so far during which at least one sequence ran (cumulative).
        slot_s: running sequences times wall time, summed (cumulative): ``slot_s /
            (max_running * wall)`` is how much of the engine's decode capacity was used.
        max_running: how many sequences the engine decodes at once at most.
    """

    running: int
    waiting: int = 0
    kv_usage: float | None = None
    preemptions: int | None = None
    sampled_tokens: int | None = None
    busy_s: float | None = None
    slot_s: float | None = None
    max_running: int | None = None


@runtime_checkable
class Engine(Protocol):
    """An inference engine, as the pipeline sees it."""

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, request_id: str
    ) -> Generation:
        """Generate one continuation of ``prompt_ids``; ``request_id`` is unique per call.

        The built-in ``Generate`` stage uses ``f"{uid}-{turn}"`` as the request id, with
        ``uid = f"{group_id}-{k}"``, so engines may route by group (prefix-cache reuse) from
        the id alone (``pipeline.engines._openai.pipeline_group_key``).

        Cancelling the awaiting task must stop the work (or the caller calls ``abort``).
        Raises :class:`pipeline.EngineError` on failure.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop the request ``request_id`` if it still runs; a no-op otherwise."""
        ...

    async def aclose(self) -> None:
        """Release the engine's resources."""
        ...
