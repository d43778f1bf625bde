"""``Route``: per-sample agent choice for ``run_batch`` users, the runner unchanged."""

from __future__ import annotations

import json

import pytest

from pipeline import (
    BuildPrompt,
    Generate,
    Pipeline,
    RowError,
    SimulatedEngine,
    StageDefinitionError,
    Status,
)
from pipeline.observability import TrajectoryWriter
from pipeline.stages import Route, agents_ran
from pipeline.testing import ByteTokenizer

CALLS: list[tuple[str, str]] = []


def tagger(tag):
    async def mark(item, ctx):
        CALLS.append((tag, item.uid))
    mark.__name__ = f"mark_{tag}"
    return mark


def route() -> Route:
    return Route({"solver": [BuildPrompt(offload=False), Generate(), tagger("solver")],
                  "checker": [tagger("checker")]}, default="solver")


def pipeline(stages) -> Pipeline:
    return Pipeline(stages, engine=SimulatedEngine(latency_s=0.001, latency_sigma=0,
                                                   tail_prob=0),
                    tokenizer=ByteTokenizer(), sampling={"max_tokens": 4})


async def test_each_sample_runs_its_agent_and_says_so_in_samples_and_dump(tmp_path):
    CALLS.clear()
    pipe = pipeline([route()])
    rows = [{"prompt": "a", "agent": "checker"}, {"prompt": "b"},
            {"prompt": "c", "agent_name": "checker"}]  # ours, the default, verl's field
    dump = tmp_path / "dump.jsonl"
    with TrajectoryWriter(dump, tokenizer=ByteTokenizer()) as writer:
        result = await pipe.run_batch(rows, n=2)
        writer.write_batch(result)
    agents = [s.extra_fields["agent"] for s in result.samples]
    assert agents == ["checker"] * 2 + ["solver"] * 2 + ["checker"] * 2
    assert agents_ran(result.samples) == {"checker": 4, "solver": 2}
    assert all(s.status is Status.COMPLETED for s in result.samples)
    assert [bool(s.response_ids) for s in result.samples] == [False, False, True, True,
                                                              False, False]
    assert sorted(tag for tag, _ in CALLS) == ["checker"] * 4 + ["solver"] * 2
    lines = [json.loads(line) for line in dump.read_text().splitlines()]
    dumped = {ln["uid"]: ln["extra_fields"]["agent"] for ln in lines if ln.get("type") == "sample"}
    assert dumped == {s.uid: a for s, a in zip(result.samples, agents, strict=True)}
    records = result.items[2].records
    assert [r.name for r in records if r.phase == "run"] == ["route", "build_prompt",
                                                            "generate", "mark_solver"]


async def test_unknown_agent_is_a_row_error_before_any_work():
    CALLS.clear()
    r = route()
    rows = [{"prompt": "a", "agent": "solver"}, {"prompt": "b", "agent": "sovler"}]
    with pytest.raises(RowError, match=r"row 1: field 'agent': unknown agent 'sovler'; "
                                       r"known agents: \['checker', 'solver'\]") as info:
        r.check_rows(rows)
    assert info.value.row_index == 1 and info.value.field == "agent"
    engine = SimulatedEngine(latency_s=0.001, latency_sigma=0, tail_prob=0)
    pipe = Pipeline([r], engine=engine, tokenizer=ByteTokenizer())
    # The pipeline runs the stage's check_row on every row: refused before any work.
    for call in (lambda: pipe.run_batch(rows), lambda: _drain(pipe.stream(rows))):
        with pytest.raises(RowError, match="unknown agent 'sovler'"):
            await call()
    assert CALLS == [] and engine.calls == 0 and pipe.samples_done == 0


async def _drain(stream):
    async with stream as samples:
        return [s async for s in samples]


def test_no_default_refuses_rows_without_agent_and_bad_definitions():
    strict = Route({"a": [tagger("a")]})
    with pytest.raises(RowError, match="row 0: field 'agent' is missing"):
        strict.check_rows([{"prompt": "x"}])
    with pytest.raises(RowError, match="unknown agent 7"):
        strict.check_rows([{"prompt": "x", "agent": 7}])
    with pytest.raises(StageDefinitionError, match="default 'b' is not one of the agents"):
        Route({"a": [tagger("a")]}, default="b")
    with pytest.raises(StageDefinitionError, match="agent 'a'"):
        Route({"a": [object()]})
    with pytest.raises(StageDefinitionError, match="non-empty mapping"):
        Route({})
