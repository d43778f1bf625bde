"""The torch engine's two forward passes, on its worker thread: the prefill of new rows
(left-padded, with an attention mask and per-row position ids; a vision-language model's
images with its own 3-D positions) and one decode step of the running batch. What the rows
then sample, and which leave, is the engine's (:mod:`pipeline.engines.transformers`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.engines._torch_worker import Batch, EngineCounters, Request, new_cache


class ModelSteps:
    """Forward passes of one model, counted in ``counters``.

    Args:
        model: the causal LM, already on its device.
        pad_token_id: the id left-padded rows are filled with.
        counters: the engine's counters (prefills, decode steps, rows).
    """

    def __init__(self, model: Any, pad_token_id: int, counters: EngineCounters) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.counters = counters
        self.device = next(model.parameters()).device
        self.step_valid: torch.Tensor | None = None
        """Which input positions of the last forward were real tokens (router capture)."""
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # vision-language models (the Qwen2-VL family): their mrope position function and
        # image token; None for text models
        inner = getattr(model, "model", None)
        self._rope_index: Callable[..., Any] | None = getattr(inner, "get_rope_index", None)
        self._image_token_id = getattr(model.config, "image_token_id", None)
        self._dtype = next(model.parameters()).dtype

    @property
    def takes_images(self) -> bool:
        """Whether the model encodes images (a vision-language model)."""
        return self._rope_index is not None

    def prefill(self, group: list[Request]) -> tuple[Batch, torch.Tensor]:
        """Prefill ``group`` together: its batch (not sampled yet) and each row's logits."""
        longest = max(len(r.prompt) + len(r.tokens) for r in group)
        ids = torch.full((len(group), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(group), longest), dtype=torch.long)
        for i, request in enumerate(group):
            # A recomputed request prefills the tokens it sampled too (see call_in_worker).
            context = request.prompt + request.tokens
            ids[i, longest - len(context):] = torch.tensor(context)
            mask[i, longest - len(context):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = new_cache()
        vision = self._vision_inputs(group, ids, mask)
        if vision:  # 3-D positions: after an image they run on from its largest + 1
            positions = vision.pop("position_ids")
        logits = self._forward(ids, mask, positions, cache, **vision)
        self.counters.prefill_calls += 1
        self.counters.prefill_tokens += int(mask.sum())
        last = positions[..., -1].amax(0) if positions.dim() == 3 else positions[:, -1]
        return Batch(group, cache, mask, last + 1, torch.zeros(0)), logits

    def decode(self, batch: Batch) -> torch.Tensor:
        """One decode step of every row of ``batch`` (its mask and positions move on); each
        row's logits."""
        batch.mask = F.pad(batch.mask, (0, 1), value=1)
        logits = self._forward(batch.last[:, None], batch.mask, batch.positions[:, None],
                               batch.cache)
        batch.positions = batch.positions + 1
        self.counters.decode_steps += 1
        self.counters.decode_rows += len(batch.rows)
        self.counters.max_batch_rows = max(self.counters.max_batch_rows, len(batch.rows))
        return logits

    def _vision_inputs(self, group: list[Request], ids: torch.Tensor,
                       mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """The prefill's pixel inputs and the model's own 3-D rope positions for them
        (``get_rope_index``), when a row of ``group`` has images; else empty."""
        inputs = [r.images for r in group if r.images]
        if not inputs:
            return {}
        assert self._rope_index is not None
        grid = torch.cat([i.image_grid_thw for i in inputs]).to(self.device)
        pixels = torch.cat([i.pixel_values for i in inputs]).to(self.device, self._dtype)
        kinds = (ids == self._image_token_id).int()
        positions, _ = self._rope_index(ids, kinds, image_grid_thw=grid, attention_mask=mask)
        return {"position_ids": positions, "pixel_values": pixels, "image_grid_thw": grid}

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any, **vision: torch.Tensor) -> torch.Tensor:
        """One forward pass; returns float32 logits of each row's last position ``[B, V]``."""
        self.step_valid = mask[:, -ids.shape[1]:]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **vision,
                         **{self._cache_kwarg: cache})
        return out.logits[:, -1, :].float()
