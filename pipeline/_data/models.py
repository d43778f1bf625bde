"""The data model: messages, items flowing through stages, records, and the trainer view.

``model_dump(mode="json")`` of these models is the wire form everywhere (dumps, proxy, Ray).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from pipeline._data.config import SamplingParams
from pipeline._data.construct import own_fields_set
from pipeline._data.rows import DatasetRow


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool) that is neither NaN nor infinite."""
    if type(value) is float:  # the common case, before the costlier ABC check
        return math.isfinite(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except (OverflowError, TypeError, ValueError):
        return False


TOOL_CALL_ERRORS = "tool_call_errors"
"""Extra field of an assistant :class:`AgentMessage`: ``{call id: why it is unusable}`` for
calls the parser could not read; the tool-calling stage answers them with that error."""


class Status(enum.StrEnum):
    """How a sample ended. Everything but ``completed`` is masked out of the loss."""

    COMPLETED = "completed"
    FAILED = "failed"
    TIMEOUT = "timeout"
    ABORTED = "aborted"


class FinishReason(enum.StrEnum):
    """Why generation ended: a closed set consumers can switch on.

    The engine's own reason (``"stop_token"``, ``"eos"``, ...) is kept beside it as
    ``raw_finish_reason``.
    """

    STOP = "stop"
    LENGTH = "length"
    TIMEOUT = "timeout"
    ERROR = "error"
    ABORT = "abort"


class ExitReason(enum.StrEnum):
    """Why the agent loop (or the whole sample) ended; finer than the finish reason."""

    DONE = "done"
    """The stages ran to the end (the model stopped without further tool calls)."""
    MAX_TURNS = "max_turns"
    """A ``Loop`` ran out of turns."""
    LENGTH = "length"
    """A length budget ran out (per-turn cap, response budget or model context)."""
    TIMEOUT = "timeout"
    ERROR = "error"
    ABORT = "abort"
    BUILD_FAILED = "build_failed"
    """The trainer view could not be built; a fully masked stand-in was produced."""


class ToolFunction(BaseModel):
    """The function part of an OpenAI tool call; ``arguments`` is the raw JSON text."""

    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    """One tool call of an assistant message, in OpenAI's wire form."""

    id: str
    type: Literal["function"] = "function"
    function: ToolFunction


class AgentMessage(BaseModel):
    """An OpenAI-compatible chat message, plus engine facts for assistant turns.

    ``token_ids``/``logprobs`` are exactly what the engine sampled for this turn; they are what
    the trainer sees, never a re-tokenization of ``content``.
    """

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # Messages built on the hot path share one field set (pipeline._data.messages);
        # pydantic adds an extra field's name to it, so such a message first gets its own.
        if name not in type(self).__pydantic_fields__:
            own_fields_set(self)
        super().__setattr__(name, value)


@dataclasses.dataclass(slots=True)
class StageRecord:
    """One run of one stage on one sample (or the cleanup of a stage).

    ``start``/``end`` are ``time.monotonic()`` seconds (for durations and timelines);
    ``start_wall`` is the Unix time the stage started (for humans and log correlation).

    A slotted dataclass, not a pydantic model: one is made per stage run on the hot path,
    from values the runner itself produced. It is validated where it crosses a boundary:
    as a field of :class:`AgentRolloutItem` built from data, and read back from a dump as
    :class:`pipeline.observability.StageTiming`.
    """

    name: str
    start: float
    start_wall: float
    phase: Literal["run", "cleanup"] = "run"
    turn: int | None = None
    end: float | None = None
    status: Status = Status.COMPLETED
    error_type: str | None = None
    error_message: str | None = None

    @property
    def duration(self) -> float | None:
        """Seconds the stage ran, or None while it runs."""
        return None if self.end is None else self.end - self.start


class AgentRolloutItem(BaseModel):
    """One rollout in flight: the row, what stages produced, and how it ended.

    Attributes:
        uid: unique per rollout.
        group_id: shared by the ``n`` rollouts of one prompt (verl's per-prompt ``uid``).
        index: position in the batch's output.
        sample_index: which of the group's ``n`` rollouts this is.
        data: the dataset row.
        sampling: effective sampling parameters (config defaults, row overrides, own seed).
        artifacts: what stages wrote; keys in :mod:`pipeline.artifacts`.
        records: one :class:`StageRecord` per stage run, in order.
        status / finish_reason / error: set by the runner when the sample ends.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    uid: str
    group_id: str
    index: int = 0
    sample_index: int = 0
    data: DatasetRow
    sampling: SamplingParams = SamplingParams()
    artifacts: dict[str, Any] = Field(default_factory=dict)
    records: list[StageRecord] = Field(default_factory=list)
    status: Status | None = None
    finish_reason: FinishReason | None = None
    raw_finish_reason: str | None = None
    exit_reason: str | None = None
    error: str | None = None
    error_stage: str | None = None
    queued_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None

    @property
    def latency_s(self) -> float | None:
        """Running time (excludes waiting for a concurrency slot, and for the event loop's turn
        before the first stage when the loop is saturated)."""
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at


NOT_SAMPLED = -1
"""``RolloutSample.token_versions`` entry of a token the model did not sample (tool output,
template tokens)."""


class RolloutSample(BaseModel):
    """The trainer's view of one rollout: one per item, same order as the input, never dropped.

    ``response_mask`` is 1 on tokens the model sampled and 0 on tool/template tokens;
    ``logprobs`` is aligned with ``response_ids`` (0.0 where the mask is 0). A ``masked``
    sample carries no loss (failed, timed out, aborted). ``routed_experts`` is an int array
    ``[prompt_len + response_len, num_layers, topk]`` when the engine reports MoE routing.

    Policy versions (asynchronous RL): ``token_versions`` is aligned with ``response_ids``:
    the version of the weights that sampled each model token, :data:`NOT_SAMPLED` (-1) on
    tool/template tokens; None when the engine tracks no versions. ``policy_version`` is the
    oldest version of any token (verl's ``min_global_steps``), :attr:`max_policy_version` the
    newest (``max_global_steps``).

    Vision-language samples: ``multi_modal_inputs`` is their ``MultiModalInputs`` (the
    images and the processor's ``pixel_values`` / ``image_grid_thw`` for the image tokens of
    ``prompt_ids`` and ``response_ids``, in order; see :mod:`pipeline.multimodal`); None
    without images.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    uid: str
    group_id: str
    index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float] | None = None
    reward: float | None = None
    reward_payload: dict[str, Any] = Field(default_factory=dict)
    status: Status
    finish_reason: FinishReason
    raw_finish_reason: str | None = None
    masked: bool = False
    exit_reason: str
    error: str | None = None
    policy_version: int | None = None
    routed_experts: Any = None
    tool_turns: int = 0
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    token_versions: list[int] | None = None
    multi_modal_inputs: Any = None

    @field_serializer("multi_modal_inputs", when_used="json")
    def _images_as_summary(self, value: Any) -> Any:
        """In JSON (dumps, wire forms) each image is its hash, size and token count."""
        return None if value is None else value.summary()

    @property
    def max_policy_version(self) -> int | None:
        """The newest weight version that sampled a token of this sample (None: untracked)."""
        if self.token_versions:
            newest = max(self.token_versions)
            if newest != NOT_SAMPLED:
                return newest
        return self.policy_version

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, value: float | None) -> float | None:
        # A NaN or infinite reward would reach the loss and turn batch means into NaN.
        if value is not None and not math.isfinite(value):
            raise ValueError(f"reward must be a finite number, got {value}")
        return value


