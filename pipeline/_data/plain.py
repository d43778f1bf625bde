"""Foreign containers as plain Python values (what verl hands over: numpy object columns,
OmegaConf configs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def plain(value: Any) -> Any:
    """OmegaConf containers, numpy scalars and arrays, nested in mappings and sequences, as
    plain Python values; anything else as it is."""
    if hasattr(value, "_get_node"):  # an OmegaConf DictConfig / ListConfig
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value
