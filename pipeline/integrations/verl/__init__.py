"""verl integration (verl 0.9.1; install with ``scripts/install_verl.sh``).

Importing this package does not import verl; its functions do.

- :class:`PipelineAgentLoop`: the agent loop verl's workers instantiate from
  ``rollout.agent.agent_loop_config_path`` YAML entries (or :func:`register_agent_loop`): a
  user's stage list runs inside verl's ``AgentLoopWorker`` over verl's server
  (:class:`VerlServerEngine`), with our timeouts, fault isolation and token fidelity.
- :func:`register_estimators`: call it in the process that computes advantages (verl's
  trainer driver), then set ``algorithm.adv_estimator=grpo_masked``: failed, timed-out and
  overlong samples (all-zero ``response_mask``) are left out of their group's mean and std,
  as :func:`pipeline.batch.group_advantages` does.
"""

from pipeline.integrations.verl._agent_loop import PipelineAgentLoop
from pipeline.integrations.verl._engine import StepRange, VerlServerEngine
from pipeline.integrations.verl._factory import resolve_factory
from pipeline.integrations.verl._register import (
    AGENT_LOOP_TARGET,
    register_agent_loop,
    register_estimators,
)

__all__ = [
    "AGENT_LOOP_TARGET",
    "PipelineAgentLoop",
    "StepRange",
    "VerlServerEngine",
    "register_agent_loop",
    "register_estimators",
    "resolve_factory",
]
