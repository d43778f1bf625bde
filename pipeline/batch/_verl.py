"""Adapters to verl: ``AgentLoopOutput`` per sample and the agent loop's batch layout.

verl's trainer unions the rollout batch with its own input batch, so the output has the
input's size and order, and optional fields are all-or-none (see :func:`collate`). Our
``group_id`` is verl's per-prompt ``uid``. verl's classes are used when ``verl`` is importable;
otherwise plain dicts with the same names and shapes come back. The field-by-field table is in
``docs/trainer_mapping.md``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline import artifacts as A
from pipeline._exceptions import ConfigError
from pipeline._models import AgentRolloutItem, RolloutSample
from pipeline.batch._collate import check_alignment, collate, has_logprobs, has_rewards
from pipeline.batch._experts import as_routes, check_routed_experts, filled_routes

VERL_BATCH_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                   "position_ids")
"""Tensor keys every verl rollout batch has."""

VERL_OPTIONAL_KEYS = ("rollout_log_probs", "routed_experts", "rm_scores")
"""Tensor keys present for the whole batch or for none of it."""

STATUS_KEYS = ("rollout_status", "rollout_finish_reason", "rollout_masked", "rollout_overlong")
"""Non-tensor columns we add: how each sample ended (verl itself has no such notion)."""


def _verl_module(name: str, use_verl: bool | None) -> Any:
    if use_verl is False:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        if use_verl:
            raise
        return None


def _num_turns(sample: RolloutSample, item: AgentRolloutItem | None) -> int:
    """verl's ``num_turns``: chat messages (user, assistant, tool) of the trajectory."""
    if item is not None and item.artifacts.get(A.MESSAGES):
        return sum(1 for m in item.artifacts[A.MESSAGES] if getattr(m, "role", None) != "system")
    return 2 + 2 * sample.tool_turns  # user + assistant, then a tool and an assistant per round


def _metrics(item: AgentRolloutItem | None) -> dict[str, float]:
    """verl's ``AgentLoopMetrics``: seconds spent generating and calling tools."""
    generate = tools = 0.0
    for record in item.records if item is not None else ():
        if record.phase != "run" or record.duration is None:
            continue
        if record.name == "generate":
            generate += record.duration
        elif "tool" in record.name:
            tools += record.duration
    return {"generate_sequences": generate, "tool_calls": tools}


def _items(samples: Sequence[RolloutSample],
           items: Sequence[AgentRolloutItem] | None) -> list[AgentRolloutItem | None]:
    if items is None:
        return [None] * len(samples)
    if len(items) != len(samples):
        raise ConfigError(f"items has {len(items)} entries for {len(samples)} samples")
    return list(items)


def to_verl_outputs(
    samples: Sequence[RolloutSample],
    *,
    items: Sequence[AgentRolloutItem] | None = None,
    use_verl: bool | None = None,
) -> list[Any]:
    """One verl ``AgentLoopOutput`` per sample, in order, under the batch's all-or-none rules.

    Args:
        samples: the batch.
        items: the matching items (``run_batch(...).items``), for ``num_turns`` from the
            messages and ``metrics`` from the stage timings; without them ``num_turns`` is
            ``2 + 2 * tool_turns`` and the metrics are 0.
        use_verl: None: verl's ``AgentLoopOutput`` when importable, else dicts; False: dicts;
            True: verl's classes or ImportError.

    Returns:
        ``AgentLoopOutput`` objects or dicts with its fields: ``prompt_ids``,
        ``response_ids``, ``response_mask``, ``response_logprobs``, ``routed_experts``
        (``[prompt_len + response_len, num_layers, topk]``), ``multi_modal_data``,
        ``reward_score``, ``num_turns``, ``metrics``, ``extra_fields`` (the sample's own plus
        ``rollout_uid``, ``rollout_group_id`` and the :data:`STATUS_KEYS` but overlong).

    Raises:
        ContractError: the routed-experts rules, or an unmasked sample without logprobs or
            reward beside others that have them.
        ConfigError: ``items`` does not match ``samples`` in length.
    """
    check_alignment(samples)
    routes = [as_routes(s.routed_experts) for s in samples]
    layout = check_routed_experts(samples, routes)
    with_logprobs = has_logprobs(samples)
    with_reward = has_rewards(samples)
    module = _verl_module("verl.experimental.agent_loop.agent_loop", use_verl)
    outputs = []
    for sample, arr, item in zip(samples, routes, _items(samples, items), strict=True):
        fields: dict[str, Any] = {
            "prompt_ids": list(sample.prompt_ids),
            "response_ids": list(sample.response_ids),
            "response_mask": [0] * len(sample.response_mask) if sample.masked
            else list(sample.response_mask),
            "response_logprobs": None if not with_logprobs else (
                list(sample.logprobs) if sample.logprobs is not None
                else [0.0] * len(sample.response_ids)),
            "routed_experts": None if layout is None else filled_routes(sample, arr, layout),
            "multi_modal_data": None,
            "reward_score": None if not with_reward else (
                0.0 if sample.masked or sample.reward is None else float(sample.reward)),
            "num_turns": _num_turns(sample, item),
            "metrics": _metrics(item),
            "extra_fields": {**sample.extra_fields, "rollout_uid": sample.uid,
                             "rollout_group_id": sample.group_id,
                             "rollout_status": sample.status.value,
                             "rollout_finish_reason": sample.finish_reason.value,
                             "rollout_masked": sample.masked},
        }
        outputs.append(fields if module is None else _verl_output(module, fields))
    return outputs


