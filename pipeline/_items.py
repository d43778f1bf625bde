"""Rows to items: validated, expanded ``n`` times per prompt, each with its own seed."""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from pipeline._config import PipelineConfig, SamplingParams
from pipeline._construct import construct
from pipeline._exceptions import ConfigError
from pipeline._models import AgentRolloutItem
from pipeline._rows import DatasetRow, check_rows_argument, parse_row


def make_items(rows: Iterable[Any], n: int | None, config: PipelineConfig,
               start: int = 0) -> list[AgentRolloutItem]:
    """See :meth:`pipeline.Pipeline.make_items`; ``start`` is the index of the first row
    (rows drawn in waves keep distinct seeds and error positions)."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(f"field 'n': must be an int >= 1, got {n!r}", field="n")
    check_rows_argument(rows)
    items: list[AgentRolloutItem] = []
    group_ids = _group_ids()
    for i, raw in enumerate(rows, start):
        if type(raw) is dict:  # the common case first: the model classes' checks cost more
            row = parse_row(raw, i)
        elif isinstance(raw, AgentRolloutItem):
            raw.index = len(items)
            items.append(raw)
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


def _group_ids(block: int = 256) -> Iterator[str]:
    """Group ids of 64 random bits each (uuid4() costs 7x more), read from the OS ``block``
    ids at a time: one system call per row cost as much as the rest of the id."""
    while True:
        randomness = os.urandom(8 * block).hex()
        for k in range(0, 16 * block, 16):
            yield randomness[k:k + 16]
