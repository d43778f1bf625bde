"""GRPO advantages with our masked-sample semantics, in verl's estimator signature.

verl's ``compute_grpo_outcome_advantage`` has no notion of a masked sample: a failed sample
enters its group's mean and std as reward 0 (shifting its group-mates' advantages), and a
group left with one sample gets mean 0 / std 1 (its advantage is its raw reward). Here a row
whose ``response_mask`` is all zero (every masked sample :func:`to_verl_batch` emits) is left
out of its group's statistics, and a group with fewer than two counted rows gets advantage 0,
as :func:`group_advantages` computes. Register it with verl under a name
(``pipeline.integrations.verl`` registers ``"grpo_masked"``) and set
``algorithm.adv_estimator`` to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GRPO_MASKED = "grpo_masked"
"""The name ``pipeline.integrations.verl`` registers :func:`masked_grpo_advantage` under."""


def masked_grpo_advantage(
    token_level_rewards: Any,
    response_mask: Any,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **_: Any,
) -> tuple[Any, Any]:
    """verl's GRPO outcome advantage, leaving rows with no loss tokens out of the groups.

    Args:
        token_level_rewards: ``[B, R]`` torch tensor; a row's reward is its sum.
        response_mask: ``[B, R]``; a row that is all zero counts as masked.
        index: ``[B]`` group ids (verl's ``uid`` column).
        epsilon: added to the std.
        norm_adv_by_std_in_grpo: divide by the std (GRPO); False: Dr. GRPO. verl's algorithm
            config (``config.norm_adv_by_std_in_grpo``) wins when given.
        config: verl's ``AlgoConfig`` (or None).

    Returns:
        ``(advantages, returns)``, both ``[B, R]``: the row's advantage on its loss tokens.
    """
    import torch

    if config is not None:
        norm_adv_by_std_in_grpo = bool(config.get("norm_adv_by_std_in_grpo",
                                                  norm_adv_by_std_in_grpo))
    scores = token_level_rewards.sum(dim=-1).double()
    counted = response_mask.sum(dim=-1) > 0
    advantages = torch.zeros_like(scores)
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(index.tolist() if isinstance(index, np.ndarray) else index):
        if counted[i]:
            groups.setdefault(key, []).append(i)
    for rows in groups.values():
        if len(rows) < 2:
            continue
        idx = torch.tensor(rows)
        values = scores[idx]
        centred = values - values.mean()
        advantages[idx] = centred / (values.std() + epsilon) if norm_adv_by_std_in_grpo \
            else centred
    out = advantages.to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return out, out
