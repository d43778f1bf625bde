"""Trainer handoff: batch tensors, GRPO group helpers, and adapters to verl and XTuner.

verl: ``from_verl_batch`` (DataProto in), ``to_verl_outputs`` / ``to_verl_batch`` (out),
``masked_grpo_advantage`` (verl's estimator signature, our masked-sample semantics).

Importing this package needs numpy only; torch is imported when tensors are asked for
(``collate(..., return_tensors="pt")``, :func:`to_verl_batch`), so it needs the
``transformers`` extra (or any torch install) for those.
"""

from pipeline._data.stats import compute_stats
from pipeline._runner.fill import minimal_sample
from pipeline.batch._collate import check_alignment, collate, has_logprobs, has_rewards
from pipeline.batch._experts import ExpertsLayout, check_routed_experts
from pipeline.batch._groups import (
    GroupSummary,
    group_advantages,
    group_indices,
    summarize_groups,
)
from pipeline.batch._verl import (
    STATUS_KEYS,
    VERL_BATCH_KEYS,
    VERL_OPTIONAL_KEYS,
    VERL_WORKER_KEYS,
    reward_extra_info,
    to_verl_batch,
    to_verl_outputs,
)
from pipeline.batch._verl_grpo import GRPO_MASKED, masked_grpo_advantage
from pipeline.batch._verl_input import from_verl_batch
from pipeline.batch._xtuner import XTUNER_FINISH_REASON, XTUNER_STATE, to_xtuner

__all__ = [
    "GRPO_MASKED",
    "STATUS_KEYS",
    "VERL_BATCH_KEYS",
    "VERL_OPTIONAL_KEYS",
    "VERL_WORKER_KEYS",
    "XTUNER_FINISH_REASON",
    "XTUNER_STATE",
    "ExpertsLayout",
    "GroupSummary",
    "check_alignment",
    "check_routed_experts",
    "collate",
    "compute_stats",
    "from_verl_batch",
    "group_advantages",
    "group_indices",
    "has_logprobs",
    "has_rewards",
    "masked_grpo_advantage",
    "minimal_sample",
    "reward_extra_info",
    "summarize_groups",
    "to_verl_batch",
    "to_verl_outputs",
    "to_xtuner",
]
