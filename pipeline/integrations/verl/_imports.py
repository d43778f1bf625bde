"""Importing verl quietly: the one way this package imports a verl module."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def import_verl(name: str) -> Any:
    """Import a verl module, without the import-time warnings of verl 0.9.1 and ray.

    (Engines it has no backend for, ray's moved state API: nothing a user can act on.)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return importlib.import_module(name)
