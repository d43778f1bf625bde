"""Statistics of a token bucket: typed snapshots and the bounded tally that feeds them.

A :class:`Tally` is owned by one bucket and only touched under that bucket's lock. It keeps
counters per key plus the accounting ledger every bucket must balance::

    issued == returned + refunded + in_flight
    accrued == issued - refunded + available + discarded

``issued`` counts tokens taken from the bucket for a caller; ``returned`` those whose
``acquire`` returned; ``refunded`` those of grants whose caller was cancelled before it
resumed; ``in_flight`` those granted to callers that have not resumed yet (the bucket computes
it from its granted waiters, independently of the counters). Whatever is left over is
``leaked``, and must be 0. The second line is the token flow: every token the bucket ever
made (``capacity`` at creation plus ``rate`` per second) was spent, is still there, or was
``discarded`` because the bucket was full.

Bounded memory: a fairness key per prompt means millions of keys over a run, so at most
``max_keys`` keys keep their own counters. When a new key would pass that, the least recently
active keys with nobody queued are folded into one aggregate (``BucketStats.folded``), so the
totals stay exact and memory stays flat (about 2 KB per key at most).

Off the lock: :meth:`Tally.capture` copies the raw figures (a few array copies per key) under
the bucket's lock; :meth:`Capture.snapshot` computes percentiles and builds the typed snapshot
after the lock is released, so acquirers never wait for statistics.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Container, Hashable, Mapping
from dataclasses import dataclass
from typing import Final

import numpy as np

#: Wait times kept for the bucket-wide percentiles (and for folded keys): the latest grants.
WAIT_SAMPLES: Final = 4096
#: Wait times kept per key for its percentiles: the latest grants of that key.
KEY_WAIT_SAMPLES: Final = 128
#: Keys that keep their own counters before idle ones are folded into the aggregate.
MAX_KEYS: Final = 1024


class _FoldedKeys:
    """The key of the aggregate of folded keys (never equal to a user's key)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<folded keys>"


#: ``BucketStats.folded.key``: the aggregate of keys folded away for lack of room.
FOLDED: Final = _FoldedKeys()


@dataclass(frozen=True, slots=True)
class KeyStats:
    """Figures of one key of a bucket.

    Attributes:
        key: the key given to ``acquire`` (:data:`FOLDED` for the aggregate of folded keys).
        weight: its fair-share weight.
        grants: acquires that returned.
        tokens: tokens of those acquires.
        wait_p50_s: median wait of the key's latest ``KEY_WAIT_SAMPLES`` grants, None before
            any.
        wait_p99_s: 99th percentile of the same.
        queue_len: callers of this key waiting now.
        timeouts: acquires that raised ``TimeoutError``.
        cancelled: acquires cancelled while queued or right after their grant.
        refunded: tokens put back after a grant whose caller was cancelled, or handed back
            unused (``give_back``).
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
        grants: acquires that returned, all keys (folded ones included).
        tokens: tokens of those acquires.
        wait_p50_s: median wait over all keys (last ``WAIT_SAMPLES`` grants).
        wait_p99_s: 99th percentile of the same.
        queue_len: callers waiting now.
        timeouts: acquires that raised ``TimeoutError``.
        cancelled: acquires cancelled while queued or right after their grant.
        issued: tokens taken from the bucket for callers.
        returned: tokens granted to callers whose ``acquire`` returned.
        refunded: tokens of grants whose caller was cancelled before it resumed.
        in_flight: tokens granted to callers that have not resumed yet.
        leaked: ``issued - returned - refunded - in_flight``; anything but 0 is a bug.
        keys: per-key figures of the keys that keep their own (at most ``max_keys`` idle
            ones, plus every key with callers queued).
        folded: the summed figures of keys folded away (key :data:`FOLDED`), None if none.
        folded_keys: how many key entries were folded (a key active again after its fold
            gets a fresh entry and may be folded again).
        accrued: tokens the bucket ever made: ``capacity + rate * seconds since creation``.
        discarded: tokens dropped because the bucket was full: refill while it sat full, and
            refunds that came after it had filled up. ``accrued == issued - refunded +
            available + discarded``.
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
    folded: KeyStats | None = None
    folded_keys: int = 0
    accrued: float = 0.0
    discarded: float = 0.0


class _KeyTally:
    __slots__ = ("cancelled", "grants", "last", "refunded", "timeouts", "tokens", "waits")

    def __init__(self) -> None:
        self.grants = 0
        self.tokens = 0.0
        self.timeouts = 0
        self.cancelled = 0
        self.refunded = 0.0
        self.waits = array("d")  # the latest KEY_WAIT_SAMPLES at the end; trimmed in blocks
        self.last = 0  # Tally event number of the key's latest activity


class Tally:
    """Counters of one bucket; the caller holds the bucket's lock around every call.

    Args:
        max_keys: keys that keep their own counters before idle ones are folded.
        busy: keys that must not be folded now (those with callers queued).
    """

    def __init__(self, max_keys: int = MAX_KEYS, busy: Container[Hashable] = ()) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys!r}")
        self._max_keys = max_keys
        self._busy = busy
        self._keys: dict[Hashable, _KeyTally] = {}
        self._waits = array("d")
        self._folded = _KeyTally()
        self._folded.waits = array("d")
        self.folded_keys = 0
        self._events = 0
        self.issued = 0.0
        self.returned = 0.0
        self.refunded = 0.0

    def _key(self, key: Hashable) -> _KeyTally:
        tally = self._keys.get(key)
        if tally is None:
            if len(self._keys) >= self._max_keys:
                self._fold_idle()
            tally = self._keys[key] = _KeyTally()
        self._events += 1
        tally.last = self._events
        return tally

    def _wait(self, tally: _KeyTally, wait_s: float) -> None:
        waits = tally.waits
        waits.append(wait_s)
        if len(waits) >= 2 * KEY_WAIT_SAMPLES:
            del waits[:KEY_WAIT_SAMPLES]
        waits = self._waits
        waits.append(wait_s)
        if len(waits) >= 2 * WAIT_SAMPLES:
            del waits[:WAIT_SAMPLES]

    def record_grant(self, key: Hashable, cost: float, wait_s: float) -> None:
        """Count tokens issued to a caller whose ``acquire`` returns without a refund window."""
        # The uncontended path of every acquire: _key and _wait, inlined.
        self.issued += cost
        self.returned += cost
        tally = self._keys.get(key)
        if tally is None:
            tally = self._key(key)
        else:
            self._events = tally.last = self._events + 1
        tally.grants += 1
        tally.tokens += cost
        waits = tally.waits
        waits.append(wait_s)
        if len(waits) >= 2 * KEY_WAIT_SAMPLES:
            del waits[:KEY_WAIT_SAMPLES]
        waits = self._waits
        waits.append(wait_s)
        if len(waits) >= 2 * WAIT_SAMPLES:
            del waits[:WAIT_SAMPLES]

    def record_issue(self, cost: float) -> None:
        """Count tokens issued to a queued caller that has not resumed yet."""
        self.issued += cost

    def record_return(self, key: Hashable, cost: float, wait_s: float) -> None:
        """Count an ``acquire`` that returned after waiting ``wait_s`` seconds."""
        self.returned += cost
        tally = self._key(key)
        tally.grants += 1
        tally.tokens += cost
        self._wait(tally, wait_s)

    def record_refund(self, key: Hashable, cost: float) -> None:
        """Count tokens of a grant whose caller was cancelled before it resumed."""
        self.refunded += cost
        tally = self._key(key)
        tally.refunded += cost
        tally.cancelled += 1

    def record_give_back(self, key: Hashable, cost: float) -> None:
        """Count tokens of a returned grant handed back unused (moved from returned to
        refunded, so both ledger lines stay balanced)."""
        self.returned -= cost
        self.refunded += cost
        tally = self._key(key)
        tally.tokens -= cost
        tally.refunded += cost

    def record_cancel(self, key: Hashable) -> None:
        """Count a caller cancelled while queued."""
        self._key(key).cancelled += 1

    def record_timeout(self, key: Hashable) -> None:
        """Count a caller whose ``acquire`` raised ``TimeoutError``."""
        self._key(key).timeouts += 1

    def leaked(self, in_flight: float) -> float:
        """Tokens issued but neither returned, refunded nor in flight (0 unless buggy)."""
        return _leaked(self.issued, self.returned, self.refunded, in_flight)

    def _fold_idle(self) -> None:
        # Fold the least recently active quarter of the keys (those with nobody queued) into
        # the aggregate: one sort per max_keys / 4 new keys.
        target = len(self._keys) - max(1, self._max_keys // 4)
        order = sorted(self._keys.items(), key=lambda item: item[1].last)
        folded = self._folded
        for key, tally in order:
            if len(self._keys) <= target:
                break
            if key in self._busy:
                continue
            del self._keys[key]
            folded.grants += tally.grants
            folded.tokens += tally.tokens
            folded.timeouts += tally.timeouts
            folded.cancelled += tally.cancelled
            folded.refunded += tally.refunded
            folded.waits.extend(tally.waits[-KEY_WAIT_SAMPLES:])
            if len(folded.waits) >= 2 * WAIT_SAMPLES:
                del folded.waits[:-WAIT_SAMPLES]
            self.folded_keys += 1

    def capture(self, queue_lens: Mapping[Hashable, int],
                weight: Callable[[Hashable], float]) -> Capture:
        """Copy what a snapshot needs (cheap; under the bucket's lock)."""
        rows = [(key, weight(key), t.grants, t.tokens, t.timeouts, t.cancelled, t.refunded,
                 t.waits[-KEY_WAIT_SAMPLES:]) for key, t in self._keys.items()]
        rows.extend((key, weight(key), 0, 0.0, 0, 0, 0.0, array("d"))
                    for key in queue_lens if key not in self._keys)
        f = self._folded
        folded = None if not self.folded_keys else (
            FOLDED, 1.0, f.grants, f.tokens, f.timeouts, f.cancelled, f.refunded,
            f.waits[-WAIT_SAMPLES:])
        return Capture(rows, folded, self.folded_keys, self._waits[-WAIT_SAMPLES:],
                       dict(queue_lens), self.issued, self.returned, self.refunded)


_Row = tuple[Hashable, float, int, float, int, int, float, array]  # type: ignore[type-arg]


class Capture:
    """Raw figures copied under the lock; :meth:`snapshot` does the work outside it."""

    def __init__(self, rows: list[_Row], folded: _Row | None, folded_keys: int,
                 waits: array, queue_lens: dict[Hashable, int],  # type: ignore[type-arg]
                 issued: float, returned: float, refunded: float) -> None:
        self._rows = rows
        self._folded = folded
        self._folded_keys = folded_keys
        self._waits = waits
        self._queue_lens = queue_lens
        self._issued, self._returned, self._refunded = issued, returned, refunded

    def snapshot(self, *, name: str, rate: float, capacity: float, available: float,
                 closed: bool, in_flight: float, accrued: float,
                 discarded: float) -> BucketStats:
        """Freeze the copied counters into a :class:`BucketStats`."""
        rows = self._rows + ([self._folded] if self._folded is not None else [])
        p50, p99 = _row_percentiles([row[7] for row in rows])
        stats = [KeyStats(key=row[0], weight=row[1], grants=row[2], tokens=row[3],
                          wait_p50_s=p50[i], wait_p99_s=p99[i],
                          queue_len=self._queue_lens.get(row[0], 0), timeouts=row[4],
                          cancelled=row[5], refunded=row[6])
                 for i, row in enumerate(rows)]
        folded = stats.pop() if self._folded is not None else None
        every = [*stats, *([folded] if folded is not None else [])]
        (total_p50,), (total_p99,) = _row_percentiles([self._waits])
        return BucketStats(
            name=name, rate=rate, capacity=capacity, available=available, closed=closed,
            grants=sum(k.grants for k in every), tokens=sum(k.tokens for k in every),
            wait_p50_s=total_p50, wait_p99_s=total_p99,
            queue_len=sum(self._queue_lens.values()),
            timeouts=sum(k.timeouts for k in every),
            cancelled=sum(k.cancelled for k in every),
            issued=self._issued, returned=self._returned, refunded=self._refunded,
            in_flight=in_flight,
            leaked=_leaked(self._issued, self._returned, self._refunded, in_flight),
            keys={k.key: k for k in stats}, folded=folded, folded_keys=self._folded_keys,
            accrued=accrued, discarded=discarded,
        )


def _leaked(issued: float, returned: float, refunded: float, in_flight: float) -> float:
    leaked = issued - returned - refunded - in_flight
    # Float sums of the same costs in different orders differ in the last bits.
    return 0.0 if abs(leaked) <= 1e-9 * max(1.0, issued) else leaked


def _row_percentiles(
    samples: list[array],  # type: ignore[type-arg]
) -> tuple[list[float | None], list[float | None]]:
    """50th and 99th percentiles (numpy's linear method) of each list, in one sort."""
    if not samples:
        return [], []
    counts = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    width = max(1, int(counts.max()))
    table = np.full((len(samples), width), np.nan)  # NaN sorts last
    for i, s in enumerate(samples):
        if len(s):
            table[i, : len(s)] = np.frombuffer(s, dtype=np.float64)
    table.sort(axis=1)
    out: list[list[float | None]] = []
    rows = np.arange(len(samples))
    last = np.maximum(counts - 1, 0)
    for q in (0.5, 0.99):
        pos = q * last
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, last)
        low, high = table[rows, lo], table[rows, hi]
        value = np.where(hi > lo, low + (high - low) * (pos - lo), low)
        out.append([float(v) if n else None for v, n in zip(value, counts, strict=True)])
    return out[0], out[1]
