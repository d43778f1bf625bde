"""Registration of our pieces in verl's registries."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from pipeline.batch import GRPO_MASKED, masked_grpo_advantage


def import_verl(name: str) -> Any:
    """Import a verl module, without the import-time warnings of verl 0.9.1 and ray.

    (Engines it has no backend for, ray's moved state API: nothing a user can act on.)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return importlib.import_module(name)


def register_estimators() -> None:
    """Register :func:`~pipeline.batch.masked_grpo_advantage` as ``"grpo_masked"`` in verl.

    Idempotent. Call it in the process that runs ``compute_advantage``.

    Raises:
        ImportError: verl is not installed.
        ValueError: (verl's) another function is registered under that name.
    """
    core_algos = import_verl("verl.trainer.ppo.core_algos")
    core_algos.register_adv_est(GRPO_MASKED)(masked_grpo_advantage)
