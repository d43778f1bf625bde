"""Rows to items: validated, expanded ``n`` times per prompt, each with its own seed."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from pipeline._data.config import PipelineConfig, SamplingParams
from pipeline._data.construct import construct, set_fields
from pipeline._data.models import AgentRolloutItem
from pipeline._data.rows import DatasetRow, check_rows_argument, parse_row
from pipeline._exceptions import ConfigError


def make_items(rows: Iterable[Any], n: int | None, config: PipelineConfig,
               start: int = 0) -> list[AgentRolloutItem]:
    """See :meth:`pipeline.Pipeline.make_items`; ``start`` is the index of the first row
    (rows drawn in waves keep distinct seeds and error positions)."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(f"field 'n': must be an int >= 1, got {n!r}", field="n")
    check_rows_argument(rows)
    items: list[AgentRolloutItem] = []
    taken: set[int] = set()
    group_ids = _group_ids()
    for i, raw in enumerate(rows, start):
        if type(raw) is dict:  # the common case first: the model classes' checks cost more
            row = parse_row(raw, i)
        elif isinstance(raw, AgentRolloutItem):
            items.append(_reuse(raw, i, len(items), taken))
            continue
        else:
            row = raw if isinstance(raw, DatasetRow) else parse_row(raw, i)
        sampling = config.sampling if not row.sampling else (
            config.sampling.with_overrides(row.sampling, where=f"row {i}: sampling"))
        base_seed = config.seed if sampling.seed is None else sampling.seed
        group_id = next(group_ids)
        sampling_values = dict(sampling.__dict__)
        for k in range(n or sampling.n):
            sampling_values["seed"] = zlib.crc32(f"{base_seed}:{i}:{k}".encode())
            items.append(construct(AgentRolloutItem, {
                "uid": f"{group_id}-{k}",
                "group_id": group_id,
                "index": len(items),
                "sample_index": k,
                "data": row,
                "sampling": construct(SamplingParams, sampling_values.copy()),
                "artifacts": {},
                "records": [],
                "status": None,
                "finish_reason": None,
                "raw_finish_reason": None,
                "exit_reason": None,
                "error": None,
                "error_stage": None,
                "queued_at": None,
                "started_at": None,
                "ended_at": None,
            }))
    return items


_RUN_STATE = ("artifacts", "records", "status", "finish_reason", "raw_finish_reason",
              "exit_reason", "error", "error_stage", "queued_at", "started_at", "ended_at")
"""What a run writes on an item (cleared before the item runs again)."""


def _reuse(item: AgentRolloutItem, row: int, index: int, taken: set[int]) -> AgentRolloutItem:
    """A ready item, as the next item of a batch. One that already ended (a failure passed
    back to retry it) runs again from the start: everything its last run wrote is cleared,
    its uid, group, row and sampling (seed included) are kept. One that is running in
    another call, or passed twice in this one, is refused: two runs would write one item."""
    if id(item) in taken:
        raise ConfigError(f"row {row}: item {item.uid} is passed twice; an item runs once per "
                          "call (for more rollouts of its row pass n= or the row itself)",
                          field="rows")
    if item.status is None and item.queued_at is not None:
        raise ConfigError(f"row {row}: item {item.uid} is running in another call; wait for "
                          "it to end before passing it again", field="rows")
    taken.add(id(item))
    if item.status is not None:
        set_fields(item, {name: None for name in _RUN_STATE} | {"artifacts": {}, "records": []})
    item.index = index
    return item


def _group_ids(block: int = 256) -> Iterator[str]:
    """Group ids of 64 random bits each (uuid4() costs 7x more), read from the OS ``block``
    ids at a time: one system call per row cost as much as the rest of the id."""
    while True:
        randomness = os.urandom(8 * block).hex()
        for k in range(0, 16 * block, 16):
            yield randomness[k:k + 16]
