"""verl's input batch to our items: ``DataProto`` in, one item per row, verl's order kept.

verl gives every prompt a ``uid`` and repeats each row ``rollout.n`` times before generation,
so a verl batch already holds one row per rollout. Each row becomes one item (never expanded
again) whose ``group_id`` is verl's ``uid``; rows of one ``uid`` need not be adjacent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline._data.config import PipelineConfig
from pipeline._data.items import make_items
from pipeline._data.models import AgentRolloutItem
from pipeline._data.plain import plain
from pipeline._exceptions import RowError
from pipeline.batch._verl import VERL_DTYPES, VERL_INPUTS

_ROW_KEYS = ("raw_prompt", "tools_kwargs", "index", "agent_name", "data_source",
             "reward_model", "extra_info")


def verl_rows(data: Any) -> list[dict[str, Any]]:
    """verl's non-tensor columns, one dict per row, as our row schema reads them.

    ``raw_prompt`` (chat messages) becomes ``messages``; ``reward_model.ground_truth``,
    ``data_source`` and ``extra_info`` map as :func:`pipeline.load_rows` maps verl rows;
    ``tools_kwargs``, ``index``, ``agent_name`` and ``uid`` land in ``extra``. Every input
    column is also kept under ``extra["verl"]`` (plain Python values; the numpy dtypes of
    non-object columns under ``extra["verl_dtypes"]``), so :func:`to_verl_batch` can emit them
    again as verl's worker does, equal to the input for ``DataProto.union``.

    Raises:
        RowError: the batch has no ``raw_prompt`` column (verl's ``data.return_raw_chat``).
    """
    columns = {k: v for k, v in data.non_tensor_batch.items()}
    if "raw_prompt" not in columns:
        raise RowError("verl batch: column 'raw_prompt' is missing (set "
                       "data.return_raw_chat=True); columns present: "
                       f"{sorted(columns)}", field="raw_prompt")
    dtypes = {k: str(v.dtype) for k, v in columns.items() if v.dtype != object}
    rows = []
    for i in range(len(data)):
        verl_row = {k: plain(v[i]) for k, v in columns.items()}
        row: dict[str, Any] = {"messages": verl_row["raw_prompt"],
                               "extra": {VERL_INPUTS: verl_row, VERL_DTYPES: dtypes}}
        for key in _ROW_KEYS[1:]:
            if key in verl_row:
                row[key] = verl_row[key]
        if "uid" in verl_row:
            row["extra"]["uid"] = verl_row["uid"]
        rows.append(row)
    return rows


def from_verl_batch(
    data: Any,
    *,
    config: PipelineConfig | Mapping[str, Any] | None = None,
) -> list[AgentRolloutItem]:
    """Items for ``Pipeline.run_batch`` from verl's generation batch (``DataProto``).

    Args:
        data: verl's batch after ``repeat(rollout.n)``: ``non_tensor_batch`` with
            ``raw_prompt`` and ``uid`` (plus, as verl's dataset gives them, ``tools_kwargs``,
            ``index``, ``agent_name``, ``data_source``, ``reward_model``, ``extra_info``).
        config: the pipeline's config (``pipeline.config``), for sampling defaults and seeds;
            items are taken as they are by ``run_batch``, so pass the one you run them with.

    Returns:
        One item per row, in verl's order: ``group_id`` = verl's ``uid`` (a fresh id per row
        when the column is missing), ``uid`` = ``f"{group_id}-{k}"`` for the ``k``-th row of
        that group, ``sample_index`` = ``k``.

    Raises:
        RowError: a row is malformed or ``raw_prompt`` is missing.
    """
    if config is None:
        config = PipelineConfig()
    elif not isinstance(config, PipelineConfig):
        config = PipelineConfig.from_dict(dict(config))
    rows = verl_rows(data)
    items = make_items(rows, 1, config)
    seen: dict[str, int] = {}
    for item, row in zip(items, rows, strict=True):
        uid = row["extra"][VERL_INPUTS].get("uid")
        group_id = str(uid) if uid is not None else item.group_id
        k = seen.get(group_id, 0)
        seen[group_id] = k + 1
        item.group_id, item.uid, item.sample_index = group_id, f"{group_id}-{k}", k
    return items
