"""``collate``: a batch of :class:`RolloutSample` as padded trainer tensors (verl's names).

Layout, for a prompt ``[1, 2, 3]`` and a response ``[4, 5, (tool) 6, 7]`` with
``max_prompt_len=4`` and ``max_response_len=6``::

    prompts          [pad, 1, 2, 3]                       left-padded
    responses        [4, 5, 6, 7, pad, pad]               right-padded
    input_ids        prompts + responses
    attention_mask   [0, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    position_ids     [0, 0, 1, 2, 3, 4, 5, 6, 6, 6]       cumsum(attention_mask) - 1, >= 0
    response_mask    [1, 1, 0, 1, 0, 0]                   model tokens only, 0 on padding
    rollout_log_probs                                      0.0 on padding
    rm_scores        [0, 0, 0, r, 0, 0]                   reward on the last response token
    rollout_token_versions [v, v, -1, w, -1, -1]           policy version per sampled token
    routed_experts   [P + R, num_layers, topk]             aligned with input_ids

The arrays are built with numpy and handed over to torch without a copy, so importing this
module does not import torch; ``return_tensors="np"`` needs no torch at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import structlog

from pipeline._data.models import NOT_SAMPLED, RolloutSample
from pipeline._exceptions import ConfigError, ContractError
from pipeline.batch._experts import as_routes, check_routed_experts
from pipeline.multimodal import image_columns

_logger = structlog.get_logger("pipeline.batch")

PadTo = Literal["max", "longest"]
TensorKind = Literal["pt", "np"]


def collate(
    samples: Sequence[RolloutSample],
    *,
    pad_token_id: int,
    max_prompt_len: int,
    max_response_len: int,
    pad_to: PadTo = "max",
    return_tensors: TensorKind = "pt",
) -> dict[str, Any]:
    """Pad a batch into trainer tensors; output length and order equal the input's.

    Nothing is truncated silently. Samples are meant to be built within the length budget
    (``SamplingParams.max_response_tokens``); a sample whose prompt or response is longer
    than the budget is still in the output, at its position, but *overlong*: cut to fit
    (the prompt keeps its last tokens, the response its first), masked (all-zero
    ``response_mask``, no reward, zero routing), flagged in ``overlong`` and counted in a
    ``collate_overlong`` warning. An overlong sample *with images* is emptied instead (no
    token, no image: one attended pad token, as below): a cut through its image tokens would
    leave a vision forward fewer image tokens than image features (transformers' Qwen2-VL
    raises on that, for the whole batch), and the row carries no loss either way.

    Optional fields are all-or-none across the batch. ``rollout_log_probs`` is present when
    any sample has logprobs, ``rm_scores`` when any has a reward, ``routed_experts`` when any
    has routing; a masked sample without one gets zeros, an unmasked one without it beside
    others is a :class:`ContractError` naming its uid.

    A row with no token at all (a sample that failed before its prompt was built) gets one
    attended pad token in the first response slot, so attention over it stays defined.

    Args:
        samples: the batch, e.g. ``(await pipeline.run_batch(rows)).samples``.
        pad_token_id: the id put on padding positions.
        max_prompt_len: the trainer's prompt budget (verl's ``rollout.prompt_length``).
        max_response_len: the trainer's response budget (``rollout.response_length``).
        pad_to: ``"max"`` pads to the budgets exactly (verl's fixed shapes); ``"longest"``
            pads to the longest prompt and response of the batch, within the budgets.
        return_tensors: ``"pt"`` for torch tensors (needs torch), ``"np"`` for numpy.

    Returns:
        ``prompts`` ``[B, P]``, ``responses`` ``[B, R]``, ``input_ids``,
        ``attention_mask``, ``position_ids`` ``[B, P + R]`` (int64), ``response_mask``
        ``[B, R]`` (int64), ``masked`` and ``overlong`` ``[B]`` (bool); when present
        ``rollout_log_probs`` and ``rm_scores`` ``[B, R]`` (float32),
        ``rollout_token_versions`` ``[B, R]`` (int64, -1 where no model token) and
        ``routed_experts`` ``[B, P + R, num_layers, topk]`` (the samples' integer dtype);
        with images (vision-language samples) ``pixel_values`` and ``image_grid_thw`` (every
        sample's images in order, concatenated) and ``image_counts`` ``[B]``.

    Raises:
        ConfigError: a budget below 1, or an unknown ``pad_to`` / ``return_tensors``.
        ContractError: a sample's response mask or logprobs do not align with its response,
            or the all-or-none rules above are broken (the message names the sample).
    """
    if max_prompt_len < 1 or max_response_len < 1:
        raise ConfigError(f"max_prompt_len and max_response_len must be >= 1, got "
                          f"{max_prompt_len} and {max_response_len}")
    if pad_to not in ("max", "longest") or return_tensors not in ("pt", "np"):
        raise ConfigError(f"pad_to must be 'max' or 'longest' and return_tensors 'pt' or 'np', "
                          f"got {pad_to!r} and {return_tensors!r}")
    check_alignment(samples)
    layout = _Layout.of(samples, max_prompt_len, max_response_len, pad_to)
    out = _token_columns(samples, layout, pad_token_id)
    logprobs = _logprobs(samples, layout.slot_r, layout.keep_r)
    if logprobs is not None:
        out["rollout_log_probs"] = logprobs
    versions = _token_versions(samples, layout.slot_r, layout.keep_r)
    if versions is not None:
        out["rollout_token_versions"] = versions
    scores = _rm_scores(samples, layout.masked, layout.keep_r, layout.width_r)
    if scores is not None:
        out["rm_scores"] = scores
    routes = _routed_experts(samples, layout.overlong, layout.keep_p,
                             layout.width_p + layout.width_r, layout.width_p)
    if routes is not None:
        out["routed_experts"] = routes
    out["masked"] = layout.masked
    out["overlong"] = layout.overlong
    if layout.overlong.any():
        uids = [s.uid for s, o in zip(samples, layout.overlong.tolist(), strict=True) if o]
        _logger.warning("collate_overlong", count=len(uids), uids=uids[:8],
                        max_prompt_len=max_prompt_len, max_response_len=max_response_len)
    result = _to_torch(out) if return_tensors == "pt" else out
    result.update(image_columns([None if empty else s for s, empty in zip(
        samples, layout.emptied.tolist(), strict=True)], return_tensors))
    return result


@dataclass(frozen=True)
class _Layout:
    """Where each sample's tokens go: widths, kept lengths, slots, masked and overlong rows."""

    width_p: int
    width_r: int
    keep_p: np.ndarray
    keep_r: np.ndarray
    slot_p: np.ndarray  # [B, P] True where a prompt token sits (left padding)
    slot_r: np.ndarray  # [B, R] True where a response token sits (right padding)
    masked: np.ndarray
    overlong: np.ndarray
    emptied: np.ndarray  # overlong rows with images: no token kept (see collate)

    @classmethod
    def of(cls, samples: Sequence[RolloutSample], max_prompt_len: int, max_response_len: int,
           pad_to: PadTo) -> _Layout:
        n = len(samples)
        plens = np.fromiter((len(s.prompt_ids) for s in samples), np.int64, n)
        rlens = np.fromiter((len(s.response_ids) for s in samples), np.int64, n)
        overlong = (plens > max_prompt_len) | (rlens > max_response_len)
        masked = np.fromiter((s.masked for s in samples), bool, n) | overlong
        longest = pad_to == "longest"
        width_p = int(min(max_prompt_len, plens.max(initial=1))) if longest else max_prompt_len
        width_r = (int(min(max_response_len, rlens.max(initial=1))) if longest
                   else max_response_len)
        keep_p, keep_r = np.minimum(plens, width_p), np.minimum(rlens, width_r)
        emptied = overlong & np.fromiter((bool(getattr(s, "multi_modal_inputs", None))
                                          for s in samples), bool, n)
        keep_p[emptied] = keep_r[emptied] = 0
        slot_p = np.arange(width_p)[None, :] >= (width_p - keep_p)[:, None]
        slot_r = np.arange(width_r)[None, :] < keep_r[:, None]
        return cls(width_p, width_r, keep_p, keep_r, slot_p, slot_r, masked, overlong,
                   emptied)


def _token_columns(samples: Sequence[RolloutSample], layout: _Layout,
                   pad_token_id: int) -> dict[str, np.ndarray]:
    """prompts, responses, input_ids, attention_mask, position_ids and response_mask."""
    n, keep_p, keep_r = len(samples), layout.keep_p.tolist(), layout.keep_r.tolist()
    total_p, total_r = int(layout.keep_p.sum()), int(layout.keep_r.sum())
    prompts = np.full((n, layout.width_p), pad_token_id, dtype=np.int64)
    prompts[layout.slot_p] = _flat(
        (s.prompt_ids[len(s.prompt_ids) - k:] for s, k in zip(samples, keep_p, strict=True)),
        total_p, np.int64)
    responses = np.full((n, layout.width_r), pad_token_id, dtype=np.int64)
    responses[layout.slot_r] = _flat(
        (s.response_ids[:k] for s, k in zip(samples, keep_r, strict=True)), total_r, np.int64)
    response_mask = np.zeros((n, layout.width_r), dtype=np.int64)
    response_mask[layout.slot_r] = _flat(
        (s.response_mask[:k] for s, k in zip(samples, keep_r, strict=True)), total_r, np.int64)
    response_mask[layout.masked] = 0
    attention_mask = np.concatenate([layout.slot_p, layout.slot_r], axis=1).astype(np.int64)
    empty = (layout.keep_p + layout.keep_r) == 0
    if empty.any():
        attention_mask[empty, layout.width_p] = 1  # one attended pad token: attention stays defined
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention_mask,
        "position_ids": np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0),
        "response_mask": response_mask,
    }


def check_alignment(samples: Sequence[RolloutSample]) -> None:
    """Raise :class:`ContractError` for a sample whose mask or logprobs are misaligned."""
    for s in samples:
        if len(s.response_mask) != len(s.response_ids):
            raise ContractError(f"sample {s.uid}: response_mask has {len(s.response_mask)} "
                                f"entries for {len(s.response_ids)} response tokens")
        if s.logprobs is not None and len(s.logprobs) != len(s.response_ids):
            raise ContractError(f"sample {s.uid}: logprobs has {len(s.logprobs)} entries for "
                                f"{len(s.response_ids)} response tokens")
        if s.token_versions is not None and len(s.token_versions) != len(s.response_ids):
            raise ContractError(f"sample {s.uid}: token_versions has {len(s.token_versions)} "
                                f"entries for {len(s.response_ids)} response tokens")


def _flat(parts: Iterable[Iterable[Any]], count: int, dtype: type[Any]) -> np.ndarray:
    """Concatenate the parts into one array (the row-major order of the slot masks)."""
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=dtype, count=count)


