"""Deficit round-robin over per-key FIFO queues: who is served next, fairly.

Keys with queued callers take turns. On its turn a key is credited ``quantum * weight`` and
serves callers from the head of its queue while their cost fits its deficit; then the turn
passes. A key whose queue empties forgets its deficit (it cannot bank credit while idle).
Over any backlogged stretch each key gets tokens in proportion to its weight, whatever the
number of callers it queues, and FIFO order holds within a key.

The class only orders callers; it knows nothing of tokens, time or threads. The bucket calls
:meth:`DeficitRoundRobin.head` to see who is next and :meth:`DeficitRoundRobin.pop` once the
tokens are there. ``head`` is idempotent, so a head blocked on tokens keeps its place.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

#: Slack for float comparisons of costs, deficits and tokens.
EPS = 1e-9


class Queued(Protocol):
    """What the scheduler needs of a queued caller."""

    @property
    def key(self) -> Hashable: ...

    @property
    def cost(self) -> float: ...


W = TypeVar("W", bound=Queued)


class DeficitRoundRobin(Generic[W]):
    """Per-key FIFO queues served in weighted deficit round-robin order.

    Args:
        quantum: credit per turn for a key of weight 1, in tokens. Smaller is finer-grained;
            rounds in which no key could be served are skipped arithmetically, so a small
            quantum costs no loop iterations.

    Attributes:
        waiting: callers queued now, all keys (read it, don't set it; a plain attribute
            because the bucket's uncontended path checks it on every call).
    """

    def __init__(self, quantum: float = 1.0) -> None:
        self._quantum = quantum
        self._weights: dict[Hashable, float] = {}
        self._queues: dict[Hashable, deque[W]] = {}  # only keys with callers
        self._deficit: dict[Hashable, float] = {}
        self._turns: deque[Hashable] = deque()  # the same keys, in turn order
        self._credited = False  # whether _turns[0] has received its credit this turn
        self.waiting = 0

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has callers queued now."""
        return key in self._queues

    def weight(self, key: Hashable) -> float:
        """The weight of ``key`` (1.0 unless set)."""
        return self._weights.get(key, 1.0)

    def set_weight(self, key: Hashable, weight: float) -> None:
        """Set the weight of ``key``; it applies from the key's next turn."""
        self._weights[key] = weight

    def queue_lens(self) -> dict[Hashable, int]:
        """Callers queued now, per key (keys with none are absent)."""
        return {key: len(queue) for key, queue in self._queues.items()}

    def push(self, waiter: W) -> None:
        """Queue ``waiter`` behind the callers of its key; a new key takes the last turn."""
        queue = self._queues.get(waiter.key)
        if queue is None:
            queue = self._queues[waiter.key] = deque()
            self._deficit[waiter.key] = 0.0
            self._turns.append(waiter.key)
        queue.append(waiter)
        self.waiting += 1

    def remove(self, waiter: W) -> bool:
        """Take ``waiter`` out of its queue; False if it is not queued."""
        queue = self._queues.get(waiter.key)
        if queue is None:
            return False
        try:
            queue.remove(waiter)
        except ValueError:
            return False
        self.waiting -= 1
        if not queue:
            self._drop(waiter.key)
        return True

    def head(self) -> W | None:
        """The caller to serve next, or None when nothing is queued.

        Advances turns (and credits) until some key's head fits its deficit; calling it
        again without :meth:`pop` returns the same caller.
        """
        misses = 0
        while self._turns:
            key = self._turns[0]
            if not self._credited:
                self._deficit[key] += self._quantum * self.weight(key)
                self._credited = True
            head = self._queues[key][0]
            if head.cost <= self._deficit[key] + EPS:
                return head
            self._turns.rotate(-1)
            self._credited = False
            misses += 1
            if misses == len(self._turns):
                self._skip_idle_rounds()
                misses = 0
        return None

    def pop(self) -> W:
        """Remove and return :meth:`head`, charging its cost to its key's deficit.

        Raises:
            IndexError: nothing is queued.
        """
        head = self.head()
        if head is None:
            raise IndexError("pop from an empty DeficitRoundRobin")
        queue = self._queues[head.key]
        queue.popleft()
        self.waiting -= 1
        self._deficit[head.key] -= head.cost
        if not queue:
            self._drop(head.key)
        return head

    def drain(self) -> list[W]:
        """Remove and return every queued caller, keys in turn order, FIFO within a key."""
        waiters = [w for key in self._turns for w in self._queues[key]]
        self._queues.clear()
        self._deficit.clear()
        self._turns.clear()
        self._credited = False
        self.waiting = 0
        return waiters

    def _drop(self, key: Hashable) -> None:
        del self._queues[key]
        del self._deficit[key]
        if self._turns[0] == key:
            self._turns.popleft()
            self._credited = False
        else:
            self._turns.remove(key)

    def _skip_idle_rounds(self) -> None:
        # Every key has just had a turn without its head fitting. Jump over the rounds in which
        # that would happen again: r rounds later the first key that fits is served, exactly as
        # if the rounds had been run one by one.
        rounds = min(
            max(1, math.ceil((self._queues[k][0].cost - self._deficit[k] - EPS)
                             / (self._quantum * self.weight(k))))
            for k in self._turns
        ) - 1
        if rounds > 0:
            for key in self._turns:
                self._deficit[key] += rounds * self._quantum * self.weight(key)
