"""Argument checks the limiters share: a finite number > 0, or a ValueError naming it."""

from __future__ import annotations

import math
import numbers


def positive(name: str, value: object) -> float:
    """``value`` as a float, or a ValueError naming ``name`` unless it is finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    number = float(value)
    if not 0 < number < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number
