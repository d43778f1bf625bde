"""The summary ``rollout run`` prints after a batch: the batch's figures, and for a ``--family``
run the family's parsers at work and the token checks."""

from __future__ import annotations

from pipeline._data.models import ProduceBatchResult


def summary(result: ProduceBatchResult) -> str:
    """The summary table ``rollout run`` prints: one aligned line per figure."""
    s = result.stats

    def fmt(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:.3f}{unit}"

    # quarantined samples (token integrity) get a line only when there are some
    integrity = [("token integrity failed", f"{sum(s.token_integrity.values())} ("
                  + ", ".join(f"{k}={v}" for k, v in sorted(s.token_integrity.items())) + ")")
                 ] if s.token_integrity else []
    lines = [
        ("samples", str(s.num_samples)),
        ("status", ", ".join(f"{k}={v}" for k, v in sorted(s.by_status.items()))),
        ("finish_reason", ", ".join(f"{k}={v}" for k, v in sorted(s.by_finish_reason.items()))),
        ("exit_reason", ", ".join(f"{k}={v}" for k, v in sorted(s.by_exit_reason.items()))),
        ("reward mean/std", f"{fmt(s.reward_mean)} / {fmt(s.reward_std)}"),
        ("tool calls/errors/drift", f"{s.tool_calls} / {s.tool_errors} / {s.template_drift}"),
        *integrity,
        (
            "tool turns mean/min/max",
            f"{s.tool_turns_mean:.2f} / {s.tool_turns_min} / {s.tool_turns_max}",
        ),
        (
            "latency p50/p99/max",
            f"{fmt(s.latency_p50_s, 's')} / {fmt(s.latency_p99_s, 's')} / "
            f"{fmt(s.latency_max_s, 's')}",
        ),
        (
            "tokens prompt/response/model",
            f"{s.prompt_tokens} / {s.response_tokens} / {s.model_tokens}",
        ),
        (
            "wall time",
            f"{s.wall_time_s:.2f}s ({s.num_samples / max(s.wall_time_s, 1e-9):.1f} samples/s)",
        ),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


def family_summary(name: str, scripted: bool, result: ProduceBatchResult) -> str:
    """What a ``--family`` run shows: the family's parsers at work and the token checks
    (``scripted``: the replies were the simulated engine's, in the family's format)."""
    from pipeline import artifacts as A
    from pipeline.families import get_family

    family = get_family(name)
    turns = reasoning = calls = unreadable = exact = 0
    for item, sample in zip(result.items, result.samples, strict=True):
        assistants = [m for m in item.artifacts.get(A.MESSAGES, ()) if m.role == "assistant"]
        turns += len(assistants)
        reasoning += sum(1 for m in assistants if (m.model_extra or {}).get("reasoning_content"))
        calls += sum(len(m.tool_calls or ()) for m in assistants)
        unreadable += sum(len((m.model_extra or {}).get("tool_call_errors") or {})
                          for m in assistants)
        # the trainer's mask-1 tokens against what the engine sampled, turn by turn
        model = [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if m]
        exact += model == [t for m in assistants for t in (m.token_ids or ())]
    mismatches = sum(result.stats.token_integrity.values())
    parsers = " + ".join(p for p in (family.tool_parser, family.reasoning_parser) if p)
    who = ("scripted replies in the family's format: the machinery, not skill" if scripted
           else "the family's tiny random-weight model: the machinery, not skill")
    return "\n".join([
        f"family {family.name}: {who}",
        f"  parsers {parsers}; stop ids {', '.join(map(str, family.stop_token_ids))}",
        f"  assistant turns {turns}: {calls} tool calls parsed ({unreadable} unreadable), "
        f"{reasoning} with reasoning_content",
        f"  token integrity: {mismatches} mismatches; mask-1 tokens == sampled tokens in "
        f"{exact} of {len(result.samples)} samples",
    ])
