"""verl integration (verl 0.9.1; install with ``scripts/install_verl.sh``).

Importing this package does not import verl; its functions do. In the process that computes
advantages (verl's trainer driver) call :func:`register_estimators`, then set
``algorithm.adv_estimator=grpo_masked``: failed, timed-out and overlong samples (all-zero
``response_mask``) are left out of their group's mean and std, as
:func:`pipeline.batch.group_advantages` does.
"""

from pipeline.integrations.verl._register import register_estimators

__all__ = ["register_estimators"]
