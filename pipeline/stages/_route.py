"""``Route``: per-sample agent choice, a stage like ``Loop`` (the runner stays unchanged).

A row names its agent in its ``agent`` field (verl's rows: ``agent_name``); both land in
``row.extra`` (unknown top-level keys do). ``Route`` runs that agent's stage list and writes
the name to the sample's ``extra_fields["agent"]``, so the dump, the trainer columns and
:func:`agents_ran` say which agent ran each sample.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pipeline import artifacts as A
from pipeline._data.models import AgentRolloutItem, RolloutSample
from pipeline._data.rows import DatasetRow, check_rows_argument, parse_row
from pipeline._exceptions import RowError, StageDefinitionError
from pipeline._runner.context import Context, Stage
from pipeline._runner.contracts import Available, check_chain
from pipeline._runner.stage import as_stages, run_stage

AGENT_FIELDS = ("agent", "agent_name")
"""Row fields that name the agent, in the order they are read (ours, then verl's)."""

AGENT: str = "agent"
"""``extra_fields`` key (and artifact) with the name of the agent that ran the sample."""


class Route:
    """Run one of several stage lists, chosen per sample by the row's ``agent`` field.

    An unknown or missing name (without ``default``) is a :class:`RowError`:
    :meth:`check_rows` raises it for a whole batch before any sample starts; at run time it
    fails the sample before any routed stage runs.

    Args:
        agents: agent name -> its stage list (validated like a pipeline's).
        default: the agent of rows that name none; None: such rows are refused.
        name: the stage's name in records.

    Raises:
        StageDefinitionError: no agents, a name that is not a non-empty string, an invalid
            stage list, or a ``default`` that is not one of the agents.
    """

    def __init__(self, agents: Mapping[str, Iterable[Any]], *, default: str | None = None,
                 name: str = "route") -> None:
        if not isinstance(agents, Mapping) or not agents:
            raise StageDefinitionError(f"Route: agents must be a non-empty mapping of name -> "
                                       f"stage list, got {agents!r:.80}")
        for key in agents:
            if not isinstance(key, str) or not key:
                raise StageDefinitionError(f"Route: agent names must be non-empty strings, "
                                           f"got {key!r}")
        if default is not None and default not in agents:
            raise StageDefinitionError(f"Route: default {default!r} is not one of the agents "
                                       f"{sorted(agents)}")
        if not isinstance(name, str) or not name:
            raise StageDefinitionError(f"Route: name must be a non-empty string, got {name!r}")
        self.agents: dict[str, list[Stage]] = {
            key: as_stages(stages, where=f" of Route {name!r} agent {key!r}")
            for key, stages in agents.items()}
        self.default = default
        self.name = name

    def check_contract(self, available: Available) -> Available | None:
        """Each agent's contracts; after the route, what every agent provides (None when an
        agent's stages may write anything)."""
        after: Available | None = None
        for key, stages in self.agents.items():
            have = check_chain(stages, available, where=f" of Route {self.name!r} agent {key!r}")
            if have is None:
                return None
            after = have if after is None else after & have
        return after

    def agent_of(self, row: DatasetRow, index: int | None = None) -> str:
        """The agent that runs ``row``.

        Raises:
            RowError: the row names no agent (and there is no default), or an unknown one,
                naming the row, the field and the known agents.
        """
        where = f"row {index}" if index is not None else "row"
        for field in AGENT_FIELDS:
            value = row.extra.get(field)
            if value is None:
                continue
            if not isinstance(value, str) or value not in self.agents:
                raise RowError(f"{where}: field '{field}': unknown agent {value!r:.60}; known "
                               f"agents: {sorted(self.agents)}", row_index=index, field=field)
            return value
        if self.default is None:
            raise RowError(f"{where}: field 'agent' is missing and Route {self.name!r} has no "
                           f"default; known agents: {sorted(self.agents)}", row_index=index,
                           field="agent")
        return self.default

    def check_rows(self, rows: Iterable[Any]) -> None:
        """Refuse a batch with a row whose agent is unknown, before any work starts.

        A pipeline whose stage list holds this stage does it by itself (through
        :meth:`check_row`); call this to check rows elsewhere (dicts, rows or items).

        Raises:
            RowError: the first such row (or a malformed one), naming its index and field.
        """
        check_rows_argument(rows)
        for i, raw in enumerate(rows):
            row = raw.data if isinstance(raw, AgentRolloutItem) else parse_row(raw, i)
            self.agent_of(row, i)

    def check_row(self, row: DatasetRow, index: int) -> None:
        """The pipeline's pre-work check (see :meth:`pipeline.Pipeline.make_items`): a row
        whose agent is unknown is a :class:`RowError` before any sample starts."""
        self.agent_of(row, index)

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        agent = self.agent_of(item.data)
        item.artifacts[AGENT] = agent
        extra = item.artifacts.get(A.EXTRA_FIELDS)
        if not isinstance(extra, dict):
            extra = item.artifacts[A.EXTRA_FIELDS] = {}
        extra[AGENT] = agent
        for stage in self.agents[agent]:
            await run_stage(stage, item, ctx)

    def __repr__(self) -> str:
        return f"Route({ {k: [s.name for s in v] for k, v in self.agents.items()} })"


def agents_ran(samples: Sequence[RolloutSample]) -> dict[str, int]:
    """How many samples each agent ran (``extra_fields["agent"]``; unrouted ones under ``""``)."""
    return dict(Counter(str(s.extra_fields.get(AGENT) or "") for s in samples))
