"""Aggregate figures of a batch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from pipeline import artifacts as A
from pipeline._models import AgentRolloutItem, BatchStats, RolloutSample


def compute_stats(
    samples: Sequence[RolloutSample], items: Sequence[AgentRolloutItem], wall_time_s: float
) -> BatchStats:
    """Counts by status / finish / exit reason, tool turns, reward, latency, tokens, and the
    tool counters (calls, errors, template drift, rate-limiter wait) summed over items."""
    turns = [s.tool_turns for s in samples]
    rewards = np.array([s.reward for s in samples if s.reward is not None], dtype=float)
    latencies = np.array([lat for it in items if (lat := it.latency_s) is not None], dtype=float)
    pct = np.percentile(latencies, [50, 95, 99]).tolist() if latencies.size else [None, None, None]
    return BatchStats(
        num_samples=len(samples),
        by_status=dict(Counter(s.status.value for s in samples)),
        by_finish_reason=dict(Counter(s.finish_reason.value for s in samples)),
        by_exit_reason=dict(Counter(s.exit_reason for s in samples)),
        tool_turns_mean=float(np.mean(turns)) if turns else 0.0,
        tool_turns_min=min(turns, default=0),
        tool_turns_max=max(turns, default=0),
        reward_mean=float(rewards.mean()) if rewards.size else None,
        reward_std=float(rewards.std()) if rewards.size else None,
        latency_p50_s=pct[0],
        latency_p95_s=pct[1],
        latency_p99_s=pct[2],
        latency_max_s=float(latencies.max()) if latencies.size else None,
        prompt_tokens=sum(len(s.prompt_ids) for s in samples),
        response_tokens=sum(len(s.response_ids) for s in samples),
        model_tokens=sum(sum(s.response_mask) for s in samples),
        tool_calls=int(_total(items, A.TOOL_CALLS)),
        tool_errors=int(_total(items, A.TOOL_ERRORS)),
        template_drift=int(_total(items, A.TEMPLATE_DRIFT)),
        limiter_wait_s=float(_total(items, A.LIMITER_WAIT_S)),
        wall_time_s=wall_time_s,
    )


def _total(items: Sequence[AgentRolloutItem], key: str) -> float:
    """Sum of a numeric counter artifact; a custom stage's non-number under the key is skipped
    (statistics must never cost the batch)."""
    values = (it.artifacts.get(key) for it in items)
    return sum(v for v in values if isinstance(v, int | float) and not isinstance(v, bool))
