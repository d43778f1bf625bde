"""Adapters to verl: ``AgentLoopOutput`` per sample and the agent loop's batch layout.

verl's trainer unions the rollout batch with its own input batch, so the output has the
input's size and order, and optional fields are all-or-none (see :func:`collate`). Our
``group_id`` is verl's per-prompt ``uid``. verl's classes are used when ``verl`` is importable;
otherwise plain dicts with the same names and shapes come back. The field-by-field table is in
``docs/trainer_mapping.md``.

verl 0.9.1 reads several things unguarded, so they are always there: the ``multi_modal_inputs``
column, every ``AgentLoopMetrics`` field, at least one response token per sample (its
``as_dict`` writes the score at ``rm_scores[-1]``), ``reward_extra_info`` with the same keys on
every sample, and a ``meta_info`` that is equal across workers (``DataProto.concat`` asserts it).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline import artifacts as A
from pipeline._data.models import AgentRolloutItem, RolloutSample
from pipeline._exceptions import ConfigError
from pipeline.batch._collate import check_alignment, collate, has_logprobs, has_rewards
from pipeline.batch._experts import as_routes, check_routed_experts, filled_routes
from pipeline.multimodal import mrope_position_ids

VERL_BATCH_KEYS = ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                   "position_ids")
"""Tensor keys every verl rollout batch has."""

VERL_OPTIONAL_KEYS = ("rollout_log_probs", "routed_experts", "rm_scores", "rollout_token_versions")
"""Tensor keys present for the whole batch or for none of it."""

STATUS_KEYS = ("rollout_status", "rollout_finish_reason", "rollout_masked", "rollout_overlong")
"""Non-tensor columns we add: how each sample ended (verl itself has no such notion)."""

VERL_WORKER_KEYS = ("multi_modal_inputs", "raw_prompt", "turn_scores", "tool_rewards", "extras",
                    "min_global_steps", "max_global_steps")
"""Non-tensor columns verl's own agent-loop workers always emit (None where we have nothing)."""

VERL_INPUTS = "verl"
"""Row ``extra`` key under which :func:`from_verl_batch` keeps verl's input columns."""

VERL_DTYPES = "verl_dtypes"
"""Row ``extra`` key with the numpy dtypes of verl's non-object input columns."""

_ID_KEYS = ("rollout_uid", "rollout_group_id")


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


def verl_metrics(item: AgentRolloutItem | None) -> dict[str, float]:
    """verl's ``AgentLoopMetrics`` fields, all of them (verl's manager reads each unguarded).

    Seconds spent generating, calling tools and judging, summed from the stage records;
    ``num_preempted`` is -1 (verl's "not available").
    """
    generate = tools = judge = 0.0
    for record in item.records if item is not None else ():
        if record.phase != "run" or record.duration is None:
            continue
        if record.name == "generate":
            generate += record.duration
        elif "tool" in record.name:
            tools += record.duration
        elif "judge" in record.name:
            judge += record.duration
    return {"generate_sequences": generate, "tool_calls": tools, "compute_score": judge,
            "num_preempted": -1}


def _items(samples: Sequence[RolloutSample],
           items: Sequence[AgentRolloutItem] | None) -> list[AgentRolloutItem | None]:
    if items is None:
        return [None] * len(samples)
    if len(items) != len(samples):
        raise ConfigError(f"items has {len(items)} entries for {len(samples)} samples")
    return list(items)


def with_response_token(sample: RolloutSample, pad_token_id: int) -> RolloutSample:
    """The sample, or a copy with one pad response token (mask 0, logprob 0) if it has none.

    verl writes a score at ``rm_scores[-1]`` and reads a last response position for every
    row, so a row without response tokens (a sample that failed before generating) raises
    there; one masked pad token keeps the row well formed and carries no loss.
    """
    if sample.response_ids:
        return sample
    return sample.model_copy(update={
        "response_ids": [pad_token_id], "response_mask": [0],
        "logprobs": None if sample.logprobs is None else [0.0]})


def _numeric_leaves(payload: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in payload.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_numeric_leaves(value, name + "."))
        elif isinstance(value, bool | int | float | np.number) and not isinstance(value, str):
            out[name] = value
    return out