class BatchStats(BaseModel):
    """Aggregate figures of one batch (see :func:`pipeline.compute_stats`)."""

    num_samples: int
    by_status: dict[str, int]
    by_finish_reason: dict[str, int]
    by_exit_reason: dict[str, int]
    tool_turns_mean: float
    tool_turns_min: int
    tool_turns_max: int
    reward_mean: float | None
    reward_std: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_p99_s: float | None
    latency_max_s: float | None
    prompt_tokens: int
    response_tokens: int
    model_tokens: int
    tool_calls: int = 0
    tool_errors: int = 0
    template_drift: int = 0
    limiter_wait_s: float = 0.0
    token_integrity: dict[str, int] = Field(default_factory=dict)
    """Samples quarantined by a live token-integrity check, by the check's reason
    (``decode``, ``logprobs``, ``prefix``); empty when none was."""
    ignored_fields: dict[str, int] = Field(default_factory=dict)
    """Samples whose agent sent request fields the proxy accepted with no effect, by field
    path (``user``, ``text.verbosity``; from ``extra_fields["ignored_fields"]``, which
    :class:`~pipeline.proxy.RemoteAgent` sets); empty outside the proxy."""
    tool_resources: dict[str, float] = Field(default_factory=dict)
    """Per-trajectory tool resources (``ResourceTool``, MCP servers per trajectory, warm
    pools), summed over samples from their ``extra_fields``: ``samples`` (that held one),
    ``warm`` (taken ready from a pool), ``create_failures``, ``create_wait_s``; empty when no
    sample held one."""
    wall_time_s: float
    skipped_values: dict[str, int] = Field(default_factory=dict)
    """Counter artifacts left out of the sums, by key: not a number, not finite, negative
    or beyond 2**53 (a custom stage's bug must not cost the batch its statistics)."""
    error: str | None = None
    """Set when the statistics could not be computed at all; the counts are then partial."""


class ProduceBatchResult(BaseModel):
    """What :meth:`pipeline.Pipeline.run_batch` returns: samples and items in input order."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    samples: list[RolloutSample]
    items: list[AgentRolloutItem]
    stats: BatchStats

    def __repr__(self) -> str:
        # Short on purpose: asyncio on Python 3.11 formats the main task's result with repr()
        # when asyncio.run() returns, and a full repr of a big batch costs seconds.
        return (
            f"ProduceBatchResult(samples={len(self.samples)}, "
            f"by_status={self.stats.by_status}, wall_time_s={self.stats.wall_time_s:.3f})"
        )
