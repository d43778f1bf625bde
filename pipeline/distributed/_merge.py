"""A batch split across the workers, and what comes back put together again.

A prompt's ``n`` samples stay on one worker (:func:`shard`), where the engine's prefix cache
serves them, and the groups go to the least loaded workers. Results arrive in whatever order
the workers finish; :class:`BatchCollector` puts them back in input order, and
:class:`GroupCollector` hands out a group once all its samples are back.
"""

from __future__ import annotations

import time

from pipeline._data.models import AgentRolloutItem, ProduceBatchResult, RolloutSample
from pipeline._data.stats import safe_stats
from pipeline._runner.dynamic import GroupResult
from pipeline._runner.stream import SampleResult
from pipeline.distributed._fleet import SlotWorker


def by_group(items: list[AgentRolloutItem]) -> dict[str, list[AgentRolloutItem]]:
    """``items`` by their group id, in order."""
    groups: dict[str, list[AgentRolloutItem]] = {}
    for item in items:
        groups.setdefault(item.group_id, []).append(item)
    return groups


def shard(groups: list[list[AgentRolloutItem]], workers: list[SlotWorker]
          ) -> list[tuple[SlotWorker, list[AgentRolloutItem]]]:
    """Each group to the least loaded of ``workers`` (counting what this batch gives them)."""
    load = {id(w): w.load for w in workers}
    batches: dict[int, list[AgentRolloutItem]] = {id(w): [] for w in workers}
    for group in groups:
        target = min(workers, key=lambda w: load[id(w)])
        batches[id(target)].extend(group)
        load[id(target)] += len(group)
    return [(w, batches[id(w)]) for w in workers if batches[id(w)]]


class BatchCollector:
    """The samples of a batch in input order, as ``Pipeline.run_batch`` returns them."""

    def __init__(self, items: list[AgentRolloutItem]) -> None:
        self._position = {item.uid: i for i, item in enumerate(items)}
        self._samples: list[RolloutSample | None] = [None] * len(items)
        self._items = list(items)

    def add(self, sample: RolloutSample, item: AgentRolloutItem) -> None:
        i = self._position[item.uid]
        self._samples[i], self._items[i] = sample, item

    def result(self, started: float) -> ProduceBatchResult:
        """The batch, its stats timed from ``started`` (``time.monotonic()``)."""
        done = [s for s in self._samples if s is not None]
        assert len(done) == len(self._items), "every sample comes back exactly once"
        return ProduceBatchResult(
            samples=done, items=self._items,
            stats=safe_stats(done, self._items, time.monotonic() - started))


class GroupCollector:
    """Samples gathered into their prompt groups, each ordered by its sample index."""

    def __init__(self, items: list[AgentRolloutItem]) -> None:
        self._size: dict[str, int] = {}
        for item in items:
            self._size[item.group_id] = self._size.get(item.group_id, 0) + 1
        self._got: dict[str, list[SampleResult]] = {}

    def add(self, result: SampleResult) -> str | None:
        """Take ``result``; returns its group id once that group is complete (then
        :meth:`take` it)."""
        gid = result.item.group_id
        done = self._got.setdefault(gid, [])
        done.append(result)
        return gid if len(done) == self._size[gid] else None

    def take(self, gid: str) -> GroupResult:
        """The complete group ``gid``, which the collector keeps no longer."""
        done = sorted(self._got.pop(gid), key=lambda r: r.item.sample_index)
        del self._size[gid]
        return GroupResult(gid, [r.sample for r in done], [r.item for r in done])