def reward_extra_info(samples: Sequence[RolloutSample],
                      keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """verl's ``reward_extra_info`` per sample: the reward payload's numeric leaves.

    Nested keys are joined with dots (``judgers.math.score``); strings and lists are left out
    (verl averages these values in its metrics). Every sample gets the same keys, NaN where
    its payload lacks one (a masked sample): verl takes the keys from one sample and looks
    them up on all others, and its DAPO filter calls ``float`` on them.

    Args:
        samples: the batch.
        keys: the key set; default: every numeric leaf any sample has. Pin it when several
            workers build batches separately, so their columns agree.
    """
    leaves = [_numeric_leaves(s.reward_payload) for s in samples]
    names = sorted({k for leaf in leaves for k in leaf}) if keys is None else list(keys)
    return [{k: leaf.get(k, float("nan")) for k in names} for leaf in leaves]


LIST_KEYS = ("turn_scores", "tool_rewards")
"""Per-turn lists verl's workers always fill (``[]`` when a sample has none), never None."""


def _extra_fields(samples: Sequence[RolloutSample]) -> list[dict[str, Any]]:
    """Each sample's ``extra_fields``, all with the batch's union of keys (None if missing;
    ``[]`` for the :data:`LIST_KEYS`, as verl's own agent loops leave them)."""
    keys = sorted({k for s in samples for k in s.extra_fields})
    return [{k: s.extra_fields.get(k, [] if k in LIST_KEYS else None) for k in keys}
            for s in samples]


def to_verl_outputs(
    samples: Sequence[RolloutSample],
    *,
    items: Sequence[AgentRolloutItem] | None = None,
    pad_token_id: int = 0,
    reward_extra_keys: Sequence[str] | None = None,
    use_verl: bool | None = None,
) -> list[Any]:
    """One verl ``AgentLoopOutput`` per sample, in order, under the batch's all-or-none rules.

    Args:
        samples: the batch.
        items: the matching items (``run_batch(...).items``), for ``num_turns`` from the
            messages and ``metrics`` from the stage timings; without them ``num_turns`` is
            ``2 + 2 * tool_turns`` and the metrics are 0.
        pad_token_id: the token a sample without response tokens gets (mask 0).
        reward_extra_keys: pins the ``reward_extra_info`` keys (see :func:`reward_extra_info`).
        use_verl: None: verl's ``AgentLoopOutput`` when importable, else dicts; False: dicts;
            True: verl's classes or ImportError.

    Returns:
        ``AgentLoopOutput`` objects or dicts with its fields: ``prompt_ids``,
        ``response_ids`` (at least one), ``response_mask``, ``response_logprobs``,
        ``routed_experts`` (``[prompt_len + response_len, num_layers, topk]``),
        ``multi_modal_data``, ``reward_score``, ``num_turns``, ``metrics`` (every
        ``AgentLoopMetrics`` field, set explicitly so verl's V1 ``as_dict`` keeps them),
        ``extra_fields`` (the sample's own, with the batch's union of keys, plus
        ``rollout_uid``, ``rollout_group_id``, the :data:`STATUS_KEYS` but overlong,
        ``min_global_steps`` / ``max_global_steps`` (the sample's oldest and newest policy
        version) when the batch tracks versions, and ``reward_extra_info`` when the batch
        has rewards).

    Raises:
        ContractError: the routed-experts rules, or an unmasked sample without logprobs or
            reward beside others that have them.
        ConfigError: ``items`` does not match ``samples`` in length.
    """
    samples = [with_response_token(s, pad_token_id) for s in samples]
    check_alignment(samples)
    routes = [as_routes(s.routed_experts) for s in samples]
    layout = check_routed_experts(samples, routes)
    with_logprobs = has_logprobs(samples)
    with_reward = has_rewards(samples)
    infos = reward_extra_info(samples, reward_extra_keys)
    module = _verl_module("verl.experimental.agent_loop.agent_loop", use_verl)
    outputs = []
    versions = _version_columns(samples)
    for i, (sample, arr, item, info, extra) in enumerate(zip(
            samples, routes, _items(samples, items), infos, _extra_fields(samples),
            strict=True)):
        steps = {key: column[i] for key, column in versions.items()}
        fields: dict[str, Any] = {
            "prompt_ids": list(sample.prompt_ids),
            "response_ids": list(sample.response_ids),
            "response_mask": [0] * len(sample.response_mask) if sample.masked
            else list(sample.response_mask),
            "response_logprobs": None if not with_logprobs else (
                list(sample.logprobs) if sample.logprobs is not None
                else [0.0] * len(sample.response_ids)),
            "routed_experts": None if layout is None else filled_routes(sample, arr, layout),
            # verl's worker builds multi_modal_inputs and mrope positions from the images
            "multi_modal_data": ({"images": sample.multi_modal_inputs.pil_images()}
                                 if sample.multi_modal_inputs else None),
            "reward_score": None if not with_reward else (
                0.0 if sample.masked or sample.reward is None else float(sample.reward)),
            "num_turns": _num_turns(sample, item),
            "metrics": verl_metrics(item),
            "extra_fields": {**steps, **extra, **_status_fields(sample),
                             **({"reward_extra_info": info} if with_reward else {})},
        }
        outputs.append(fields if module is None else _verl_output(module, fields))
    return outputs


def _version_columns(samples: Sequence[RolloutSample]) -> dict[str, list[Any]]:
    """verl's ``min_global_steps`` / ``max_global_steps`` from the samples' policy versions
    (the oldest and newest version that sampled a token), where any sample tracks them; a
    sample's own ``extra_fields`` value wins (the verl agent loop's server steps)."""
    if all(s.policy_version is None for s in samples):
        return {}
    return {"min_global_steps": [s.extra_fields.get("min_global_steps", s.policy_version)
                                 for s in samples],
            "max_global_steps": [s.extra_fields.get("max_global_steps", s.max_policy_version)
                                 for s in samples]}


def _status_fields(sample: RolloutSample) -> dict[str, Any]:
    return {"rollout_uid": sample.uid, "rollout_group_id": sample.group_id,
            "rollout_status": sample.status.value,
            "rollout_finish_reason": sample.finish_reason.value,
            "rollout_masked": sample.masked}


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
    reward_extra_keys: Sequence[str] | None = None,
    use_verl: bool | None = None,
    processor: Any = None,
) -> Any:
    """The batch verl's agent-loop worker hands its trainer: a ``DataProto`` (or dicts).

    Tensors come from :func:`collate` with ``pad_to="max"`` (verl's fixed
    ``prompt_length`` / ``response_length`` shapes); a sample without response tokens gets
    one pad token (mask 0), as in :func:`to_verl_outputs`. The columns are those verl's worker
    builds from :func:`to_verl_outputs` (``AgentLoopWorker._postprocess``), plus ours.

    Args:
        samples: the batch, in the order of the trainer's input batch.
        pad_token_id: as for :func:`collate`.
        max_prompt_len: as for :func:`collate`.
        max_response_len: as for :func:`collate`.
        items: the matching items, for ``__num_turns__``, the metrics, ``raw_prompt`` and,
            for items from :func:`from_verl_batch`, verl's input columns (emitted again, as
            verl's worker does).
        uid_key: the non-tensor column that gets each sample's ``group_id`` (verl's GRPO
            groups by ``uid``); None leaves it out, for trainers whose input batch carries
            its own ``uid`` column (``DataProto.union`` refuses differing values).
        reward_extra_keys: pins the reward-extra columns (see :func:`reward_extra_info`).
        use_verl: as for :func:`to_verl_outputs`, with ``verl.protocol.DataProto``.
        processor: for vision-language samples, the processor with the model's
            ``get_rope_index`` (verl's ``hf_processor``): ``position_ids`` are then
            ``[B, 4, T]`` mrope positions in verl's layout
            (:func:`pipeline.multimodal.mrope_position_ids`), and ``multi_modal_inputs``
            holds each sample's ``pixel_values`` and ``image_grid_thw``.

    Returns:
        ``DataProto(batch=..., non_tensor_batch=..., meta_info=...)``, or a dict with
        the keys ``batch`` (torch tensors: :data:`VERL_BATCH_KEYS` and any
        :data:`VERL_OPTIONAL_KEYS`), ``non_tensor_batch`` (numpy arrays: ``__num_turns__``,
        the ``uid_key`` column, :data:`STATUS_KEYS`, ``rollout_uid``, ``rollout_group_id``,
        :data:`VERL_WORKER_KEYS`, the reward-extra keys and ``reward_extra_info`` when
        ``rm_scores`` is present, each ``extra_fields`` key, verl's input columns) and
        ``meta_info`` (``metrics``: one dict per sample; ``reward_extra_keys`` when
        ``rm_scores`` is present; nothing that may differ between workers).

    Raises:
        ContractError, ConfigError: as :func:`collate` raises them; ConfigError
            (``field="processor"``) for images without a processor that has
            ``get_rope_index``.
    """
    samples = [with_response_token(s, pad_token_id) for s in samples]
    tensors = collate(samples, pad_token_id=pad_token_id, max_prompt_len=max_prompt_len,
                      max_response_len=max_response_len, pad_to="max", return_tensors="pt")
    # an overlong sample with images is emptied by collate: it hands over no image either
    images = [None if cut else s.multi_modal_inputs or None
              for s, cut in zip(samples, tensors["overlong"].tolist(), strict=True)]
    for key in ("pixel_values", "image_grid_thw", "image_counts"):  # per sample below
        tensors.pop(key, None)
    if any(images) or getattr(processor, "get_rope_index", None) is not None:  # as verl's
        tensors["position_ids"] = mrope_position_ids(
            processor, tensors["input_ids"], tensors["attention_mask"],
            [i.image_grid_thw if i else None for i in images])
    masked, overlong = tensors.pop("masked").numpy(), tensors.pop("overlong").numpy()
    rows = _items(samples, items)
    n = len(samples)
    columns: dict[str, list[Any]] = {}
    inputs = [it.data.extra.get(VERL_INPUTS) if it is not None else None for it in rows]
    dtypes: dict[str, str] = {}
    for it in rows:
        dtypes.update(it.data.extra.get(VERL_DTYPES) or {} if it is not None else {})
    for key in sorted({k for verl_row in inputs if verl_row for k in verl_row}):
        columns[key] = [verl_row.get(key) if verl_row else None for verl_row in inputs]
    for key, value in _version_columns(samples).items():
        columns.setdefault(key, value)
    for key in VERL_WORKER_KEYS:
        columns.setdefault(key, [None] * n)
    columns["multi_modal_inputs"] = [i.trainer_inputs() if i else {} for i in images]
    columns["raw_prompt"] = [_raw_prompt(it, verl_row) for it, verl_row in zip(rows, inputs,
                                                                            strict=True)]
    extras = _extra_fields(samples)
    for key in extras[0] if extras else ():
        columns[key] = [extra[key] for extra in extras]
    for key in _ID_KEYS + STATUS_KEYS[:2]:
        columns[key] = [_status_fields(s)[key] for s in samples]
    if uid_key is not None:
        columns[uid_key] = [s.group_id for s in samples]
    meta_info: dict[str, Any] = {"metrics": [verl_metrics(it) for it in rows]}
    if "rm_scores" in tensors:
        infos = reward_extra_info(samples, reward_extra_keys)
        keys = list(infos[0]) if infos else list(reward_extra_keys or ())
        for key in keys:
            columns[key] = [info[key] for info in infos]
        columns["reward_extra_info"] = infos
        meta_info["reward_extra_keys"] = keys
    non_tensors = {key: _column(values, dtypes.get(key)) for key, values in columns.items()}
    non_tensors["__num_turns__"] = np.array(
        [_num_turns(s, it) for s, it in zip(samples, rows, strict=True)], dtype=np.int32)
    non_tensors["rollout_masked"] = masked
    non_tensors["rollout_overlong"] = overlong
    protocol = _verl_module("verl.protocol", use_verl)
    if protocol is not None:
        return protocol.DataProto.from_dict(tensors=tensors, non_tensors=non_tensors,
                                            meta_info=meta_info)
    return {"batch": tensors, "non_tensor_batch": non_tensors, "meta_info": meta_info}


def _raw_prompt(item: AgentRolloutItem | None, verl_row: dict[str, Any] | None) -> Any:
    """verl's ``raw_prompt``: its own input value, else the row's chat messages."""
    if verl_row and "raw_prompt" in verl_row:
        return verl_row["raw_prompt"]
    return None if item is None else list(item.data.messages)


def _column(values: list[Any], dtype: str | None) -> np.ndarray:
    """verl's input column again: its own dtype when it was not ``object`` and still fits."""
    if dtype is not None and all(v is not None for v in values):
        return np.array(values, dtype=dtype)
    return _objects(values)


def _objects(values: list[Any]) -> np.ndarray:
    """A 1-d object array (element by element: list values must not become a 2-d array)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out
