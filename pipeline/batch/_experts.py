"""The batch rules for MoE ``routed_experts``: all-or-none, zero-filled only when masked.

A sample's ``routed_experts`` is an integer array ``[n, num_layers, topk]`` whose row ``t`` is
the router's top-k choice for token ``t`` of ``prompt_ids + response_ids`` (``num_layers``
counts the MoE layers, in model order). ``n`` may be shorter than the sequence: the last
sampled token never passes through the model during generation, and tool tokens appended
after the last generation were never routed. Those trailing positions are zero-filled; no
token that carries loss attends to them, so replaying them is harmless.

The rules across a batch:

1. no sample has them: the batch has no ``routed_experts`` at all;
2. some have them: a masked sample without them (failed before generating, timed out, ...) is
   zero-filled with the batch's shape, since it carries no loss;
3. an unmasked sample without them beside others is a contract error naming its uid: zero
   routing is not "no routing", it would replay expert 0 for every token;
4. shapes must agree on ``[num_layers, topk]``, values must be integers, and an unmasked
   sample's array may not be longer than its prompt plus response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline._data.models import RolloutSample
from pipeline._exceptions import ContractError


@dataclass(frozen=True, slots=True)
class ExpertsLayout:
    """Shape and dtype shared by every ``routed_experts`` array of a batch."""

    num_layers: int
    topk: int
    dtype: np.dtype[Any]


def as_routes(value: Any) -> np.ndarray | None:
    """A ``routed_experts`` value as a numpy array (torch tensors on any device, lists).

    Returns:
        The array, or None when ``value`` is None.
    """
    if value is None:
        return None
    if hasattr(value, "detach"):  # a torch tensor, possibly on an accelerator
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def check_routed_experts(
    samples: Sequence[RolloutSample], routes: Sequence[np.ndarray | None]
) -> ExpertsLayout | None:
    """Apply the batch rules (module doc) to ``routes`` (``as_routes`` of each sample).

    Args:
        samples: the batch.
        routes: each sample's routed experts as an array, or None.

    Returns:
        The batch's layout, or None when no sample has routed experts.

    Raises:
        ContractError: an unmasked sample lacks routed experts while others have them; an
            array is not 3-D integer data, disagrees with the others on ``[num_layers,
            topk]``, or (unmasked) is longer than its prompt plus response. The message
            names the sample's uid.
    """
    present = [(s, r) for s, r in zip(samples, routes, strict=True) if r is not None]
    if not present:
        return None
    first_sample, first = present[0]
    for sample, arr in present:
        if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
            raise ContractError(
                f"sample {sample.uid}: routed_experts must be an integer array "
                f"[len, num_layers, topk], got dtype {arr.dtype} with shape {arr.shape}")
        if arr.shape[1:] != first.shape[1:]:
            raise ContractError(
                f"sample {sample.uid}: routed_experts has [num_layers, topk] = "
                f"{list(arr.shape[1:])}, sample {first_sample.uid} has {list(first.shape[1:])}")
        length = len(sample.prompt_ids) + len(sample.response_ids)
        if not sample.masked and arr.shape[0] > length:
            raise ContractError(
                f"sample {sample.uid}: routed_experts covers {arr.shape[0]} tokens, more than "
                f"its {length} prompt and response tokens")
    for sample, maybe in zip(samples, routes, strict=True):
        if maybe is None and not sample.masked:
            raise ContractError(
                f"sample {sample.uid} ({sample.status.value}) has no routed_experts while "
                f"{len(present)} other sample(s) of the batch have them; zero-filling it would "
                f"replay expert 0 for every token (only masked samples are zero-filled)")
    dtype = np.result_type(*(arr.dtype for _, arr in present))
    if dtype.kind == "u" and dtype.itemsize > 1:  # torch has no general uint16/32/64 support
        dtype = np.dtype(f"int{min(dtype.itemsize * 16, 64)}")
    return ExpertsLayout(num_layers=int(first.shape[1]), topk=int(first.shape[2]), dtype=dtype)


def filled_routes(sample: RolloutSample, arr: np.ndarray | None,
                  layout: ExpertsLayout) -> np.ndarray:
    """One sample's routed experts under the batch rules (for per-sample adapters).

    Returns:
        ``[prompt_len + response_len, num_layers, topk]``: the sample's routes, zero-filled
        after its last routed token; all zeros for a masked sample without routes (or with
        routes that do not fit its tokens).
    """
    length = len(sample.prompt_ids) + len(sample.response_ids)
    out = np.zeros((length, layout.num_layers, layout.topk), dtype=layout.dtype)
    if arr is not None and arr.shape[0] <= length:
        out[:arr.shape[0]] = arr
    return out
