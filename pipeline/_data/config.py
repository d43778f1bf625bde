"""Value objects that configure sampling and the pipeline.

Both are pydantic models with ``extra="forbid"``, so a typo in a YAML/Hydra config is an error
naming the field instead of a silently ignored key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from pipeline._exceptions import ConfigError


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One readable line per invalid field: ``field 'sampling.top_p': Input should be ...``."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        where = f"{prefix}.{loc}" if prefix and loc else (prefix or loc)
        parts.append(f"field '{where}': {err['msg']} (got {err.get('input')!r:.80})")
    return "; ".join(parts)


def config_error(exc: ValidationError, prefix: str = "") -> ConfigError:
    """A :class:`ConfigError` for ``exc``, its ``field`` the first invalid one (a prefix such
    as ``"row 3: sampling"`` names it in the message; the field is ``sampling.<name>``)."""
    errors = exc.errors(include_url=False)
    loc = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
    base = prefix.rpartition(": ")[2]
    field = f"{base}.{loc}" if base and loc else (base or loc or None)
    return ConfigError(describe_validation_error(exc, prefix), field=field)


class _RaisesConfigError(BaseModel):
    """Constructing from keywords raises :class:`ConfigError` (a ``PipelineError``), not
    pydantic's ``ValidationError``, as every other entry point does."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error(exc) from None

    # Nested fields (``PipelineConfig.sampling``) keep pydantic's own validation path.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    _bool_fields: ClassVar[frozenset[str]] = frozenset()

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic reads True as 1: ``max_concurrency=True`` is a mistake, not a choice.
        if isinstance(value, bool) and info.field_name not in cls._bool_fields:
            raise ValueError("must be a number, not a bool")
        return value


class SamplingParams(_RaisesConfigError):
    """How the engine samples, per turn and across the whole trajectory.

    ``max_tokens`` caps one generation (one assistant turn); ``max_response_tokens`` caps the
    whole response of a multi-turn trajectory (model tokens plus tool/template tokens), which is
    what the trainer's ``max_response_len`` sees. ``n`` is the number of rollouts per prompt.
    Stops are token ids, never strings: the pipeline never re-tokenizes model output.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_tokens: int = Field(512, gt=0)
    max_response_tokens: int | None = Field(None, gt=0)
    stop_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    seed: int | None = None
    n: int = Field(1, ge=1)

    def with_overrides(
        self, overrides: dict[str, Any], *, where: str = "sampling"
    ) -> SamplingParams:
        """Return a copy with ``overrides`` applied and validated.

        Raises:
            ConfigError: an override names an unknown field or has an invalid value.
        """
        if not overrides:
            return self
        try:
            return SamplingParams.model_validate({**self.model_dump(), **overrides})
        except ValidationError as exc:
            raise config_error(exc, where) from None


RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
})
"""``apply_chat_template`` arguments the pipeline sets itself: not template options."""


def check_template_kwargs(value: dict[str, Any]) -> dict[str, Any]:
    """Chat-template options (``enable_thinking``, ``reasoning_effort``, ...), validated as a
    dict already: identifier names only, and none the pipeline passes itself.

    Raises:
        ValueError: naming the bad key (pydantic turns it into a field error).
    """
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"option name {key!r} is not an identifier")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"option {key!r} is set by the pipeline itself, not a template "
                             "option")
    return value


class AdaptiveConcurrency(_RaisesConfigError):
    """Adaptive concurrency (``PipelineConfig.adaptive_concurrency``, opt-in): the number of
    samples admitted follows the engine's own load (its waiting queue, preemptions, KV-cache
    use) between ``min_concurrency`` and ``max_concurrency``, starting from the pipeline's
    ``max_concurrency``. The rule is in :mod:`pipeline._runner.adaptive`; an engine without load
    signals keeps the fixed limit.

    Attributes:
        min_concurrency: the limit never goes below this.
        max_concurrency: the limit never goes above this.
        kv_high: below this KV-cache use (0..1], with running sequences under the
            engine's cap and no preemption, the engine has room: its waiting queue is
            requests in transit, and the limit grows.
        queue_target: once the engine is full, the limit steers to this many queued
            sequences per running one (a short queue keeps the engine full as sequences
            finish and samples come back from tools; a long one only adds waiting).
        preempt_high: shrink when the engine preempts more than this many sequences per
            running sequence per turnover (how long a sample holds its slot): its KV cache
            thrashes, each sequence recomputed again and again. A few preemptions are how
            an engine fills its KV cache, not a reason to shrink.
        interval_s: how often the engine's load is read.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_concurrency: int = Field(4, gt=0)
    max_concurrency: int = Field(8192, gt=0)
    kv_high: float = Field(0.95, gt=0.0, le=1.0)
    queue_target: float = Field(1.0, gt=0.0)
    preempt_high: float = Field(2.0, gt=0.0)
    interval_s: float = Field(0.1, gt=0)

    @field_validator("max_concurrency")
    @classmethod
    def _bounds(cls, value: int, info: ValidationInfo) -> int:
        low = info.data.get("min_concurrency")
        if low is not None and value < low:
            raise ValueError(f"must be >= min_concurrency ({low})")
        return value


