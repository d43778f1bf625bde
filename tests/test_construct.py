"""Items and sampling copies built by ``make_items`` without a second validation pass behave
exactly like validated models: equal, assignable, copyable, picklable, frozen where the model
is frozen."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from pipeline import AgentRolloutItem, PipelineConfig, Status
from pipeline._data.items import make_items


def items(n: int = 3) -> list[AgentRolloutItem]:
    rows = [{"prompt": "What is 1 plus 2?", "sampling": {"temperature": 0.5}},
            {"messages": [{"role": "user", "content": "hi"}], "ground_truth": 3}]
    return make_items(rows, n, PipelineConfig(seed=7))


def test_constructed_items_equal_their_validated_round_trip():
    for item in items():
        again = AgentRolloutItem.model_validate(item.model_dump())
        assert again == item
        assert again.model_dump(mode="json") == item.model_dump(mode="json")
        assert pickle.loads(pickle.dumps(item)) == item


def test_assigning_one_item_leaves_the_others_alone():
    first, second, *_ = items()
    first.status = Status.FAILED
    first.artifacts["reward"] = 1.0
    first.records.append("x")  # type: ignore[arg-type]  # lists are the item's own
    assert second.status is None and second.artifacts == {} and second.records == []
    assert first.model_fields_set == second.model_fields_set == set(AgentRolloutItem.model_fields)


def test_sampling_copies_are_per_item_frozen_and_carry_their_seed():
    group = items()[:3]
    seeds = [item.sampling.seed for item in group]
    assert len(set(seeds)) == 3 and all(isinstance(seed, int) for seed in seeds)
    assert {item.sampling.temperature for item in group} == {0.5}
    with pytest.raises(ValidationError):
        group[0].sampling.temperature = 0.9  # type: ignore[misc]
    copy = group[0].model_copy(update={"uid": "other"}, deep=True)
    copy.artifacts["k"] = 1
    assert copy.uid == "other" and group[0].artifacts == {} and copy.sampling == group[0].sampling