def has_logprobs(samples: Sequence[RolloutSample]) -> bool:
    """Whether the batch carries logprobs (all-or-none: masked samples may lack them).

    Raises:
        ContractError: an unmasked sample lacks them while others have them.
    """
    return _all_or_none(samples, "logprobs", "only masked samples are zero-filled")


def has_rewards(samples: Sequence[RolloutSample]) -> bool:
    """Whether the batch carries rewards (all-or-none: masked samples may lack one).

    Raises:
        ContractError: an unmasked sample lacks one while others have one.
    """
    return _all_or_none(samples, "reward", "only masked samples get a zero score")


def _all_or_none(samples: Sequence[RolloutSample], field: str, fill_rule: str) -> bool:
    """DESIGN's rule for optional fields: present on every unmasked sample or on none."""
    have = sum(1 for s in samples if getattr(s, field) is not None)
    if have:
        for s in samples:
            if getattr(s, field) is None and not s.masked:
                raise ContractError(
                    f"sample {s.uid} ({s.status.value}) has no {field} while {have} other "
                    f"sample(s) of the batch have it; {fill_rule}")
    return have > 0


def _logprobs(samples: Sequence[RolloutSample], slot_r: np.ndarray,
              keep_r: np.ndarray) -> np.ndarray | None:
    if not has_logprobs(samples):
        return None
    zeros = itertools.repeat(0.0)
    parts = (s.logprobs[:k] if s.logprobs is not None else itertools.islice(zeros, k)
             for s, k in zip(samples, keep_r.tolist(), strict=True))
    out = np.zeros(slot_r.shape, dtype=np.float32)
    out[slot_r] = _flat(parts, int(keep_r.sum()), np.float32)
    return out


