"""The torch engine's worker-side records (requests, the decoding batch, counters), the
batch's row and cache operations, and the small helpers it uses across the thread boundary."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pipeline._data.config import SamplingParams
from pipeline.engines._base import Generation
from pipeline.engines._torch_sampling import LogitsProcessor


@dataclass
class EngineCounters:
    """What the worker did; read them for benchmarks and to check batching."""

    requests: int = 0
    prefill_calls: int = 0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0
    max_batch_rows: int = 0
    generated_tokens: int = 0

    @property
    def mean_batch_rows(self) -> float:
        """Average number of rows per decode step."""
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0


@dataclass(eq=False)
class Request:
    """One generate call as the worker thread sees it."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    limit: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Generation]
    generator: torch.Generator
    processor: LogitsProcessor | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    """The policy version current at each sampled token's step."""
    aborted: bool = False
    finished: bool = False
    images: Any = None
    """The request's ``MultiModalInputs`` (pixel inputs of its image tokens), or None."""


@dataclass(eq=False)
class Batch:
    """The rows decoding together and their shared KV cache."""

    rows: list[Request]
    cache: Any
    mask: torch.Tensor  # [rows, cached positions], 1 = real token
    positions: torch.Tensor  # [rows] position id of each row's next token
    last: torch.Tensor  # [rows] last sampled token (the next decode input)


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every eos id the model's generation config, config and tokenizer name."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def new_cache(pairs: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """A transformers ``DynamicCache``, optionally filled with ``(keys, values)`` per layer."""
    from transformers import DynamicCache

    return DynamicCache(pairs) if pairs else DynamicCache()


def kv_pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(keys, values)`` of each layer of a ``DynamicCache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any,
             error: BaseException | None) -> None:
    """Settle ``future`` on its own loop; a closed loop or a cancelled waiter is ignored."""
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody waits any more
        pass


def keep_rows(batch: Batch, keep: list[int]) -> Batch | None:
    """``batch`` cut to the rows at ``keep`` (None when none is left), with the cache columns
    that no remaining row uses trimmed from the left."""
    if not keep:
        return None
    index = torch.tensor(keep, device=batch.mask.device)
    mask = batch.mask[index]
    start = int(mask.any(0).int().argmax())  # first column some remaining row uses
    pairs = [(k[index, :, start:], v[index, :, start:]) for k, v in kv_pairs(batch.cache)]
    return Batch([batch.rows[i] for i in keep], new_cache(pairs), mask[:, start:],
                 batch.positions[index], batch.last[index])


def merge_batches(old: Batch | None, new: Batch | None) -> Batch | None:
    """One batch of ``old``'s rows then ``new``'s, both left-padded to the wider cache."""
    if old is None or new is None:
        return old or new
    width = max(old.mask.shape[1], new.mask.shape[1])

    def pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
        amount = width - t.shape[-dim_from_end]
        return F.pad(t, (0, 0) * (dim_from_end - 1) + (amount, 0)) if amount else t

    pairs = [(torch.cat([pad(ko, 2), pad(kn, 2)]), torch.cat([pad(vo, 2), pad(vn, 2)]))
             for (ko, vo), (kn, vn) in zip(kv_pairs(old.cache), kv_pairs(new.cache),
                                           strict=True)]
    return Batch(old.rows + new.rows, new_cache(pairs),
                 torch.cat([pad(old.mask, 1), pad(new.mask, 1)]),
                 torch.cat([old.positions, new.positions]), torch.cat([old.last, new.last]))
