"""Statistics of a token bucket: typed snapshots and the tally that feeds them.

A :class:`Tally` is owned by one bucket and only touched under that bucket's lock. It keeps
counters per key plus the accounting ledger every bucket must balance::

    issued == returned + refunded + in_flight

``issued`` counts tokens taken from the bucket for a caller; ``returned`` those whose
``acquire`` returned; ``refunded`` those put back because the caller was cancelled after the
grant; ``in_flight`` those granted to callers that have not resumed yet (the bucket computes
it from its granted waiters, independently of the counters). Whatever is left over is
``leaked``, and must be 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import numpy as np

#: Wait times kept per key (and in total) for the percentiles: the most recent grants.
WAIT_SAMPLES = 4096


@dataclass(frozen=True, slots=True)
class KeyStats:
    """Figures of one key of a bucket.

    Attributes:
        key: the key given to ``acquire``.
        weight: its fair-share weight.
        grants: acquires that returned.
        tokens: tokens of those acquires.
        wait_p50_s: median wait of the last ``WAIT_SAMPLES`` grants, None before any.
        wait_p99_s: 99th percentile of the same.
        queue_len: callers of this key waiting now.
        timeouts: acquires that raised ``TimeoutError``.
        cancelled: acquires cancelled while queued or right after their grant.
        refunded: tokens put back after a grant whose caller was cancelled.
    """

    key: Hashable
    weight: float
    grants: int
    tokens: float
    wait_p50_s: float | None
    wait_p99_s: float | None
    queue_len: int
    timeouts: int
    cancelled: int
    refunded: float


@dataclass(frozen=True, slots=True)
class BucketStats:
    """Figures of a whole bucket: totals, the accounting ledger and one entry per key.

    Attributes:
        name: the bucket's name.
        rate: tokens per second.
        capacity: burst size.
        available: tokens in the bucket now.
        closed: whether ``aclose()`` was called.
        grants: acquires that returned, all keys.
        tokens: tokens of those acquires.
        wait_p50_s: median wait over all keys (last ``WAIT_SAMPLES`` grants).
        wait_p99_s: 99th percentile of the same.
        queue_len: callers waiting now.
        timeouts: acquires that raised ``TimeoutError``.
        cancelled: acquires cancelled while queued or right after their grant.
        issued: tokens taken from the bucket for callers.
        returned: tokens granted to callers whose ``acquire`` returned.
        refunded: tokens put back after a grant whose caller was cancelled.
        in_flight: tokens granted to callers that have not resumed yet.
        leaked: ``issued - returned - refunded - in_flight``; anything but 0 is a bug.
        keys: per-key figures.
    """

    name: str
    rate: float
    capacity: float
    available: float
    closed: bool
    grants: int
    tokens: float
    wait_p50_s: float | None
    wait_p99_s: float | None
    queue_len: int
    timeouts: int
    cancelled: int
    issued: float
    returned: float
    refunded: float
    in_flight: float
    leaked: float
    keys: Mapping[Hashable, KeyStats]


class _KeyTally:
    __slots__ = ("cancelled", "grants", "refunded", "timeouts", "tokens", "waits")

    def __init__(self) -> None:
        self.grants = 0
        self.tokens = 0.0
        self.timeouts = 0
        self.cancelled = 0
        self.refunded = 0.0
        self.waits: deque[float] = deque(maxlen=WAIT_SAMPLES)


class Tally:
    """Counters of one bucket; the caller holds the bucket's lock around every call."""

    def __init__(self) -> None:
        self._keys: dict[Hashable, _KeyTally] = {}
        self._waits: deque[float] = deque(maxlen=WAIT_SAMPLES)
        self.issued = 0.0
        self.returned = 0.0
        self.refunded = 0.0

    def _key(self, key: Hashable) -> _KeyTally:
        tally = self._keys.get(key)
        if tally is None:
            tally = self._keys[key] = _KeyTally()
        return tally

    def record_grant(self, key: Hashable, cost: float, wait_s: float) -> None:
        """Count tokens issued to a caller whose ``acquire`` returns without a refund window."""
        # The uncontended path of every acquire: record_issue + record_return, inlined.
        self.issued += cost
        self.returned += cost
        tally = self._keys.get(key) or self._key(key)
        tally.grants += 1
        tally.tokens += cost
        tally.waits.append(wait_s)
        self._waits.append(wait_s)

    def record_issue(self, cost: float) -> None:
        """Count tokens issued to a queued caller that has not resumed yet."""
        self.issued += cost

    def record_return(self, key: Hashable, cost: float, wait_s: float) -> None:
        """Count an ``acquire`` that returned after waiting ``wait_s`` seconds."""
        self.returned += cost
        tally = self._key(key)
        tally.grants += 1
        tally.tokens += cost
        tally.waits.append(wait_s)
        self._waits.append(wait_s)

    def record_refund(self, key: Hashable, cost: float) -> None:
        """Count tokens put back because the caller was cancelled after its grant."""
        self.refunded += cost
        tally = self._key(key)
        tally.refunded += cost
        tally.cancelled += 1

    def record_cancel(self, key: Hashable) -> None:
        """Count a caller cancelled while queued."""
        self._key(key).cancelled += 1

    def record_timeout(self, key: Hashable) -> None:
        """Count a caller whose ``acquire`` raised ``TimeoutError``."""
        self._key(key).timeouts += 1

    def leaked(self, in_flight: float) -> float:
        """Tokens issued but neither returned, refunded nor in flight (0 unless buggy)."""
        leaked = self.issued - self.returned - self.refunded - in_flight
        # Float sums of the same costs in different orders differ in the last bits.
        return 0.0 if abs(leaked) <= 1e-9 * max(1.0, self.issued) else leaked

    def snapshot(
        self,
        *,
        name: str,
        rate: float,
        capacity: float,
        available: float,
        closed: bool,
        queue_lens: Mapping[Hashable, int],
        weight: Callable[[Hashable], float],
        in_flight: float,
    ) -> BucketStats:
        """Freeze the counters into a :class:`BucketStats`."""
        keys: dict[Hashable, KeyStats] = {}
        for key in [*self._keys, *(k for k in queue_lens if k not in self._keys)]:
            tally = self._key(key)
            p50, p99 = _percentiles(tally.waits)
            keys[key] = KeyStats(
                key=key, weight=weight(key), grants=tally.grants, tokens=tally.tokens,
                wait_p50_s=p50, wait_p99_s=p99, queue_len=queue_lens.get(key, 0),
                timeouts=tally.timeouts, cancelled=tally.cancelled, refunded=tally.refunded,
            )
        p50, p99 = _percentiles(self._waits)
        return BucketStats(
            name=name, rate=rate, capacity=capacity, available=available, closed=closed,
            grants=sum(k.grants for k in keys.values()),
            tokens=sum(k.tokens for k in keys.values()),
            wait_p50_s=p50, wait_p99_s=p99,
            queue_len=sum(queue_lens.values()),
            timeouts=sum(k.timeouts for k in keys.values()),
            cancelled=sum(k.cancelled for k in keys.values()),
            issued=self.issued, returned=self.returned, refunded=self.refunded,
            in_flight=in_flight, leaked=self.leaked(in_flight), keys=keys,
        )


def _percentiles(waits: deque[float]) -> tuple[float | None, float | None]:
    if not waits:
        return None, None
    p50, p99 = np.percentile(np.fromiter(waits, dtype=float, count=len(waits)), [50, 99])
    return float(p50), float(p99)
