"""LimiterRegistry: the named buckets of one pipeline, held by its context.

Not process-global: two pipelines in one process (or two tests) each hold their own
registry, so their limits never interfere by accident.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pipeline.ratelimit._bucket import FairAsyncTokenBucket
from pipeline.ratelimit._checks import positive
from pipeline.ratelimit._errors import LimiterClosed, LimiterConflict
from pipeline.ratelimit._stats import BucketStats


class LimiterRegistry:
    """Named :class:`FairAsyncTokenBucket` instances, created on first use.

    Args:
        clock: handed to every bucket the registry creates.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, FairAsyncTokenBucket] = {}
        self._closed = False

    def __contains__(self, name: object) -> bool:
        return name in self._buckets

    def __len__(self) -> int:
        return len(self._buckets)

    def get(self, name: str, rate: float, capacity: float | None = None) -> FairAsyncTokenBucket:
        """The bucket called ``name``, created with ``rate`` and ``capacity`` if new.

        Args:
            name: the limit's name (an endpoint, an API key, a tool).
            rate: tokens per second.
            capacity: burst size; defaults to ``max(1, rate)``.

        Returns:
            The same bucket for every call with the same name and parameters.

        Raises:
            LimiterConflict: ``name`` exists with a different rate or capacity (a
                ``ValueError``); the message names both.
            LimiterClosed: the registry was closed.
            ValueError: ``rate`` or ``capacity`` is not a finite number > 0.
        """
        rate = positive("rate", rate)
        capacity = positive("capacity", max(1.0, rate) if capacity is None else capacity)
        with self._lock:
            if self._closed:
                raise LimiterClosed(f"limiter registry is closed; get({name!r}) refused")
            bucket = self._buckets.get(name)
            if bucket is None:
                bucket = FairAsyncTokenBucket(rate, capacity, clock=self._clock, name=name)
                self._buckets[name] = bucket
            elif (bucket.rate, bucket.capacity) != (rate, capacity):
                raise LimiterConflict(
                    f"rate limiter {name!r} already exists with rate={bucket.rate},"
                    f" capacity={bucket.capacity}; requested rate={rate}, capacity={capacity}")
            return bucket

    def stats(self) -> dict[str, BucketStats]:
        """A snapshot of every bucket.

        Returns:
            Bucket name -> its :class:`BucketStats`.
        """
        with self._lock:
            buckets = list(self._buckets.items())
        return {name: bucket.stats() for name, bucket in buckets}

    async def aclose(self) -> None:
        """Close every bucket (waking their waiters) and refuse further ``get`` calls."""
        with self._lock:
            self._closed = True
            buckets = list(self._buckets.values())
        for bucket in buckets:
            await bucket.aclose()