def _verl_output(module: Any, fields: dict[str, Any]) -> Any:
    metrics_cls = module.AgentLoopMetrics
    known = set(getattr(metrics_cls, "model_fields", fields["metrics"]))
    metrics = metrics_cls(**{k: v for k, v in fields["metrics"].items() if k in known})
    output_cls = module.AgentLoopOutput
    names = set(getattr(output_cls, "model_fields", fields))
    return output_cls(**{k: v for k, v in {**fields, "metrics": metrics}.items() if k in names})


def to_verl_batch(
    samples: Sequence[RolloutSample],
    *,
    pad_token_id: int,
    max_prompt_len: int,
    max_response_len: int,
    items: Sequence[AgentRolloutItem] | None = None,
    uid_key: str | None = "uid",
    use_verl: bool | None = None,
) -> Any:
    """The batch verl's agent loop hands its trainer: a ``DataProto`` (or the same as dicts).

    Tensors come from :func:`collate` with ``pad_to="max"`` (verl's fixed
    ``prompt_length`` / ``response_length`` shapes).

    Args:
        samples: the batch, in the order of the trainer's input batch.
        pad_token_id / max_prompt_len / max_response_len: as for :func:`collate`.
        items: the matching items, for ``__num_turns__`` and the metrics (optional).
        uid_key: the non-tensor column that gets each sample's ``group_id`` (verl's GRPO
            groups by ``uid``); None leaves it out, for trainers whose input batch carries
            its own ``uid`` column (``DataProto.union`` refuses differing values).
        use_verl: as for :func:`to_verl_outputs`, with ``verl.protocol.DataProto``.

    Returns:
        ``DataProto.from_dict(tensors=..., non_tensors=..., meta_info=...)``, or a dict with
        the keys ``batch`` (torch tensors: :data:`VERL_BATCH_KEYS` and any
        :data:`VERL_OPTIONAL_KEYS`), ``non_tensor_batch`` (numpy arrays: ``__num_turns__``,
        the ``uid_key`` column, :data:`STATUS_KEYS`, ``reward_extra_info`` keys, each
        ``extra_fields`` key) and ``meta_info`` (``metrics`` per sample, ``num_overlong``,
        ``reward_extra_keys`` when ``rm_scores`` is present).

    Raises:
        ContractError, ConfigError: as :func:`collate` raises them.
    """
    tensors = collate(samples, pad_token_id=pad_token_id, max_prompt_len=max_prompt_len,
                      max_response_len=max_response_len, pad_to="max", return_tensors="pt")
    masked, overlong = tensors.pop("masked").numpy(), tensors.pop("overlong").numpy()
    rows = _items(samples, items)
    non_tensors: dict[str, np.ndarray] = {
        "__num_turns__": np.array([_num_turns(s, it) for s, it in zip(samples, rows,
                                                                      strict=True)],
                                  dtype=np.int32),
        "rollout_status": _objects([s.status.value for s in samples]),
        "rollout_finish_reason": _objects([s.finish_reason.value for s in samples]),
        "rollout_masked": masked,
        "rollout_overlong": overlong,
    }
    if uid_key is not None:
        non_tensors[uid_key] = _objects([s.group_id for s in samples])
    reward_keys = sorted({k for s in samples for k in s.reward_payload})
    for key in reward_keys:
        non_tensors.setdefault(key, _objects([s.reward_payload.get(key) for s in samples]))
    for key in sorted({k for s in samples for k in s.extra_fields}):
        non_tensors.setdefault(key, _objects([s.extra_fields.get(key) for s in samples]))
    meta_info: dict[str, Any] = {"metrics": [_metrics(it) for it in rows],
                                 "num_overlong": int(overlong.sum())}
    if "rm_scores" in tensors:
        meta_info["reward_extra_keys"] = reward_keys
    protocol = _verl_module("verl.protocol", use_verl)
    if protocol is not None:
        return protocol.DataProto.from_dict(tensors=tensors, non_tensors=non_tensors,
                                            meta_info=meta_info)
    return {"batch": tensors, "non_tensor_batch": non_tensors, "meta_info": meta_info}


def _objects(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out
