"""Building the trainer view (:class:`RolloutSample`) from a finished item.

``fill_sample`` is DESIGN's ``FillState``: the default builder. ``minimal_sample`` is the last
resort when a builder raises: it needs nothing but a pad token id and cannot fail on the
item's artifacts, so a sample is never lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from pipeline import artifacts as A
from pipeline._concurrency.callables import plain_result
from pipeline._data.construct import construct, str_keys
from pipeline._data.models import (
    NOT_SAMPLED,
    AgentMessage,
    AgentRolloutItem,
    ExitReason,
    FinishReason,
    RolloutSample,
    Status,
    is_finite_number,
)
from pipeline._exceptions import ContractError
from pipeline._runner.context import Context
from pipeline._runner.outcome import force_end

_logger = structlog.get_logger("pipeline")

_ERROR = ExitReason.ERROR.value
_validate_sample = RolloutSample.__pydantic_validator__.validate_python

SampleBuilder = Callable[[AgentRolloutItem, Context], RolloutSample]
"""Turns a finished item into its trainer view; pass your own to ``Pipeline(fill=...)``."""


def fill_sample(item: AgentRolloutItem, ctx: Context) -> RolloutSample:
    """Default builder: the trainer view from the built-in artifacts.

    Samples that did not complete are masked; their partial artifacts stay on the item for the
    dump. Response, mask and logprobs must be aligned.

    Raises:
        ContractError: misaligned response ids / mask / logprobs.
    """
    art = item.artifacts
    status = item.status or Status.FAILED
    # Only iterables that are not lists are copied here (see _already_valid).
    response_ids: list[int] = _as_list(art.get(A.RESPONSE_IDS, ()))
    mask: list[int] = _as_list(art.get(A.RESPONSE_MASK, ()))
    logprobs_raw = art.get(A.LOGPROBS)
    logprobs: list[float] | None = None if logprobs_raw is None else _as_list(logprobs_raw)
    if len(mask) != len(response_ids):
        raise ContractError(
            f"sample {item.uid}: response_mask has {len(mask)} entries for "
            f"{len(response_ids)} response tokens"
        )
    if logprobs is not None and len(logprobs) != len(response_ids):
        raise ContractError(
            f"sample {item.uid}: logprobs has {len(logprobs)} entries for "
            f"{len(response_ids)} response tokens"
        )
    versions_raw = art.get(A.TOKEN_VERSIONS)
    versions: list[int] | None = None if versions_raw is None else _as_list(versions_raw)
    if versions is not None and len(versions) < len(response_ids):
        # Tokens appended after the last model turn (a tool's output, the sample ended or
        # was cut short before the next turn) were sampled by no policy.
        versions = [*versions, *[NOT_SAMPLED] * (len(response_ids) - len(versions))]
    if versions is not None and len(versions) != len(response_ids):
        raise ContractError(
            f"sample {item.uid}: token_versions has {len(versions)} entries for "
            f"{len(response_ids)} response tokens"
        )
    masked = status is not Status.COMPLETED
    reward = art.get(A.REWARD)
    if reward is not None and not is_finite_number(reward):
        raise ContractError(f"sample {item.uid}: reward is not a finite number: {reward!r}")
    values = {
        "uid": item.uid,
        "group_id": item.group_id,
        "index": item.index,
        "prompt_ids": _as_list(art.get(A.PROMPT_IDS, ())),
        "response_ids": response_ids,
        "response_mask": [0] * len(mask) if masked else mask,
        "logprobs": logprobs,
        "reward": None if masked or reward is None else float(reward),
        "reward_payload": _as_dict(art.get(A.REWARD_PAYLOAD) or {}),
        "status": status,
        "finish_reason": item.finish_reason or FinishReason.ERROR,
        "raw_finish_reason": item.raw_finish_reason,
        "masked": masked,
        "exit_reason": item.exit_reason or _ERROR,
        "error": item.error,
        "policy_version": art.get(A.POLICY_VERSION),
        "routed_experts": art.get(A.ROUTED_EXPERTS),
        "tool_turns": int(art.get(A.TOOL_TURNS, 0)),
        "extra_fields": _as_dict(art.get(A.EXTRA_FIELDS) or {}),
        "token_versions": versions,
        # a vision-language sample's pixel inputs (pipeline.multimodal.MultiModalInputs)
        "multi_modal_inputs": getattr(art.get(A.MULTI_MODAL), "inputs", None) or None,
    }
    if _already_valid(values):
        return construct(RolloutSample, values)
    return _validate_sample(values)  # type: ignore[no-any-return]  # RolloutSample(...)'s core


def _already_valid(values: dict[str, Any]) -> bool:
    """Whether ``values`` are exactly what validating a :class:`RolloutSample` would produce:
    plain ints, floats and strings of the field types, dicts keyed by strings. Then the
    sample shares the item's lists instead of copying them (validation copies every list:
    a third of a finished sample's memory, and four lists and a field set more for the
    collector to walk for as long as the batch's result lives). Anything else (a bool or a
    numpy int among the ids, a tuple, a plain-string finish reason) takes the validating
    path, as before."""
    return (
        type(values["uid"]) is str and type(values["group_id"]) is str
        and type(values["index"]) is int
        and _only(values["prompt_ids"], int) and _only(values["response_ids"], int)
        and _only(values["response_mask"], int)
        and (values["logprobs"] is None or _only(values["logprobs"], float))
        and (values["token_versions"] is None or _only(values["token_versions"], int))
        and str_keys(values["reward_payload"]) and str_keys(values["extra_fields"])
        and type(values["status"]) is Status and type(values["finish_reason"]) is FinishReason
        and type(values["exit_reason"]) is str
        and type(values["raw_finish_reason"]) in _OPTIONAL_STR
        and type(values["error"]) in _OPTIONAL_STR
        and type(values["policy_version"]) in _OPTIONAL_INT
    )


_OPTIONAL_STR = (str, type(None))
_OPTIONAL_INT = (int, type(None))


def _only(values: list[Any], kind: type) -> bool:
    # The element types collected in C: about what validating the list costs, without its
    # copy.
    return type(values) is list and set(map(type, values)) <= {kind}


def _as_list(values: Any) -> list[Any]:
    return values if type(values) is list else list(values)


def _as_dict(values: Any) -> dict[Any, Any]:
    return values if type(values) is dict else dict(values)


def share_turn_lists(item: AgentRolloutItem, sample: RolloutSample) -> None:
    """Let a finished single-turn sample's assistant message hold the response's lists.

    Its ``token_ids`` and ``logprobs`` then are the very lists of ``response_ids`` and
    ``logprobs`` (the item's, shared by the sample), where they held equal copies: two
    lists less per kept sample for the collector to walk, about 1 KB less at 64 tokens.
    Only when the sample shares the item's lists (the default builder) and the values are
    equal; for a sample whose stages have all returned (nothing appends to them any more).
    """
    art = item.artifacts
    response, logprobs = art.get(A.RESPONSE_IDS), art.get(A.LOGPROBS)
    messages = art.get(A.MESSAGES)
    if (sample.response_ids is not response or sample.logprobs is not logprobs
            or type(messages) is not list):
        return
    turns = [m for m in messages if type(m) is AgentMessage and m.role == "assistant"]
    if len(turns) != 1:
        return
    fields = turns[0].__dict__
    if (type(fields.get("token_ids")) is list and fields["token_ids"] == response
            and type(fields.get("logprobs")) is list and fields["logprobs"] == logprobs):
        fields["token_ids"], fields["logprobs"] = response, logprobs


def minimal_sample(item: AgentRolloutItem, pad_token_id: int, error: str) -> RolloutSample:
    """Last-resort trainer view: fully masked, built from the pad token id alone.

    Infallible: every field read from the item is checked and replaced when a stage left it
    wrongly typed (a raw finish reason that is not a string, token ids whose ``len()``
    raises, a uid that is not a string).
    """
    pad = pad_token_id if _is_int(pad_token_id) else 0
    prompt_ids = _int_list(_safe(lambda: item.artifacts.get(A.PROMPT_IDS))) or [pad]
    raw = _safe(lambda: item.raw_finish_reason)
    index = _safe(lambda: item.index)
    return RolloutSample(
        uid=_as_text(_safe(lambda: item.uid)),
        group_id=_as_text(_safe(lambda: item.group_id)),
        index=index if _is_int(index) else 0,
        prompt_ids=prompt_ids,
        response_ids=[pad],
        response_mask=[0],
        logprobs=[0.0],
        reward=None,
        reward_payload={},
        status=Status.FAILED,
        finish_reason=FinishReason.ERROR,
        raw_finish_reason=raw if isinstance(raw, str) else None,
        masked=True,
        exit_reason=ExitReason.BUILD_FAILED.value,
        error=_as_text(error),
        policy_version=None,
        routed_experts=None,
        tool_turns=0,
        extra_fields={},
    )


def _safe(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except Exception:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return repr(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def _int_list(value: Any) -> list[int] | None:
    """``value`` as a list of ints, or None when it is anything else (or cannot be read)."""
    try:
        ids = list(value)
    except Exception:
        return None
    return ids if ids and all(_is_int(v) for v in ids) else None


def build_sample(fill: SampleBuilder, item: AgentRolloutItem, ctx: Context,
                 pad_token_id: Callable[[], int]) -> RolloutSample:
    """The trainer view ``fill`` builds; never raises: falls back to a fully masked sample
    (from ``pad_token_id()``, else 0) if ``fill`` raises anything or returns something else
    than a :class:`RolloutSample`."""
    try:
        sample = plain_result(fill(item, ctx), "fill")
        if not isinstance(sample, RolloutSample):
            raise ContractError(f"fill returned {type(sample).__name__}, not a RolloutSample")
        return sample
    except BaseException as exc:  # a fill's SystemExit too: the sample stands in
        error = f"building the sample failed: {type(exc).__name__}: {exc}"
        if isinstance(item.error, str) and item.error:
            error = f"{item.error}; {error}"
        _logger.error("sample_build_failed", uid=_as_text(item.uid), error=error)
        force_end(item, Status.FAILED, error, ExitReason.BUILD_FAILED)
        try:
            pad = pad_token_id()
        except Exception:  # a tokenizer whose pad/eos properties raise
            pad = 0
        return minimal_sample(item, pad, error)
