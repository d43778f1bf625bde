"""The exceptions the library raises.

Every error the library raises on purpose derives from :class:`PipelineError`::

    PipelineError
    ├── ConfigError          invalid PipelineConfig / SamplingParams / Pipeline argument
    │                        (also a ValueError; ``.field`` names the field)
    ├── RowError             a dataset row that does not fit the row schema
    ├── StageDefinitionError something in a stage list that is not a stage
    ├── EngineError          an engine failed to generate (foreign errors translated here)
    ├── ContractError        data that breaks a trainer-facing contract
    │   └── TokenIntegrityError  a turn's ids, text, logprobs or prefix disagree (the
    │                        sample is quarantined: ends failed, masked)
    ├── AddressInUseError    a server port stayed busy after the bind retries
    ├── RateLimitError       (pipeline.ratelimit) LimiterClosed, LimiterConflict
    ├── DiagnosticsError     (pipeline.diagnostics) a dump or watchdog could not be set up
    ├── JudgeError           (pipeline.judgers) JudgerTimeout, WorkerError
    ├── CalculatorError      (pipeline.tools) an expression the calculator refuses
    ├── ProxyError           (pipeline.proxy) RemoteAgentError, session and request errors
    ├── SampleAborted        raised by a stage to end its sample as aborted (not failed)
    ├── DeadlineExceeded     raised by the runner at a stage boundary once the sample's
    │                        deadline passed (the sample ends ``timeout``)
    ├── StageTimeout         a stage ran past its own budget (``stage_timeout_s``; the
    │                        sample ends ``timeout``, the error names the stage)
    └── EngineCircuitOpen    ``run_batch``: the circuit breaker stopped the batch after N
                             samples in a row failed on engine errors (``.result`` holds
                             every sample, each with its status)

Errors raised inside stages by user code are not wrapped: the sample runner records them on
the sample (``status=failed``) and the batch goes on.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigError(PipelineError, ValueError):
    """An invalid configuration value or argument; the message names the field.

    Attributes:
        field: dotted name of the offending field or argument (``"sample_timeout_s"``,
            ``"sampling.top_p"``, ``"engine"``), if known.
    """

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class RowError(PipelineError, ValueError):
    """A dataset row that does not fit the row schema; names the row and the field.

    Attributes:
        row_index: position of the row in its source (0-based), if known.
        field: dotted name of the offending field.
    """

    def __init__(self, message: str, *, row_index: int | None = None, field: str | None = None):
        super().__init__(message)
        self.row_index = row_index
        self.field = field


class StageDefinitionError(PipelineError, TypeError):
    """An object in a stage list that cannot run as a stage."""


class EngineError(PipelineError):
    """An engine could not generate; the original exception is the ``__cause__``."""


class ContractError(PipelineError):
    """Data that violates a contract with the trainer (e.g. misaligned logprobs)."""


class TokenIntegrityError(ContractError):
    """A live token-integrity check failed: the sample is quarantined (ends ``failed``,
    masked) with the reason. See :mod:`pipeline._text.integrity`.

    Attributes:
        reason: ``decode``, ``logprobs`` or ``prefix``.
        turn: the turn (0-based) whose check failed.
        detail: what differed, and where (positions).
    """

    def __init__(self, reason: str, turn: int, detail: str) -> None:
        super().__init__(f"token integrity: {reason}: turn {turn}: {detail}")
        self.reason = reason
        self.turn = turn
        self.detail = detail


class AddressInUseError(PipelineError, OSError):
    """A server could not bind its address after retrying; names host, port and attempts."""


class SampleAborted(PipelineError):
    """Raise from a stage to end the sample with ``status=aborted, finish_reason=abort``.

    For work stopped on purpose (the engine aborted the request, the trainer paused), which
    is neither the sample's fault nor the model's.
    """


class DeadlineExceeded(PipelineError):
    """The sample's deadline passed; raised by the runner at a stage boundary.

    The deadline's cancellation reaches a stage that is awaiting; a stage that swallows it
    and returns, or that blocks the event loop past the deadline, is caught here instead:
    the runner checks the clock when a stage returns and before the next one starts, never
    starts a stage after the deadline, and ends the sample ``timeout`` either way.
    """


class StageTimeout(PipelineError):
    """A stage ran past its own time budget (``PipelineConfig.stage_timeout_s`` or the
    stage's ``stage_timeout_s`` attribute); the sample ends ``timeout``.

    Attributes:
        stage: the stage's name.
        budget_s: its budget in seconds.
    """

    def __init__(self, stage: str, budget_s: float, detail: str = "") -> None:
        super().__init__(f"stage '{stage}' ran past its budget stage_timeout_s={budget_s}s"
                         f"{detail}")
        self.stage = stage
        self.budget_s = budget_s


class EngineCircuitOpen(PipelineError):
    """The circuit breaker opened: ``max_consecutive_engine_errors`` samples in a row failed
    on engine errors, so the batch admitted no more samples.

    Attributes:
        engine: the engine's name (its type, and the server when the error named one).
        count: samples in a row that failed on engine errors.
        last_errors: the last errors, newest last.
        result: the batch's :class:`~pipeline.ProduceBatchResult` (every sample, with its
            status: those never admitted end ``failed`` with this error), when raised by
            ``run_batch``; else None.
    """

    def __init__(self, engine: str, count: int, last_errors: list[str],
                 result: object = None) -> None:
        shown = "; ".join(last_errors[-3:])
        super().__init__(f"circuit breaker open: {count} samples in a row failed on engine "
                         f"errors from {engine}; no new sample is admitted. Last errors: "
                         f"{shown}")
        self.engine = engine
        self.count = count
        self.last_errors = last_errors
        self.result = result
