"""Rate limiting for rollouts: a fair async token bucket and a per-pipeline registry.

:class:`FairAsyncTokenBucket` refills ``rate`` tokens per second up to ``capacity``. Callers
queue under a key (an endpoint, a tenant, a stage) and are served round-robin across keys,
FIFO within a key, so a key with 1,000 queued callers cannot starve a key with one. It is
cancellation-safe, usable from several event loops and threads, and runs nothing while idle.
While callers queue, grants are booked at their ideal times, so a late loop costs no rate (the
exact burst guarantee is in ``_bucket.py``); per-key statistics stay bounded however many
keys come and go::

    registry = LimiterRegistry()
    judge_api = registry.get("judge-api", rate=20, capacity=40)
    async with judge_api.limit(key=task_family, cost=1):
        ...

:class:`FifoTokenBucket` is the single-queue baseline, kept for the benchmark.

A bucket limits one process. Rollout workers on Ray (:mod:`pipeline.distributed`) share one
rate per name through a limiter actor that leases token batches to them
(:meth:`FairAsyncTokenBucket.give_back` takes unused ones back); other multi-process setups
split the configured rate between their processes (``rate / n_processes`` each).
"""

from pipeline.ratelimit._bucket import FairAsyncTokenBucket
from pipeline.ratelimit._errors import LimiterClosed, LimiterConflict, RateLimitError
from pipeline.ratelimit._fifo import FifoTokenBucket
from pipeline.ratelimit._registry import LimiterRegistry
from pipeline.ratelimit._stats import BucketStats, KeyStats

__all__ = [
    "BucketStats",
    "FairAsyncTokenBucket",
    "FifoTokenBucket",
    "KeyStats",
    "LimiterClosed",
    "LimiterConflict",
    "LimiterRegistry",
    "RateLimitError",
]
