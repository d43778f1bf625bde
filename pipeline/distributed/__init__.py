"""Rollouts on Ray when one process is not enough (the optional ``ray`` extra).

``import pipeline`` never imports Ray; importing this package does.

- :class:`RayRolloutPool`: rollout workers as Ray actors, each with its own event loop,
  ``Pipeline`` and diagnostics; ``run_batch`` / ``stream`` / ``stream_groups`` across them,
  a dead worker's samples retried once elsewhere and the worker replaced (a health watch
  finds one that dies while idle), one dump for the fleet (``rollout dump <driver pid>``),
  one rate limit per tool for the fleet. :class:`PoolClosed` / :class:`PoolNotStarted`: a
  call on a pool that is closed or was never started.
- ``RayRolloutPool.update_weights``: new weights for every worker's engine while their
  samples keep going (:class:`WeightUpdate`, or :class:`WeightUpdateFailed` naming the
  workers that failed); a started pool may stand in for the pipeline of
  :class:`~pipeline.AsyncRollout`.
- :class:`LimiterActor` (started by :func:`start_limiter`), :class:`FleetLimiterRegistry`,
  :class:`LeasedBucket`: the fleet limiter (token batches leased to workers; unused ones
  handed back).
- :class:`RolloutWorker`: the worker actor's class; :class:`WorkerBroken`: it cannot run
  samples any more (its pipeline loop ended).
"""

from pipeline.distributed._async import WeightUpdate
from pipeline.distributed._errors import PoolClosed, PoolNotStarted, WeightUpdateFailed
from pipeline.distributed._fleet import WorkerInfo
from pipeline.distributed._leases import FleetLimiterRegistry, LeasedBucket
from pipeline.distributed._limiter import LimiterActor, start_limiter
from pipeline.distributed._pool import DEFAULT_WORKER_OPTIONS, RayRolloutPool
from pipeline.distributed._worker import RolloutWorker, WorkerBroken

__all__ = [
    "DEFAULT_WORKER_OPTIONS",
    "FleetLimiterRegistry",
    "LeasedBucket",
    "LimiterActor",
    "PoolClosed",
    "PoolNotStarted",
    "RayRolloutPool",
    "RolloutWorker",
    "WeightUpdate",
    "WeightUpdateFailed",
    "WorkerBroken",
    "WorkerInfo",
    "start_limiter",
]
