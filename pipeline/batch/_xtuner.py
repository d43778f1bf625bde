"""Adapter to XTuner: one plain dict per sample, shaped like XTuner's ``RLDataFlowItem``.

XTuner's RL dataflow passes ``RLDataFlowItem`` records: ``uid`` (``env``, ``root_id``,
``action_id``, ``observation_id``, ``version``), ``data`` (the prompt), ``env.rollout`` (the
response), ``env.judger`` (the reward) and ``extra_info``. Its ids are integers; ours are
strings, so the integer ids are stable 63-bit digests of them and the strings ride along in
``data.extra_info``. The field-by-field table is in ``docs/trainer_mapping.md``.

XTuner's RL trainer (v1.0.1, ``RLTrainer._prepare_train_data``) builds each sequence from
``data.extra_info["train_prompt_ids"]`` plus the response, so every record carries it (our
prompt ids: the same ids the engine was given, image tokens expanded). Vision-language samples
(Qwen2-VL family) carry ``data.multimodal_train_info`` as XTuner's dataset fills it:
``pixel_values``, ``image_grid_thw`` and ``position_ids`` of shape ``[3, 1, prompt_len]`` (the
model's 3-D rope over the prompt; XTuner's ``get_train_seq_ctx`` continues them over the
response as text positions).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from pipeline._data.models import AgentRolloutItem, FinishReason, RolloutSample, Status
from pipeline._exceptions import ConfigError
from pipeline._text.tokenizer import Tokenizer
from pipeline.batch._collate import check_alignment
from pipeline.batch._experts import as_routes, check_routed_experts, filled_routes
from pipeline.multimodal import mrope_position_ids

XTUNER_STATE = {
    Status.COMPLETED: "completed",
    Status.FAILED: "failed",
    Status.TIMEOUT: "skipped",
    Status.ABORTED: "aborted",
}
"""Our status -> XTuner's ``RolloutState`` value."""

XTUNER_FINISH_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "failed",
    FinishReason.TIMEOUT: "skipped",
}
"""Our finish reason -> XTuner's ``finish_reason`` word."""


