"""Trainer handoff: batch tensors, GRPO group helpers, and adapters to verl and XTuner.

Importing this package needs numpy only; torch is imported when tensors are asked for
(``collate(..., return_tensors="pt")``, :func:`to_verl_batch`), so it needs the
``transformers`` extra (or any torch install) for those.
"""

from pipeline._fill import minimal_sample
from pipeline._stats import compute_stats
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
    to_verl_batch,
    to_verl_outputs,
)
from pipeline.batch._xtuner import XTUNER_FINISH_REASON, XTUNER_STATE, to_xtuner

__all__ = [
    "STATUS_KEYS",
    "VERL_BATCH_KEYS",
    "VERL_OPTIONAL_KEYS",
    "XTUNER_FINISH_REASON",
    "XTUNER_STATE",
    "ExpertsLayout",
    "GroupSummary",
    "check_alignment",
    "check_routed_experts",
    "collate",
    "compute_stats",
    "group_advantages",
    "group_indices",
    "has_logprobs",
    "has_rewards",
    "minimal_sample",
    "summarize_groups",
    "to_verl_batch",
    "to_verl_outputs",
    "to_xtuner",
]
