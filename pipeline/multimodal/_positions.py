"""Trainer-side columns of vision-language samples: pixel inputs per sample and per batch,
and Qwen2-VL's 3-D rope (mrope) position ids in verl's layout.

verl 0.9.1's agent-loop worker gives a vision-language batch ``position_ids`` of shape
``[B, 4, T]``: row 0 the text positions (0.. over the attended tokens, 1 on padding), rows
1-3 the model's own ``get_rope_index`` (temporal, height, width) that its processor carries
(verl binds the model class's method to the processor: ``verl.utils.tokenizer.hf_processor``).
:func:`mrope_position_ids` builds the same from a padded batch, sample by sample, as verl does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline._exceptions import ConfigError


def sample_images(samples: Sequence[Any]) -> list[Any]:
    """Each sample's ``MultiModalInputs`` (None for a sample without images)."""
    return [getattr(s, "multi_modal_inputs", None) or None for s in samples]


def image_columns(samples: Sequence[Any], return_tensors: str) -> dict[str, Any]:
    """``pixel_values`` and ``image_grid_thw`` of the whole batch (the samples' images in
    order, concatenated, as a Qwen2-VL forward over the padded batch takes them) and
    ``image_counts`` ``[B]``; empty when no sample has images."""
    inputs = sample_images(samples)
    if not any(inputs):
        return {}
    import torch

    pixels = torch.cat([i.pixel_values for i in inputs if i])
    grid = torch.cat([i.image_grid_thw for i in inputs if i])
    counts = torch.tensor([len(i.images) if i else 0 for i in inputs], dtype=torch.int64)
    if return_tensors == "np":
        return {"pixel_values": pixels.numpy(), "image_grid_thw": grid.numpy(),
                "image_counts": counts.numpy()}
    return {"pixel_values": pixels, "image_grid_thw": grid, "image_counts": counts}


def mrope_position_ids(processor: Any, input_ids: Any, attention_mask: Any,
                       grids: Sequence[Any]) -> Any:
    """``[B, 4, T]`` position ids in verl's layout (see the module doc).

    Args:
        processor: a processor with the model's ``get_rope_index`` bound to it (verl's
            ``hf_processor`` does that for Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V).
        input_ids: ``[B, T]`` torch ids (padded).
        attention_mask: ``[B, T]``.
        grids: per sample its ``image_grid_thw`` (None without images).

    Raises:
        ConfigError: the processor has no ``get_rope_index`` (names the ``processor``).
    """
    import torch

    rope_index = getattr(processor, "get_rope_index", None)
    if rope_index is None:
        raise ConfigError("vision-language samples need position ids from the model's "
                          "get_rope_index: pass the processor verl's hf_processor builds "
                          "(it binds the method), or bind it the same way",
                          field="processor")
    image_token = getattr(processor, "image_token_id", None)
    if image_token is None:
        image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    rows = []
    for i, grid in enumerate(grids):
        ids, mask = input_ids[i:i + 1], attention_mask[i:i + 1]
        kinds = (ids == image_token).int()
        vision, _ = rope_index(input_ids=ids, attention_mask=mask, mm_token_type_ids=kinds,
                               image_grid_thw=grid)
        valid = mask[0].bool()
        text = torch.ones((1, ids.shape[1]), dtype=torch.long)
        text[0, valid] = torch.arange(int(valid.sum()))
        rows.append(torch.cat([text.unsqueeze(0), vision.transpose(0, 1)], dim=1))
    return torch.cat(rows)
