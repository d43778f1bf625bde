"""Group helpers for GRPO-style trainers: groups by ``group_id``, advantages, filter signal.

The ``n`` rollouts of one prompt share a ``group_id`` (verl's per-prompt ``uid``). GRPO scores
each rollout against its group: ``(reward - mean) / (std + eps)``.

Masked samples (failed, timed out, aborted, or cut by ``collate`` as overlong) do **not**
count in their group's mean and std, by default. Their reward is unknown, not zero: a sandbox
timeout says nothing about the policy, and counting it as a zero reward would raise every
other member's advantage. They get advantage 0 (their ``response_mask`` is all zero anyway).
``include_masked=True`` counts them with ``masked_reward`` instead, for trainers that want a
failure to be a penalty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline._data.models import RolloutSample
from pipeline._exceptions import ContractError


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """One group of rollouts as a dynamic filter (DAPO-style) sees it.

    Attributes:
        group_id: the shared ``group_id``.
        indices: positions of the group's samples in the batch, in batch order.
        num_valid: samples that count (unmasked).
        reward_mean / reward_std: over the valid samples (population std); None if none.
        all_masked: no sample counts: the group carries no signal at all.
        zero_variance: fewer than two valid samples, or all valid rewards equal (within
            ``atol``): every advantage is 0, the group carries no gradient.
    """

    group_id: str
    indices: tuple[int, ...]
    num_valid: int
    reward_mean: float | None
    reward_std: float | None
    all_masked: bool
    zero_variance: bool

    @property
    def informative(self) -> bool:
        """True when the group gives a non-zero GRPO gradient."""
        return not self.all_masked and not self.zero_variance


def group_indices(samples: Sequence[RolloutSample]) -> dict[str, list[int]]:
    """Sample positions by ``group_id``, groups in order of first appearance.

    Returns:
        ``{group_id: [index, ...]}``.
    """
    groups: dict[str, list[int]] = {}
    for i, sample in enumerate(samples):
        groups.setdefault(sample.group_id, []).append(i)
    return groups


def _valid_rewards(samples: Sequence[RolloutSample], masked: np.ndarray | None,
                   include_masked: bool,
                   masked_reward: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rewards, counts, is_masked)``: rewards (NaN where unknown), which count, which are
    masked."""
    n = len(samples)
    is_masked = np.fromiter((s.masked for s in samples), bool, n)
    if masked is not None:
        if len(masked) != n:
            raise ContractError(f"masked has {len(masked)} entries for {n} samples")
        is_masked |= np.asarray(masked, dtype=bool)
    rewards = np.full(n, np.nan)
    for i, sample in enumerate(samples):
        if is_masked[i]:
            if include_masked:
                rewards[i] = masked_reward
        elif sample.reward is None:
            raise ContractError(f"sample {sample.uid} ({sample.status.value}) is unmasked but "
                                f"has no reward; run a Judge stage or set rewards first")
        else:
            rewards[i] = sample.reward
    return rewards, ~np.isnan(rewards), is_masked


def group_advantages(
    samples: Sequence[RolloutSample],
    *,
    masked: Sequence[bool] | np.ndarray | None = None,
    include_masked: bool = False,
    masked_reward: float = 0.0,
    scale: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """GRPO outcome advantages: each reward against its group's mean (and std).

    Args:
        samples: the batch.
        masked: extra per-sample mask, e.g. ``collate(...)["masked"]`` (adds the overlong
            samples); samples that are ``masked`` themselves always count as masked.
        include_masked: count masked samples in the group statistics with ``masked_reward``
            (default: leave them out; see the module doc).
        masked_reward: the reward masked samples count with when ``include_masked``.
        scale: divide by the group's std (GRPO); False keeps ``reward - mean`` (Dr. GRPO).
        eps: added to the std.

    Returns:
        float32 ``[B]``: 0 for masked samples and for groups with fewer than two samples that
        count. The std is the sample std (``ddof=1``), as verl's GRPO estimator uses.

    Raises:
        ContractError: an unmasked sample has no reward, or ``masked`` has the wrong length.
    """
    rewards, counts, is_masked = _valid_rewards(
        samples, None if masked is None else np.asarray(masked), include_masked, masked_reward)
    out = np.zeros(len(samples), dtype=np.float64)
    for indices in group_indices(samples).values():
        idx = np.asarray(indices)
        valid = idx[counts[idx]]
        if len(valid) < 2:
            continue
        values = rewards[valid]
        centred = values - values.mean()
        out[valid] = centred / (values.std(ddof=1) + eps) if scale else centred
    out[is_masked] = 0.0
    return out.astype(np.float32)


def summarize_groups(
    samples: Sequence[RolloutSample],
    *,
    masked: Sequence[bool] | np.ndarray | None = None,
    atol: float = 1e-6,
) -> list[GroupSummary]:
    """Each group's counts and reward spread: the dynamic-filter signal.

    Groups that are ``all_masked`` or ``zero_variance`` give no GRPO gradient; a dynamic
    sampler drops them and draws more prompts. Masked samples never count here.

    Args:
        samples: the batch.
        masked: extra per-sample mask (e.g. ``collate(...)["masked"]``).
        atol: rewards closer than this count as equal.

    Returns:
        One :class:`GroupSummary` per group, in order of first appearance.

    Raises:
        ContractError: an unmasked sample has no reward.
    """
    rewards, counts, _ = _valid_rewards(
        samples, None if masked is None else np.asarray(masked), False, 0.0)
    summaries = []
    for group_id, indices in group_indices(samples).items():
        idx = np.asarray(indices)
        values = rewards[idx[counts[idx]]]
        spread = float(values.max() - values.min()) if len(values) else 0.0
        summaries.append(GroupSummary(
            group_id=group_id,
            indices=tuple(indices),
            num_valid=len(values),
            reward_mean=float(values.mean()) if len(values) else None,
            reward_std=float(values.std()) if len(values) else None,
            all_masked=len(values) == 0,
            zero_variance=len(values) < 2 or spread <= atol,
        ))
    return summaries
