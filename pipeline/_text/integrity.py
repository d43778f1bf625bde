"""Live token-integrity checks: is what the trainer will see what the agent saw?

Three checks run on every turn, in the tool loop (``Generate``) and in the proxy
(``TurnRunner``), each a reason of :class:`pipeline.TokenIntegrityError`:

``decode``
    the sampled ids decode (``skip_special_tokens=True``, the decode the agent's text comes
    from) to exactly the text the agent saw: the engine's own text when it reports one
    (``Generation.text``), and in the proxy the reply it sent (before a stop-string cut);
``logprobs``
    one logprob per sampled token;
``prefix``
    the next engine prompt extends the previous turn's whole sequence (prompt, sampled
    tokens, and the template delta after them). In the loop this holds by construction, so it
    is checked cheaply: the prompt is the same list with the same length and end tokens, and
    the response still holds every turn's boundary token at its position. In the proxy the
    new request's prompt ids are compared in full with the segment they extend; a request
    that starts a new segment (a documented split: ``edited``, ``truncated``, ``retry``, ...)
    is not a mismatch.

A failed check quarantines the sample: it ends ``failed`` (masked) with the error
``token integrity: <reason>: turn <k>: <detail>`` and ``artifacts.TOKEN_INTEGRITY`` set to
the reason; the batch statistics count samples per reason (``BatchStats.token_integrity``).
``PipelineConfig(token_integrity_checks=False)`` (``ProxyConfig`` alike) turns the checks off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline._exceptions import TokenIntegrityError
from pipeline._text.render import common_prefix_length

DECODE = "decode"
LOGPROBS = "logprobs"
PREFIX = "prefix"
REASONS: tuple[str, ...] = (DECODE, LOGPROBS, PREFIX)
"""The checks, by the reason a failed one reports."""

MARKS = "_token_integrity_marks"
"""Private artifact of the loop's prefix check: ``(id of the prompt list, prompt length, prompt
end token, hash of the prompt ids, then position and token of each turn boundary in the
response ...)``. A flat tuple of ints, which the cyclic collector stops tracking: a finished
sample keeps it, and a list (holding the prompt list) was one more object to walk per sample.
A prompt list with another id must hash the same; one that reuses a freed list's address is
checked by its length and end token only, as the same list changed in place always was."""


def decode_mismatch(decoded: str, seen: str, *, prefix: bool = False) -> str | None:
    """None when ``decoded`` is ``seen`` (or, with ``prefix``, starts with it), else what
    differs, with the first differing character position."""
    if decoded == seen or (prefix and decoded.startswith(seen)):
        return None
    at = common_prefix_length(decoded, seen)
    return (f"the ids decode to {decoded[at:at + 40]!r} at character {at} but the agent saw "
            f"{seen[at:at + 40]!r} ({len(decoded)} vs {len(seen)} characters)")


def logprobs_mismatch(token_ids: Sequence[int], logprobs: Sequence[float] | None) -> str | None:
    """None when there is one logprob per sampled token (or none were returned at all)."""
    if logprobs is None or len(logprobs) == len(token_ids):
        return None
    return f"{len(logprobs)} logprobs for {len(token_ids)} sampled tokens"


def prefix_mismatch(previous: Sequence[int], prompt: Sequence[int]) -> str | None:
    """None when ``prompt`` starts with ``previous``, else the first position that differs."""
    n = len(previous)
    if len(prompt) >= n and (prompt[:n] == previous
                             or list(prompt[:n]) == list(previous)):
        return None
    if len(prompt) < n:
        return (f"the prompt has {len(prompt)} tokens, fewer than the previous turn's "
                f"{n}")
    at = next(i for i in range(n) if prompt[i] != previous[i])
    return (f"the prompt differs from the previous turn's sequence at position {at} "
            f"(token {prompt[at]} instead of {previous[at]})")


def mark_turn(art: dict[str, Any], prompt: list[int], response: list[int]) -> None:
    """Remember where the loop's sequence ends now (after a turn or its template delta)."""
    marks: tuple[Any, ...] | None = art.get(MARKS)
    if marks is None:
        marks = (id(prompt), len(prompt), prompt[-1] if prompt else None, hash(tuple(prompt)))
    if response:
        marks += (len(response) - 1, response[-1])
    art[MARKS] = marks


def loop_prefix_mismatch(art: dict[str, Any], prompt: list[int],
                         response: list[int]) -> str | None:
    """The loop's cheap prefix check before a turn (see the module doc)."""
    marks: tuple[Any, ...] | None = art.get(MARKS)
    if marks is None:
        return None
    if marks[0] != id(prompt):  # a new list (rare): it must hold the same ids
        if len(prompt) != marks[1] or hash(tuple(prompt)) != marks[3]:
            return (f"the prompt ids were replaced between turns by different ones "
                    f"({len(prompt)} tokens, {marks[1]} before)")
        art[MARKS] = marks = (id(prompt), *marks[1:])
    if len(prompt) != marks[1] or (prompt and prompt[-1] != marks[2]):
        return (f"the prompt ids changed between turns ({len(prompt)} tokens, {marks[1]} "
                f"before)")
    n = len(response)
    for k in range(4, len(marks), 2):
        at, token = marks[k], marks[k + 1]
        if at >= n or response[at] != token:
            got = "nothing" if at >= n else f"token {response[at]}"
            return (f"the response no longer extends the previous turn: position {at} holds "
                    f"{got} instead of token {token}")
    return None


def fail(reason: str, turn: int, detail: str) -> TokenIntegrityError:
    """The error that quarantines a sample (raise it)."""
    return TokenIntegrityError(reason, turn, detail)
