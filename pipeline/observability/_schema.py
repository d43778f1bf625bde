"""The trajectory dump's line types: the wire form a writer produces and a reader returns.

A dump is JSON Lines, one compact object per line, each with a ``type``. A batch is written
as a summary line, then one line per sample in the order the samples finished, then (when
the batch ended normally) a closing line with the batch's stats::

    {"type": "batch", "batch_id": "...", "step": 3, "started_wall": ..., ...}
    {"type": "sample", "batch_id": "...", "uid": "...", "status": "completed", ...}
    ...
    {"type": "batch_end", "batch_id": "...", "written": 64, "stats": {...}}

Several batches may follow each other in one file. A batch without its ``batch_end`` line
was cut short (the writer process died); every sample line before the cut is still whole.
Models allow extra keys, so a newer writer's dump still reads with an older reader.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic.dataclasses
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from pipeline._data.models import FinishReason, StageRecord, Status

SCHEMA_VERSION = 1
"""Version of the line format, written in every batch summary."""


@pydantic.dataclasses.dataclass(config=ConfigDict(extra="allow"), kw_only=True)
class StageTiming(StageRecord):
    """One stage run (or cleanup) of one sample, as dumped from its :class:`StageRecord`:
    the same fields by construction, validated when read, and fields a newer writer added
    are kept.

    ``start``/``end`` are the writer process's ``time.monotonic()`` seconds: comparable within
    a batch, not across processes; ``start_wall`` is the Unix time the stage started.
    """


class AgentTrace(BaseModel):
    """What the agent did: the conversation after the prompt, the tools it had, tool rounds.

    ``messages`` are ``AgentMessage.model_dump(mode="json")`` dicts (``None`` fields left
    out). Without token ids in the dump, assistant messages carry ``num_tokens`` instead of
    ``token_ids``/``logprobs``. ``offset`` is how many leading messages of the conversation
    are the record's ``prompt`` and were not repeated here.
    """

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]] = Field(default_factory=list)
    offset: int = 0
    tools: list[dict[str, Any]] | None = None
    tool_turns: int = 0


class TokenData(BaseModel):
    """The trainer-facing token arrays of a sample (only in dumps written with token ids)."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float] | None = None


class TrajectoryRecord(BaseModel):
    """One sample of a dump: how it ended, what the model said, and where the time went.

    Times ``queued_at``/``started_at``/``ended_at`` are monotonic seconds like the records';
    ``response`` is the decoded response (special tokens kept) when the writer had a
    tokenizer, else None. ``counters`` holds per-sample counters stages reported in artifacts
    (``template_drift``, ``tool_errors``, ``limiter_wait_s``) when present; ``extra_fields``
    is the sample's pass-through dict for the trainer.
    """

    model_config = ConfigDict(extra="allow")

    type: Literal["sample"] = "sample"
    batch_id: str | None = None
    step: int | None = None
    uid: str
    group_id: str
    index: int = 0
    sample_index: int = 0
    data_source: str | None = None
    status: Status
    finish_reason: FinishReason
    raw_finish_reason: str | None = None
    exit_reason: str | None = None
    error: str | None = None
    error_stage: str | None = None
    masked: bool = False
    prompt: list[dict[str, Any]] = Field(default_factory=list)
    raw_prompt: str | None = None
    response: str | None = None
    prompt_len: int = 0
    response_len: int = 0
    model_tokens: int = 0
    reward: float | None = None
    reward_payload: dict[str, Any] = Field(default_factory=dict)
    agent: AgentTrace = Field(default_factory=AgentTrace)
    records: list[StageTiming] = Field(default_factory=list)
    queued_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    policy_version: int | None = None
    counters: dict[str, float] = Field(default_factory=dict)
    extra_fields: dict[str, Any] = Field(default_factory=dict)
    tokens: TokenData | None = None
    dump_error: str | None = None
    """Set when the full line could not be built and a minimal one was written instead."""

    @property
    def latency_s(self) -> float | None:
        """Running time of the sample (excludes waiting for a concurrency slot, and for the
        event loop's turn before the first stage when the loop is saturated)."""
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at

    @property
    def queue_s(self) -> float | None:
        """Time the sample waited for a concurrency slot."""
        if self.queued_at is None or self.started_at is None:
            return None
        return self.started_at - self.queued_at

    def conversation(self) -> list[dict[str, Any]]:
        """The whole conversation: the prompt's leading messages, then the agent's."""
        return [*self.prompt[: self.agent.offset], *self.agent.messages]


class BatchSummary(BaseModel):
    """The line that opens a batch.

    ``started_wall``/``monotonic`` are one reading of both clocks, taken together, so the
    monotonic times of the batch's records map onto wall-clock time.
    """

    model_config = ConfigDict(extra="allow")

    type: Literal["batch"] = "batch"
    version: int = SCHEMA_VERSION
    batch_id: str
    step: int | None = None
    started_wall: float
    monotonic: float
    host: str | None = None
    pid: int | None = None
    python: str | None = None
    num_samples: int | None = None
    include_token_ids: bool = False
    meta: dict[str, Any] = Field(default_factory=dict)


class BatchEnd(BaseModel):
    """The line that closes a batch that ended normally."""

    model_config = ConfigDict(extra="allow")

    type: Literal["batch_end"] = "batch_end"
    batch_id: str
    step: int | None = None
    ended_wall: float
    monotonic: float
    written: int
    write_errors: int = 0
    stats: dict[str, Any] | None = None


DumpLine = Annotated[BatchSummary | TrajectoryRecord | BatchEnd, Field(discriminator="type")]
"""Any line of a dump, told apart by its ``type``."""

DUMP_LINE: TypeAdapter[BatchSummary | TrajectoryRecord | BatchEnd] = TypeAdapter(DumpLine)
"""Validates one line (``DUMP_LINE.validate_json(raw)``)."""
