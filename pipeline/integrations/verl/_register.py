"""Registration of our pieces in verl's registries."""

from __future__ import annotations

from typing import Any

from pipeline._exceptions import ConfigError
from pipeline.batch import GRPO_MASKED, masked_grpo_advantage
from pipeline.integrations.verl._agent_loop import OPTIONS
from pipeline.integrations.verl._factory import resolve_factory
from pipeline.integrations.verl._imports import import_verl


def register_estimators() -> None:
    """Register :func:`~pipeline.batch.masked_grpo_advantage` as ``"grpo_masked"`` in verl.

    Idempotent. Call it in the process that runs ``compute_advantage``.

    Raises:
        ImportError: verl is not installed.
        ValueError: (verl's) another function is registered under that name.
    """
    core_algos = import_verl("verl.trainer.ppo.core_algos")
    core_algos.register_adv_est(GRPO_MASKED)(masked_grpo_advantage)


AGENT_LOOP_TARGET = "pipeline.integrations.verl.PipelineAgentLoop"
"""The ``_target_`` of our agent loop in verl's registry and YAML entries."""


def register_agent_loop(name: str, factory: str, **options: Any) -> None:
    """Register a stage list in verl's agent-loop registry of this process, as ``name``.

    The same entry a YAML file gives (see :class:`PipelineAgentLoop`), for code that runs in
    the process of verl's worker (verl's workers are separate Ray processes: a registration
    in the trainer's driver does not reach them; list the entry in
    ``rollout.agent.agent_loop_config_path`` instead).

    Raises:
        ImportError: verl is not installed.
        ConfigError: ``factory`` cannot be resolved (checked now, not per sample).
    """
    resolve_factory(factory, f"verl agent loop {name!r}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"verl agent loop {name!r}: unknown option(s) {unknown}; known: "
                          f"{list(OPTIONS)}", field=unknown[0])
    module = import_verl("verl.experimental.agent_loop.agent_loop")
    module._agent_loop_registry[name] = {"_target_": AGENT_LOOP_TARGET, "name": name,
                                         "factory": factory, **options}