class PipelineConfig(_RaisesConfigError):
    """Options of a :class:`pipeline.Pipeline`; build from Python or from a plain dict.

    Attributes:
        sample_timeout_s: per-sample deadline, counted from when the sample starts running
            (not while it waits for a concurrency slot, nor for the event loop's turn
            before its first stage when the loop is saturated). ``None`` disables it.
        max_concurrency: samples running at once: fixed, or where adaptive concurrency
            starts (``adaptive_concurrency``).
        cleanup_timeout_s: limit for each stage's ``cleanup`` and the sample's exit stack.
        seed: base seed; every sample gets its own seed derived from it.
        pad_token_id: used when the tokenizer has none (and by the last-resort failure output).
        progress_log_s: log a ``batch_heartbeat`` line (done, running, samples per stage,
            oldest running sample, rate, ETA) this often while a batch runs; None: never.
        sampling: default sampling parameters; rows may override them.
        chat_template_kwargs: options every rendering passes to the chat template (e.g.
            ``{"enable_thinking": False}`` for Qwen3, ``{"reasoning_effort": "low"}`` for
            gpt-oss); a row's own ``chat_template_kwargs`` override them key by key.
        token_integrity_checks: check every turn's tokens live (ids decode to the text the
            agent saw, one logprob per sampled token, each prompt extends the previous turn)
            and quarantine a sample that fails one (``failed``, masked, the reason in its
            error and in ``BatchStats.token_integrity``). False turns the checks off.
        stage_timeout_s: a time budget per stage name (seconds for one run of that stage;
            a stage object's own ``stage_timeout_s`` attribute wins). A stage that runs past
            it ends its sample ``timeout``, the error naming the stage and its budget.
        stuck_stage_s: a sample that has spent longer than this in one stage counts as
            stuck (the progress line's ``stuck``, the dumps); None: no stuck gauge.
        max_consecutive_engine_errors: circuit breaker: after this many samples in a row
            failed on an engine error, no new sample is admitted and ``run_batch`` raises
            :class:`~pipeline.EngineCircuitOpen` naming the engine and the last errors.
            None: off.
        adaptive_concurrency: who sets the number of samples admitted. An
            :class:`AdaptiveConcurrency`: the engine's own load, where the engine tells it
            (``load()`` with a KV-cache use or a running cap: vLLM in-process or behind its
            server, the simulated engine's capacity model), from ``max_concurrency`` within
            its bounds; elsewhere ``max_concurrency`` is fixed. False: ``max_concurrency`` is
            fixed whatever the engine. None (the default): fixed for now; it becomes "adapt
            where the engine tells its load" once adaptive concurrency meets its goal on
            every benchmark shape (``docs/guides/flow-control.md``): pass False to keep a
            fixed limit then.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    _bool_fields: ClassVar[frozenset[str]] = frozenset({"token_integrity_checks",
                                                        "adaptive_concurrency"})

    sample_timeout_s: float | None = Field(600.0, gt=0)
    max_concurrency: int = Field(256, gt=0)
    cleanup_timeout_s: float = Field(10.0, gt=0)
    seed: int = 0
    pad_token_id: int | None = Field(None, ge=0)
    progress_log_s: float | None = Field(60.0, gt=0)
    sampling: SamplingParams = SamplingParams()
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    token_integrity_checks: bool = True
    stage_timeout_s: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    stuck_stage_s: float | None = Field(300.0, gt=0)
    max_consecutive_engine_errors: int | None = Field(None, gt=0)
    adaptive_concurrency: AdaptiveConcurrency | Literal[False] | None = None

    @field_validator("adaptive_concurrency", mode="before")
    @classmethod
    def _adaptive(cls, value: Any) -> Any:
        # Checked here rather than by the union, whose errors name its members
        # ("adaptive_concurrency.literal[False]") instead of the setting.
        if value is None or value is False or isinstance(value, AdaptiveConcurrency):
            return value
        if isinstance(value, Mapping):
            try:
                return AdaptiveConcurrency.model_validate(value)
            except ValidationError as exc:
                raise ValueError(describe_validation_error(exc, "adaptive_concurrency")) from None
        raise ValueError("must be AdaptiveConcurrency(...) (adapt to the engine's load, "
                         "within these bounds), False (a fixed max_concurrency) or None (the "
                         "default: fixed for now)")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_template_kwargs(value)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PipelineConfig:
        """Build from a plain dict (Hydra/YAML); unknown or invalid fields raise ConfigError."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise config_error(exc) from None


def merge_config(
    config: PipelineConfig | Mapping[str, Any] | None, options: dict[str, Any]
) -> PipelineConfig:
    """``config`` (a PipelineConfig, a dict or None) with ``options`` on top, validated.

    Raises:
        ConfigError: an invalid or unknown field, named.
    """
    if isinstance(config, PipelineConfig):
        base = config.model_dump()
    elif config is None:
        base = {}
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        raise ConfigError(f"config must be a PipelineConfig or a dict, got {type(config).__name__}",
                          field="config")
    try:
        return PipelineConfig.model_validate({**base, **options})
    except ValidationError as exc:
        raise config_error(exc) from None


def check_count(value: object, field: str, minimum: int, *, maximum: int | None = None,
                optional: bool = False) -> None:
    """Refuse a count that is not an int in ``[minimum, maximum]`` (``None`` only when
    ``optional``). A bool is not a count: ``True`` is refused, not read as 1.

    Raises:
        ConfigError: naming ``field``.
    """
    if value is None and optional:
        return
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        none = " or None" if optional else ""
        raise ConfigError(f"field '{field}': must be an int {bounds}{none}, got {value!r:.60}",
                          field=field)
