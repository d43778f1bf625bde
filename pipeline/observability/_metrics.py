"""Per-batch metrics and the sinks they go to (structlog, TensorBoard, your own).

:func:`batch_metrics` turns a :class:`~pipeline.ProduceBatchResult` into flat
``{"rollout/<name>": float}`` metrics. Keys (``<s>`` a status, ``<f>`` a finish reason,
``<e>`` an exit reason, ``<stage>`` a stage name):

==================================================  ==========================================
``rollout/num_samples``                             samples in the batch
``rollout/status/<s>``                              count per status (all four always present)
``rollout/finish_reason/<f>``                       count per finish reason (all always present)
``rollout/exit_reason/<e>``                         count per exit reason (built-ins always)
``rollout/masked_frac``                             share of samples masked out of the loss
``rollout/tool_turns/{mean,min,max}``               tool-call rounds per sample
``rollout/response_len/{mean,min,max}``             response tokens per sample
``rollout/response_len/clip_frac``                  share ending with finish_reason=length
``rollout/prompt_len/{mean,max}``                   prompt tokens per sample
``rollout/tokens/{prompt,response,model}``          token totals (model = sampled tokens)
``rollout/wall_time_s``                             the batch's wall time
``rollout/throughput/{samples,model_tokens}_per_s`` over the wall time
``rollout/tool_calls``                              tool calls answered, summed over samples
``rollout/tool_errors``                             tool calls answered with an error, summed
``rollout/tool_error_frac``                         tool_errors / tool_calls (0 without calls)
``rollout/template_drift``                          samples with template drift in any turn
``rollout/template_drift_turns``                    drifted tool turns, summed over samples
``rollout/token_integrity/<r>``                     samples quarantined by a token-integrity
                                                    check, per reason (``decode``,
                                                    ``logprobs``, ``prefix``; all always)
``rollout/reward/{mean,std,min,max}``               only when some sample has a reward
``rollout/latency_s/{mean,p50,p95,p99,max}``        only when samples ran (running time)
``rollout/queue_s/{mean,max}``                      wait for a concurrency slot, same condition
``rollout/limiter_wait_s/{mean,max,total}``         only when samples report ``limiter_wait_s``
``rollout/limiter/<name>/{grants,wait_p50_s,...}``  only with ``limiters=`` (a registry)
``rollout/stage_s/<stage>/{mean,max}``              seconds per sample in each stage (run phase,
                                                    summed over loop turns)
``rollout/stuck/<stage>``                           samples with one run of that stage longer
                                                    than ``stuck_stage_s`` (stages that ran)
``rollout/flow/<key>``                              only with ``flow=pipeline.flow_state()``:
                                                    the concurrency limit and its bounds,
                                                    samples admitted, engine KV use, running
                                                    and queue, preemptions, ``changes``,
                                                    ``breaker/open`` and ``errors_in_a_row``,
                                                    ``servers/<host:port>/{healthy,downs}``
==================================================  ==========================================

Counters come from artifacts (see ``records.COUNTER_KEYS``): ``tool_calls``, ``tool_errors``
and ``template_drift`` as ``CallTools`` counts them, and ``limiter_wait_s`` (seconds the
sample waited on rate limiters). A :class:`MetricsSink` is one method,
``log(metrics, step)``; a wandb run (``wandb.init()``) already fits it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import structlog

from pipeline._data.models import ExitReason, FinishReason, ProduceBatchResult, Status
from pipeline._text.integrity import REASONS as INTEGRITY_REASONS
from pipeline.observability._records import counter_value

PREFIX = "rollout/"

ALWAYS_KEYS: tuple[str, ...] = (
    "rollout/num_samples",
    *(f"rollout/status/{s.value}" for s in Status),
    *(f"rollout/finish_reason/{f.value}" for f in FinishReason),
    *(f"rollout/exit_reason/{e.value}" for e in ExitReason),
    "rollout/masked_frac",
    "rollout/tool_turns/mean", "rollout/tool_turns/min", "rollout/tool_turns/max",
    "rollout/response_len/mean", "rollout/response_len/min", "rollout/response_len/max",
    "rollout/response_len/clip_frac",
    "rollout/prompt_len/mean", "rollout/prompt_len/max",
    "rollout/tokens/prompt", "rollout/tokens/response", "rollout/tokens/model",
    "rollout/wall_time_s",
    "rollout/throughput/samples_per_s", "rollout/throughput/model_tokens_per_s",
    "rollout/tool_calls", "rollout/tool_errors", "rollout/tool_error_frac",
    "rollout/template_drift", "rollout/template_drift_turns",
    *(f"rollout/token_integrity/{r}" for r in INTEGRITY_REASONS),
)
"""Keys every non-empty batch's metrics have (the conditional ones are in the table above)."""