def int_id(text: str) -> int:
    """A stable non-negative 63-bit integer for a string id (XTuner's ids are ints)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def to_xtuner(
    samples: Sequence[RolloutSample],
    *,
    items: Sequence[AgentRolloutItem] | None = None,
    tokenizer: Tokenizer | None = None,
    env: str = "pipeline",
    processor: Any = None,
) -> list[dict[str, Any]]:
    """XTuner rollout records, one per sample, in order.

    Args:
        samples: the batch.
        items: the matching items: the prompt ``messages`` and dataset fields come from them.
        tokenizer: decodes the ``response`` text XTuner's judgers read (None leaves it None).
        env: XTuner's environment name.
        processor: for vision-language samples, the processor with the model's
            ``get_rope_index`` bound to it (as for :func:`to_verl_batch`): the prompt's
            mrope ``position_ids`` come from it.

    Returns:
        Dicts ``{"uid": {...}, "data": {...}, "env": {"rollout": {...}, "judger": {...},
        "agent": {...}, "extra_info": {}}, "extra_info": {"retry_times": 0,
        "extra_info": {}}}``. ``env.rollout.extra_info`` holds, when the batch has them,
        ``routed_experts`` as an array ``[prompt_len + response_len, num_layers, topk]``
        under the batch rules (XTuner v1.0.1 types that dict: nothing else may go there);
        ``env.agent.extra_info`` holds ``tool_turns``, ``exit_reason``, ``response_mask``
        (XTuner's record has no mask of its own; multi-turn samples need it) and, when the
        sample tracks them, ``token_versions`` (the policy version of each response token,
        -1 on tool tokens) with ``min_policy_version`` / ``max_policy_version``;
        ``uid.version`` is the oldest.
        ``data.extra_info["train_prompt_ids"]`` is the prompt ids; ``data.multimodal_train_info``
        is None without images, else ``{"pixel_values": [patches, D], "image_grid_thw":
        [images, 3], "position_ids": [3, 1, prompt_len]}`` (torch tensors; every image of
        the sample, a tool's too: the vision forward needs features for each image token).

    Raises:
        ContractError: misaligned samples or broken routed-experts rules.
        ConfigError: ``items`` does not match ``samples`` in length; images without a
            processor that has ``get_rope_index`` (``field="processor"``).
    """
    check_alignment(samples)
    if items is not None and len(items) != len(samples):
        raise ConfigError(f"items has {len(items)} entries for {len(samples)} samples")
    if any(s.multi_modal_inputs for s in samples) and getattr(
            processor, "get_rope_index", None) is None:
        raise ConfigError("samples with images need their prompt's mrope position ids: pass "
                          "processor= with the model's get_rope_index bound to it (as verl's "
                          "hf_processor binds it)", field="processor")
    routes = [as_routes(s.routed_experts) for s in samples]
    layout = check_routed_experts(samples, routes)
    records = []
    for i, (sample, arr) in enumerate(zip(samples, routes, strict=True)):
        item = items[i] if items is not None else None
        rollout_extra: dict[str, Any] = {}
        if layout is not None:
            rollout_extra["routed_experts"] = filled_routes(sample, arr, layout)
        agent_extra: dict[str, Any] = {
            "tool_turns": sample.tool_turns, "exit_reason": sample.exit_reason,
            "response_mask": [0] * len(sample.response_mask) if sample.masked
            else list(sample.response_mask)}
        if sample.token_versions is not None:
            agent_extra["token_versions"] = list(sample.token_versions)
            agent_extra["min_policy_version"] = sample.policy_version
            agent_extra["max_policy_version"] = sample.max_policy_version
        reward = {**sample.reward_payload, "score": sample.reward}  # None when masked
        records.append({
            "uid": {"env": env, "root_id": int_id(sample.group_id),
                    "action_id": int_id(sample.group_id), "observation_id": int_id(sample.uid),
                    "version": sample.policy_version or 0},
            "data": {
                "messages": list(item.data.messages) if item is not None else None,
                "input_ids": list(sample.prompt_ids),
                "num_tokens": len(sample.prompt_ids),
                "ability": None,
                "reward_model": ({"ground_truth": item.data.ground_truth}
                                 if item is not None else None),
                "data_source": None,
                "extra_info": {**(item.data.extra if item is not None else {}),
                               "uid": sample.uid, "group_id": sample.group_id,
                               "data_source": item.data.data_source if item else None,
                               "train_prompt_ids": list(sample.prompt_ids)},
                "multimodal_train_info": _train_info(sample, processor),
            },
            "env": {
                "rollout": {
                    "response": (tokenizer.decode(sample.response_ids, skip_special_tokens=True)
                                 if tokenizer is not None else None),
                    "response_ids": list(sample.response_ids),
                    "logprobs": None if sample.logprobs is None else list(sample.logprobs),
                    "num_return_tokens": len(sample.response_ids),
                    "finish_reason": XTUNER_FINISH_REASON[sample.finish_reason],
                    "extra_info": rollout_extra,
                    "state": XTUNER_STATE[sample.status],
                },
                "judger": {"uid": sample.index, "reward": reward,
                           "extra_info": {"error": sample.error}},
                "agent": {"extra_info": agent_extra},
                "extra_info": dict(sample.extra_fields),
            },
            "extra_info": {"retry_times": 0, "extra_info": {}},
        })
    return records



def _train_info(sample: RolloutSample, processor: Any) -> dict[str, Any] | None:
    """XTuner's ``multimodal_train_info`` of one sample (None without images)."""
    inputs = sample.multi_modal_inputs
    if not inputs:
        return None
    import torch

    # the prompt's images come first, a tool turn's follow in the response: the prompt's
    # positions need the grids of those whose tokens it holds (template tokens, never sampled)
    pad = getattr(processor, "image_token_id", None)
    if pad is None:
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    left = sum(1 for t in sample.prompt_ids if t == pad)
    in_prompt = 0
    while in_prompt < len(inputs.image_token_counts) and left > 0:
        left -= inputs.image_token_counts[in_prompt]
        in_prompt += 1
    prompt = torch.tensor([sample.prompt_ids], dtype=torch.long)
    grid = inputs.first(in_prompt).image_grid_thw if in_prompt else None
    positions = mrope_position_ids(processor, prompt, torch.ones_like(prompt), [grid])
    return {"pixel_values": inputs.pixel_values, "image_grid_thw": inputs.image_grid_thw,
            "position_ids": positions[0, 1:].unsqueeze(1)}
