"""Aggregate figures of a batch. Statistics never cost a batch: bad values are skipped and
counted, and a failure to compute them at all still returns what is known."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog

from pipeline import artifacts as A
from pipeline._data.models import (
    AgentRolloutItem,
    BatchStats,
    FinishReason,
    RolloutSample,
    Status,
    is_finite_number,
)

_logger = structlog.get_logger("pipeline")

COUNTER_LIMIT = 2**53
"""Largest counter value summed (exact as a float); larger ones are skipped as corrupt."""


def compute_stats(
    samples: Sequence[RolloutSample], items: Sequence[AgentRolloutItem], wall_time_s: float
) -> BatchStats:
    """Counts by status / finish / exit reason, tool turns, reward, latency, tokens, and the
    tool counters (calls, errors, template drift, rate-limiter wait) summed over items, and
    the samples a token-integrity check quarantined, by reason, and the samples whose agent
    sent fields the proxy ignored, by field.

    Counter artifacts that are not finite numbers in ``[0, 2**53]`` are left out of the
    sums and counted in ``skipped_values``.
    """
    skipped: Counter[str] = Counter()
    statuses: list[Status] = []
    finishes: list[FinishReason] = []
    exits: list[str] = []
    turns: list[int] = []
    reward_list: list[float] = []
    prompt_tokens = response_tokens = model_tokens = 0
    for s in samples:  # one pass: a batch holds thousands of samples
        statuses.append(s.status)  # the members, not .value: Enum's property is slow
        finishes.append(s.finish_reason)
        exits.append(s.exit_reason)
        turns.append(s.tool_turns)
        if s.reward is not None:
            reward_list.append(s.reward)
        prompt_tokens += len(s.prompt_ids)
        response_tokens += len(s.response_ids)
        model_tokens += sum(s.response_mask)
    rewards = np.array(reward_list, dtype=float)
    latencies = np.array([lat for it in items if (lat := _latency(it)) is not None], dtype=float)
    pct = np.percentile(latencies, [50, 95, 99]).tolist() if latencies.size else [None, None, None]
    integrity: Counter[str] = Counter()
    ignored: Counter[str] = Counter()
    resources: dict[str, float] = {}
    for item in items:
        artifacts: Any = item.artifacts
        if not isinstance(artifacts, dict):
            continue
        reason = artifacts.get(A.TOKEN_INTEGRITY)
        if isinstance(reason, str):
            integrity[reason] += 1
        extra = artifacts.get(A.EXTRA_FIELDS)
        fields = extra.get("ignored_fields") if isinstance(extra, dict) else None
        if isinstance(fields, list):
            ignored.update({field for field in fields if isinstance(field, str)})
        if isinstance(extra, dict) and "tool_create_wait_s" in extra:
            _add_resources(resources, extra)
    counters = _totals(items, (A.TOOL_CALLS, A.TOOL_ERRORS, A.TEMPLATE_DRIFT, A.LIMITER_WAIT_S),
                       skipped)
    return BatchStats(
        num_samples=len(samples),
        by_status={key.value: count for key, count in Counter(statuses).items()},
        by_finish_reason={key.value: count for key, count in Counter(finishes).items()},
        by_exit_reason=dict(Counter(exits)),
        tool_turns_mean=float(np.mean(turns)) if turns else 0.0,
        tool_turns_min=min(turns, default=0),
        tool_turns_max=max(turns, default=0),
        reward_mean=float(rewards.mean()) if rewards.size else None,
        reward_std=float(rewards.std()) if rewards.size else None,
        latency_p50_s=pct[0],
        latency_p95_s=pct[1],
        latency_p99_s=pct[2],
        latency_max_s=float(latencies.max()) if latencies.size else None,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        model_tokens=model_tokens,
        tool_calls=int(counters[0]),
        tool_errors=int(counters[1]),
        template_drift=int(counters[2]),
        limiter_wait_s=float(counters[3]),
        token_integrity=dict(integrity),
        ignored_fields=dict(ignored),
        tool_resources=resources,
        wall_time_s=wall_time_s,
        skipped_values=dict(skipped),
    )


_RESOURCE_FIELDS = {"warm": "tool_resources_warm", "create_failures": "tool_create_failures",
                    "create_wait_s": "tool_create_wait_s"}
"""BatchStats.tool_resources key -> the per-sample ``extra_fields`` key CallTools writes."""


def _add_resources(totals: dict[str, float], extra: dict[str, Any]) -> None:
    """Add one sample's per-trajectory tool resource figures to ``totals``."""
    totals["samples"] = totals.get("samples", 0) + 1
    for key, field in _RESOURCE_FIELDS.items():
        value = extra.get(field)
        if isinstance(value, int | float) and not isinstance(value, bool):
            totals[key] = totals.get(key, 0) + value


def safe_stats(
    samples: Sequence[RolloutSample], items: Sequence[AgentRolloutItem], wall_time_s: float
) -> BatchStats:
    """:func:`compute_stats`, or, if it raises anyway, the counts by status with ``error``
    set: the batch's samples are worth more than its statistics."""
    try:
        return compute_stats(samples, items, wall_time_s)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        _logger.error("batch_stats_failed", error=error)
        return BatchStats(
            num_samples=len(samples),
            by_status=dict(Counter(str(s.status) for s in samples)),
            by_finish_reason={}, by_exit_reason={}, tool_turns_mean=0.0, tool_turns_min=0,
            tool_turns_max=0, reward_mean=None, reward_std=None, latency_p50_s=None,
            latency_p95_s=None, latency_p99_s=None, latency_max_s=None, prompt_tokens=0,
            response_tokens=0, model_tokens=0, wall_time_s=wall_time_s, error=error,
        )


def _latency(item: AgentRolloutItem) -> float | None:
    latency: Any = item.latency_s
    return latency if is_finite_number(latency) else None


def _totals(items: Sequence[AgentRolloutItem], keys: tuple[str, ...],
            skipped: Counter[str]) -> list[float]:
    """Sums of numeric counter artifacts over items (one pass); values that are not finite
    numbers in ``[0, COUNTER_LIMIT]`` (a custom stage's own meaning, or a bug) are skipped
    and counted."""
    totals = [0.0] * len(keys)
    for item in items:
        artifacts: Any = item.artifacts
        if not isinstance(artifacts, dict):
            continue
        for k, key in enumerate(keys):
            value = artifacts.get(key)
            if value is None:
                continue
            if is_finite_number(value) and 0 <= value <= COUNTER_LIMIT:
                totals[k] += float(value)
            else:
                skipped[key] += 1
    return [total if math.isfinite(total) else 0.0 for total in totals]