@runtime_checkable
class MetricsSink(Protocol):
    """Where metrics go: one call per batch."""

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` for trainer step ``step``."""
        ...


def batch_metrics(result: ProduceBatchResult, *, limiters: Any = None,
                  stuck_stage_s: float | None = 300.0,
                  flow: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Flat metrics of one batch (keys in the module docstring).

    Args:
        result: what ``Pipeline.run_batch`` returned.
        limiters: a rate-limiter registry (anything with ``stats() -> {name: stats}``,
            stats having ``grants``, ``timeouts``, ``wait_p50_s``, ``wait_p99_s``); its
            figures go under ``rollout/limiter/<name>/``.
        stuck_stage_s: a stage run longer than this counts its sample under
            ``rollout/stuck/<stage>`` (pass the pipeline config's; None: no such keys).
        flow: the pipeline's flow control (``Pipeline.flow_state()``): its numbers go under
            ``rollout/flow/``.

    Returns:
        Metric name -> value; conditional keys are left out rather than set to NaN.
    """
    stats, samples, items = result.stats, result.samples, result.items
    n = len(samples)
    out: dict[str, float] = {f"{PREFIX}num_samples": float(n)}
    _counts(out, "status", [s.value for s in Status], stats.by_status)
    _counts(out, "finish_reason", [f.value for f in FinishReason], stats.by_finish_reason)
    _counts(out, "exit_reason", [e.value for e in ExitReason], stats.by_exit_reason)
    out[f"{PREFIX}masked_frac"] = _frac(sum(s.masked for s in samples), n)
    out[f"{PREFIX}tool_turns/mean"] = stats.tool_turns_mean
    out[f"{PREFIX}tool_turns/min"] = float(stats.tool_turns_min)
    out[f"{PREFIX}tool_turns/max"] = float(stats.tool_turns_max)
    _spread(out, "response_len", [len(s.response_ids) for s in samples], ("mean", "min", "max"))
    out[f"{PREFIX}response_len/clip_frac"] = _frac(
        sum(s.finish_reason is FinishReason.LENGTH for s in samples), n)
    _spread(out, "prompt_len", [len(s.prompt_ids) for s in samples], ("mean", "max"))
    out[f"{PREFIX}tokens/prompt"] = float(stats.prompt_tokens)
    out[f"{PREFIX}tokens/response"] = float(stats.response_tokens)
    out[f"{PREFIX}tokens/model"] = float(stats.model_tokens)
    out[f"{PREFIX}wall_time_s"] = stats.wall_time_s
    wall = stats.wall_time_s
    out[f"{PREFIX}throughput/samples_per_s"] = n / wall if wall > 0 else 0.0
    out[f"{PREFIX}throughput/model_tokens_per_s"] = stats.model_tokens / wall if wall > 0 else 0.0
    calls, errors = _total(items, "tool_calls"), _total(items, "tool_errors")
    out[f"{PREFIX}tool_calls"] = calls
    out[f"{PREFIX}tool_errors"] = errors
    out[f"{PREFIX}tool_error_frac"] = errors / calls if calls else 0.0
    drift = [counter_value(it.artifacts["template_drift"]) for it in items
             if "template_drift" in it.artifacts]
    out[f"{PREFIX}template_drift"] = float(sum(d > 0 for d in drift))
    out[f"{PREFIX}template_drift_turns"] = float(sum(drift))
    _counts(out, "token_integrity", list(INTEGRITY_REASONS), stats.token_integrity)
    rewards = [s.reward for s in samples if s.reward is not None]
    if rewards:
        out[f"{PREFIX}reward/mean"] = float(np.mean(rewards))
        out[f"{PREFIX}reward/std"] = float(np.std(rewards))
        out[f"{PREFIX}reward/min"] = float(min(rewards))
        out[f"{PREFIX}reward/max"] = float(max(rewards))
    latencies = [lat for it in items if (lat := it.latency_s) is not None]
    _spread(out, "latency_s", latencies, ("mean", "p50", "p95", "p99", "max"))
    queued = [it.started_at - it.queued_at for it in items
              if it.started_at is not None and it.queued_at is not None]
    _spread(out, "queue_s", queued, ("mean", "max"))
    waits = [counter_value(it.artifacts["limiter_wait_s"]) for it in items
             if "limiter_wait_s" in it.artifacts]
    _spread(out, "limiter_wait_s", waits, ("mean", "max", "total"))
    if limiters is not None:
        out.update(limiter_metrics(limiters))
    if flow is not None:
        _flatten(out, "flow", flow)
    per_stage: dict[str, list[float]] = defaultdict(list)
    stuck: Counter[str] = Counter()
    for it in items:
        spent: dict[str, float] = defaultdict(float)
        stuck_in: set[str] = set()
        for r in it.records:
            if r.phase == "run" and r.end is not None:
                spent[r.name] += r.end - r.start
                if stuck_stage_s is not None and r.end - r.start > stuck_stage_s:
                    stuck_in.add(r.name)
        for name, seconds in spent.items():
            per_stage[name].append(seconds)
        stuck.update(stuck_in)
    for name, values in sorted(per_stage.items()):
        _spread(out, f"stage_s/{name}", values, ("mean", "max"))
        if stuck_stage_s is not None:
            out[f"{PREFIX}stuck/{name}"] = float(stuck[name])
    return out


def limiter_metrics(limiters: Any) -> dict[str, float]:
    """``rollout/limiter/<name>/...`` figures of a rate-limiter registry's buckets."""
    out: dict[str, float] = {}
    for name, bucket in sorted(limiters.stats().items()):
        for field in ("grants", "timeouts", "cancelled", "queue_len", "wait_p50_s", "wait_p99_s"):
            value = getattr(bucket, field, None)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"{PREFIX}limiter/{name}/{field}"] = float(value)
    return out


def log_batch_metrics(result: ProduceBatchResult, sinks: Iterable[MetricsSink], step: int, *,
                      limiters: Any = None, stuck_stage_s: float | None = 300.0,
                      flow: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Compute :func:`batch_metrics` and hand them to every sink.

    Returns:
        The metrics logged.
    """
    metrics = batch_metrics(result, limiters=limiters, stuck_stage_s=stuck_stage_s,
                            flow=flow)
    for sink in sinks:
        sink.log(metrics, step)
    return metrics


class StructlogSink:
    """Logs each batch's metrics as one structlog event (``rollout_metrics`` by default).

    Args:
        logger: a structlog logger (default: ``structlog.get_logger("pipeline")``).
        event: the event name.
    """

    def __init__(self, logger: Any = None, *, event: str = "rollout_metrics") -> None:
        self.logger = logger if logger is not None else structlog.get_logger("pipeline")
        self.event = event

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Emit one event with ``step`` and every metric as a key=value pair."""
        self.logger.info(self.event, step=step, **{k: _plain(v) for k, v in metrics.items()})


def _counts(out: dict[str, float], name: str, known: list[str], counts: Mapping[str, int]) -> None:
    merged = Counter(dict.fromkeys(known, 0))
    merged.update(counts)
    for key, count in merged.items():
        out[f"{PREFIX}{name}/{key}"] = float(count)


def _spread(out: dict[str, float], name: str, values: list[float] | list[int],
            which: tuple[str, ...]) -> None:
    if not values:
        return
    arr = np.asarray(values, dtype=float)
    for stat in which:
        if stat.startswith("p"):
            value = float(np.percentile(arr, float(stat[1:])))
        elif stat == "mean":
            value = float(arr.mean())
        elif stat == "min":
            value = float(arr.min())
        elif stat == "max":
            value = float(arr.max())
        else:
            value = float(arr.sum())
        out[f"{PREFIX}{name}/{stat}"] = value


def _flatten(out: dict[str, float], name: str, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, Mapping):
            _flatten(out, f"{name}/{key}", value)
        elif isinstance(value, int | float):  # bools too: an open breaker is 1.0
            out[f"{PREFIX}{name}/{key}"] = float(value)


def _total(items: Iterable[Any], key: str) -> float:
    return float(sum(counter_value(it.artifacts[key]) for it in items if key in it.artifacts))


def _frac(count: int, total: int) -> float:
    return count / total if total else 0.0


def _plain(value: float) -> float | int:
    return int(value) if float(value).is_integer() and abs(value) < 2**53 else round(value, 6)