def _token_versions(samples: Sequence[RolloutSample], slot_r: np.ndarray,
                    keep_r: np.ndarray) -> np.ndarray | None:
    """The policy version of each response token, -1 where none sampled it (tool tokens,
    padding, samples without versions); present when any sample has versions."""
    if not any(s.token_versions is not None for s in samples):
        return None
    parts = (s.token_versions[:k] if s.token_versions is not None
             else itertools.repeat(NOT_SAMPLED, k)
             for s, k in zip(samples, keep_r.tolist(), strict=True))
    out = np.full(slot_r.shape, NOT_SAMPLED, dtype=np.int64)
    out[slot_r] = _flat(parts, int(keep_r.sum()), np.int64)
    return out


def _rm_scores(samples: Sequence[RolloutSample], masked: np.ndarray, keep_r: np.ndarray,
               width_r: int) -> np.ndarray | None:
    if not has_rewards(samples):
        return None
    scores = np.zeros((len(samples), width_r), dtype=np.float32)
    for i, (s, is_masked, k) in enumerate(zip(samples, masked.tolist(), keep_r.tolist(),
                                              strict=True)):
        if not is_masked and k > 0 and s.reward is not None:
            scores[i, k - 1] = s.reward
    return scores


def _routed_experts(samples: Sequence[RolloutSample], overlong: np.ndarray,
                    keep_p: np.ndarray, width: int, width_p: int) -> np.ndarray | None:
    routes = [as_routes(s.routed_experts) for s in samples]
    layout = check_routed_experts(samples, routes)
    if layout is None:
        return None
    out = np.zeros((len(samples), width, layout.num_layers, layout.topk), dtype=layout.dtype)
    for i, (s, arr, cut, kp) in enumerate(zip(samples, routes, overlong.tolist(),
                                               keep_p.tolist(), strict=True)):
        if arr is None or cut or arr.shape[0] > len(s.prompt_ids) + len(s.response_ids):
            continue  # zero-filled; only masked samples get here (the rules raise otherwise)
        start = width_p - kp  # the prompt's first column; routes run on into the response
        out[i, start:start + arr.shape[0]] = arr
    return out


def _to_torch(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("return_tensors='pt' needs torch (pip install "
                          "'rollout-pipeline[transformers]'); or pass return_tensors='np'"
                          ) from exc
    return {key: torch.from_numpy(value) for key, value in arrays.items()}
