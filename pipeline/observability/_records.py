"""Building one dump line from a finished sample (its item and its trainer view).

The line is built as plain dicts and lists (no model round trip) so writing keeps up with
large batches; :class:`~pipeline.observability._schema.TrajectoryRecord` reads it back.
Building never fails on odd artifact values: anything JSON cannot hold is converted
(numpy arrays to lists, unknown objects to their ``repr``).
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic_core
from pydantic import BaseModel

from pipeline import artifacts as A
from pipeline._data.models import AgentRolloutItem, RolloutSample, StageRecord
from pipeline._text.tokenizer import Tokenizer
from pipeline.multimodal import has_images, without_image_bytes

COUNTER_KEYS = ("tool_calls", "tool_errors", "template_drift", "limiter_wait_s")
"""Artifact keys read as per-sample counters (dumped under ``counters``, summed in metrics).

``tool_calls``/``tool_errors``/``template_drift`` are what ``CallTools`` counts (calls
answered, calls answered with an error, tool turns whose template rendering drifted);
``limiter_wait_s`` is seconds a sample waited on rate limiters. Each may hold a number, a
bool, or a list/dict (counted by its length).
"""


def trajectory_record(item: AgentRolloutItem, sample: RolloutSample, *,
                      tokenizer: Tokenizer | None = None, include_token_ids: bool = False,
                      step: int | None = None, batch_id: str | None = None) -> dict[str, Any]:
    """The dump line of one finished sample, as a JSON-ready dict.

    Args:
        item: the finished item (records, artifacts, row, timings).
        sample: its trainer view (status, reward, token arrays).
        tokenizer: decodes the response into ``response``; without one it is None.
        include_token_ids: add the token arrays (``tokens``) and keep each assistant
            message's ``token_ids``/``logprobs``; otherwise messages carry ``num_tokens``.
        step: the trainer step of the batch.
        batch_id: the id of the batch's summary line.

    Returns:
        A dict that ``json.dumps(..., default=jsonable)`` turns into one line.
    """
    prompt = [dict(m) for m in item.data.messages]
    conversation = [_message(m, include_token_ids) for m in item.artifacts.get(A.MESSAGES) or ()]
    if has_images(prompt):  # a record keeps an image's hash and size, never its bytes
        rendered = conversation[:len(prompt)]  # BuildPrompt put references in their place
        prompt = (rendered if len(rendered) == len(prompt)
                  else [without_image_bytes(m) for m in prompt])
    offset = len(prompt) if _starts_with(conversation, prompt) else 0
    line: dict[str, Any] = {
        "type": "sample", "batch_id": batch_id, "step": step,
        "uid": item.uid, "group_id": item.group_id, "index": item.index,
        "sample_index": item.sample_index, "data_source": item.data.data_source,
        "status": _value(sample.status), "finish_reason": _value(sample.finish_reason),
        "raw_finish_reason": sample.raw_finish_reason, "exit_reason": sample.exit_reason,
        "error": sample.error, "error_stage": item.error_stage, "masked": sample.masked,
        "prompt": prompt, "raw_prompt": item.artifacts.get(A.RAW_PROMPT),
        "response": _decode(tokenizer, sample.response_ids),
        "prompt_len": len(sample.prompt_ids), "response_len": len(sample.response_ids),
        "model_tokens": int(sum(sample.response_mask)),
        "reward": sample.reward, "reward_payload": sample.reward_payload,
        "agent": {"messages": conversation[offset:], "offset": offset,
                  "tools": item.data.tools, "tool_turns": sample.tool_turns},
        "records": [stage_timing(r) for r in item.records],
        "queued_at": _round(item.queued_at), "started_at": _round(item.started_at),
        "ended_at": _round(item.ended_at), "policy_version": sample.policy_version,
    }
    counters = {key: counter_value(item.artifacts[key])
                for key in COUNTER_KEYS if key in item.artifacts}
    if counters:
        line["counters"] = counters
    if sample.extra_fields:
        line["extra_fields"] = sample.extra_fields
    if include_token_ids:
        line["tokens"] = {"prompt_ids": list(sample.prompt_ids),
                          "response_ids": list(sample.response_ids),
                          "response_mask": list(sample.response_mask),
                          "logprobs": None if sample.logprobs is None else list(sample.logprobs)}
    return line


def minimal_record(item: AgentRolloutItem, sample: RolloutSample | None, error: str, *,
                   step: int | None = None, batch_id: str | None = None) -> dict[str, Any]:
    """A stand-in line from fields that cannot fail, used when the full line could not be built.

    Args:
        item: the finished item.
        sample: its trainer view, if there is one.
        error: why the full line failed; dumped as ``dump_error``.
        step: the trainer step of the batch.
        batch_id: the id of the batch's summary line.
    """
    status = sample.status if sample is not None else item.status
    finish = sample.finish_reason if sample is not None else item.finish_reason
    return {"type": "sample", "batch_id": batch_id, "step": step, "uid": str(item.uid),
            "group_id": str(item.group_id), "index": item.index,
            "status": _value(status) or "failed", "finish_reason": _value(finish) or "error",
            "error": item.error, "dump_error": error}


def stage_timing(record: StageRecord) -> dict[str, Any]:
    """The dump form of one :class:`StageRecord` (``None`` fields left out)."""
    out: dict[str, Any] = {"name": record.name, "start": _round(record.start),
                           "start_wall": _round(record.start_wall),
                           "status": _value(record.status)}
    if record.phase != "run":
        out["phase"] = record.phase
    for key, value in (("turn", record.turn), ("end", _round(record.end)),
                       ("error_type", record.error_type),
                       ("error_message", record.error_message)):
        if value is not None:
            out[key] = value
    return out


def counter_value(value: Any) -> float:
    """A counter artifact as a number: numbers as they are, bools 0/1, containers by length."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, Mapping | Sequence) and not isinstance(value, str | bytes):
        return float(len(value))
    return 1.0 if value else 0.0


