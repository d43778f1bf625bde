"""Sampling on logits for the torch engine: per-row processors, temperature, top-k/top-p,
and the logprob of the distribution each token was actually drawn from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pipeline._data.config import SamplingParams
from pipeline._exceptions import EngineError

LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]
"""``(ids generated so far, logits [vocab]) -> logits``; runs before temperature/top-k/top-p,
so its effect is part of the distribution that is sampled from and reported."""

ProcessorFactory = Callable[[str, Sequence[int]], LogitsProcessor | None]
"""``(request_id, prompt_ids) -> processor or None``: picks a processor per request."""


class ProcessedRow(Protocol):
    """What :func:`apply_processors` reads of a request in the batch."""

    @property
    def request_id(self) -> str: ...

    @property
    def tokens(self) -> Sequence[int]: ...

    @property
    def processor(self) -> LogitsProcessor | None: ...


def apply_processors(rows: Sequence[ProcessedRow],
                     logits: torch.Tensor) -> list[EngineError | None]:
    """Run each row's logits processor in place; a processor that raises or allows no
    token fails its own request only (its row is neutralised for this step)."""
    errors: list[EngineError | None] = []
    for i, request in enumerate(rows):
        error = None
        if request.processor is not None:
            try:
                logits[i] = request.processor(request.tokens, logits[i])
                if not bool(torch.isfinite(logits[i]).any()):
                    error = EngineError(f"request {request.request_id}: the logits "
                                        "processor allowed no token")
            except Exception as exc:
                error = EngineError(f"request {request.request_id}: the logits processor "
                                    f"raised {type(exc).__name__}: {exc}")
                error.__cause__ = exc
            if error is not None:
                logits[i] = 0.0
        errors.append(error)
    return errors


def sample_rows(logits: torch.Tensor, sampling: Sequence[SamplingParams],
                generators: Sequence[torch.Generator]
                ) -> tuple[torch.Tensor, list[int], list[float]]:
    """Sample one token per row with its own temperature, top-k, top-p and generator.

    ``logits`` are ``[rows, vocab]`` float32, after any logits processor. Returns the tokens
    (as a tensor on the logits' device, and as a list) and their logprobs under the processed
    distribution each was drawn from.
    """
    temps = torch.tensor([s.temperature for s in sampling], device=logits.device)
    greedy = temps == 0
    logits = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logits = filter_top_k_top_p(
        logits, torch.tensor([s.top_k for s in sampling], device=logits.device),
        torch.tensor([s.top_p for s in sampling], device=logits.device))
    logp = torch.log_softmax(logits, dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    # 1 - U[0, 1) lies in (0, 1]: the first index where the cdf reaches it has mass > 0.
    u = torch.stack([1.0 - torch.rand((), generator=g) for g in generators])
    drawn = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None]).squeeze(1)
    drawn = drawn.clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, logp.argmax(dim=-1), drawn)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    both = torch.stack([tokens.double(), chosen.double()]).tolist()  # one device sync
    return tokens, [int(t) for t in both[0]], both[1]


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (``-1``/``1.0`` = off)."""
    use_k, use_p = top_k > 0, top_p < 1.0
    if not bool(use_k.any() or use_p.any()):
        return logits
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    remove = use_k[:, None] & (rank >= top_k.clamp(min=1)[:, None])
    if bool(use_p.any()):
        probs = torch.softmax(ordered.masked_fill(remove, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
        remove |= use_p[:, None] & (before >= top_p[:, None]) & (rank > 0)
    ordered = ordered.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)
