"""Rollouts on Ray when one process is not enough (the optional ``ray`` extra).

``import pipeline`` never imports Ray; importing this package does.

- :class:`RayRolloutPool`: rollout workers as Ray actors, each with its own event loop,
  ``Pipeline`` and diagnostics; ``run_batch`` / ``stream`` / ``stream_groups`` across them,
  a dead worker's samples retried once elsewhere and the worker replaced, one dump for the
  fleet (``rollout dump <driver pid>``), one rate limit per tool for the fleet.
- :class:`LimiterActor`, :class:`FleetLimiterRegistry`, :class:`LeasedBucket`: the fleet
  limiter (token batches leased to workers; unused ones handed back).
- :class:`RolloutWorker`: the worker actor's class.
"""

from pipeline.distributed._limiter import FleetLimiterRegistry, LeasedBucket, LimiterActor
from pipeline.distributed._pool import DEFAULT_WORKER_OPTIONS, RayRolloutPool, WorkerInfo
from pipeline.distributed._worker import RolloutWorker

__all__ = [
    "DEFAULT_WORKER_OPTIONS",
    "FleetLimiterRegistry",
    "LeasedBucket",
    "LimiterActor",
    "RayRolloutPool",
    "RolloutWorker",
    "WorkerInfo",
]