def jsonable(obj: Any) -> Any:
    """``json.dumps`` fallback: numpy arrays and scalars, models, enums, sets, else ``repr``."""
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):  # numpy arrays and scalars
        return tolist()
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, set | frozenset | tuple):
        return list(obj)
    if isinstance(obj, bytes):
        return obj.decode("utf-8", errors="replace")
    return repr(obj)


def dumps_line(line: Mapping[str, Any]) -> bytes:
    """One compact JSON line (UTF-8, newline-terminated).

    pydantic-core's serializer does the work (several times faster than ``json`` on token
    arrays); the standard library is the fallback for what it refuses (lone surrogates).
    """
    try:
        return pydantic_core.to_json(line, fallback=jsonable) + b"\n"
    except Exception:
        text = json.dumps(line, separators=(",", ":"), ensure_ascii=False, default=jsonable)
        return (text + "\n").encode("utf-8", errors="replace")


def _message(message: Any, include_token_ids: bool) -> dict[str, Any]:
    if isinstance(message, BaseModel):
        out = message.model_dump(mode="json", exclude_none=True)
    elif isinstance(message, Mapping):
        out = {k: v for k, v in message.items() if v is not None}
    else:
        return {"role": "unknown", "content": repr(message)}
    if not include_token_ids:
        token_ids = out.pop("token_ids", None)
        out.pop("logprobs", None)
        if token_ids is not None:
            out["num_tokens"] = len(token_ids)
    return out


def _starts_with(conversation: list[dict[str, Any]], prompt: list[dict[str, Any]]) -> bool:
    if len(conversation) < len(prompt):
        return False
    return all(c.get("role") == p.get("role") and c.get("content") == p.get("content")
               for c, p in zip(conversation, prompt, strict=False))


def _decode(tokenizer: Tokenizer | None, ids: Sequence[int]) -> str | None:
    if tokenizer is None:
        return None
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=False)
    except Exception:  # a tokenizer that cannot decode its own ids must not lose the line
        return None


def _value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _round(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return value
    return round(value, 6)
