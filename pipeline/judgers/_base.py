"""What a judger is, what it returns, and the errors of judging.

A judger is any object with ``async def judge(item) -> JudgeResult`` (a ``name`` attribute is
optional and names it in records). It reads the trajectory through the artifact keys of
:mod:`pipeline.artifacts` and the row (``item.data.ground_truth``, ``item.data.data_source``).

Errors::

    PipelineError
    ├── ConfigError
    │   └── JudgerRegistryError  duplicate name, unknown name (lists the known ones), a plugin
    │                            that fails to load, a config its factory does not accept
    └── JudgeError               judging failed; the Judge stage raises it to fail a sample
        ├── JudgerTimeout        (also a TimeoutError) a judge call ran past its limit
        └── WorkerError          a function in a worker process raised, crashed, or could not
                                 be sent there (not picklable / not importable)
"""

from __future__ import annotations

import math
from typing import Any, Final, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from pipeline import artifacts as A
from pipeline._data.models import AgentMessage, AgentRolloutItem
from pipeline._exceptions import ConfigError, PipelineError

JUDGE_RECORDS: Final = A.JUDGE_RECORDS
"""Artifact key: ``list[JudgerRecord]``, one per judger the ``Judge`` stage ran on the sample."""


class JudgerRegistryError(ConfigError):
    """A registry misuse: duplicate or unknown name, broken plugin, or rejected config."""


class JudgeError(PipelineError):
    """Judging failed. Raised by the ``Judge`` stage (``on_error="mask"``) to fail the sample.

    Attributes:
        payload: facts a failing judger wants kept in its record (e.g. the unparsable reply).
    """

    def __init__(self, message: str, *, payload: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.payload = payload or {}


class JudgerTimeout(JudgeError, TimeoutError):
    """A judge call ran past its time limit (a worker running it was killed)."""


class WorkerError(JudgeError):
    """A function run in a worker process raised, the worker died, or the call could not be sent.

    Attributes:
        remote_type: the exception's class name in the worker (None when the worker died).
        remote_traceback: the worker's formatted traceback, if any.
    """

    def __init__(self, message: str, *, remote_type: str | None = None,
                 remote_traceback: str | None = None) -> None:
        super().__init__(message, payload={"remote_type": remote_type} if remote_type else None)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class JudgeResult(BaseModel):
    """What a judger returns: a finite score and anything else worth keeping.

    Attributes:
        score: the judger's score (the ``Judge`` stage averages scores with weights).
        payload: extra facts for the trainer or the dump (extracted answer, test counts, ...).
    """

    model_config = ConfigDict(extra="forbid")

    score: float
    payload: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def coerce(cls, value: Any) -> JudgeResult:
        """Accept a ``JudgeResult``, a number/bool, or a dict with ``score`` (verl's convention).

        Raises:
            JudgeError: the value is none of these, or the score is not a finite number.
        """
        if isinstance(value, JudgeResult):
            result = value
        elif isinstance(value, bool | int | float):
            result = cls(score=float(value))
        elif isinstance(value, dict) and "score" in value:
            rest = {k: v for k, v in value.items() if k != "score"}
            score = value["score"]
            if not isinstance(score, bool | int | float):
                raise JudgeError(f"judger returned a non-numeric score: {score!r:.80}")
            result = cls(score=float(score), payload=rest)
        else:
            raise JudgeError(f"judger returned {type(value).__name__} {value!r:.80}; expected a "
                             f"JudgeResult, a number or a dict with 'score'")
        if not math.isfinite(result.score):
            raise JudgeError(f"judger returned a non-finite score: {result.score}")
        return result


@runtime_checkable
class Judger(Protocol):
    """Scores one finished trajectory.

    Judgers that hold resources (a process pool, a sandbox, an HTTP session) also provide
    ``async def aclose()``; the ``Judge`` stage calls it from its own ``aclose``.
    """

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        """Score ``item``; raise to report that judging itself failed."""
        ...


class JudgerRecord(BaseModel):
    """What one judger did on one sample, as the ``Judge`` stage records it.

    Attributes:
        name: the judger's name in this stage.
        weight: its weight in the sample's reward.
        status: ``ok``, ``error`` (it raised or returned garbage) or ``timeout``.
        score: the score it returned (None when it failed).
        applied_score: the score that entered the reward: ``score``, or ``failure_score``
            for a failure under ``on_error="score"``; None when the failure masked the sample.
        payload: the judger's payload.
        duration_s: wall time of the judge call.
        error_type / error: the failure, when there was one.
        policy: the failure policy that applied to this judger.
    """

    name: str
    weight: float
    status: Literal["ok", "error", "timeout"]
    score: float | None = None
    applied_score: float | None = None
    payload: dict[str, Any] = Field(default_factory=dict)
    duration_s: float
    error_type: str | None = None
    error: str | None = None
    policy: Literal["mask", "score"]


def response_text(item: AgentRolloutItem) -> str:
    """The answer to judge: the text of the last assistant message ("" when there is none).

    List-of-parts contents are joined from their ``text`` parts.
    """
    for message in reversed(item.artifacts.get(A.MESSAGES) or ()):
        role = message.role if isinstance(message, AgentMessage) else message.get("role")
        if role != "assistant":
            continue
        content = (message.content if isinstance(message, AgentMessage)
                   else message.get("content"))
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def question_text(item: AgentRolloutItem) -> str:
    """The text of the row's last user message (what the model was asked)."""
    for message in reversed(item.data.messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return "" if content is None else str(content)
    return ""


def ground_truths(ground_truth: Any) -> list[str]:
    """The accepted answers of a row's ``ground_truth`` (one value or a list), as text.

    Raises:
        JudgeError: the row has no ground truth.
    """
    if ground_truth is None:
        raise JudgeError("the row has no ground_truth to compare the answer with")
    items = ground_truth if isinstance(ground_truth, list | tuple) else [ground_truth]
    return [str(t) for t in items]
