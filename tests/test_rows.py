"""Row schema: our rows, verl rows, and errors that name the row and field."""

from __future__ import annotations

import json

import pytest

from pipeline import DatasetRow, RowError, load_rows, parse_row


def test_our_row_and_string_prompt():
    row = parse_row({"prompt": "2+2?", "ground_truth": "4", "data_source": "math", "id": 17})
    assert row.messages == [{"role": "user", "content": "2+2?"}]
    assert row.ground_truth == "4" and row.data_source == "math"
    assert row.extra == {"id": 17}


def test_verl_row_mapping():
    verl = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "How many?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 3},
    }
    row = parse_row(verl, 0)
    assert row.messages == verl["prompt"] and row.ground_truth == "72"
    assert row.data_source == "openai/gsm8k"
    assert row.extra == {"extra_info": {"split": "train", "index": 3}, "ability": "math"}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": ["hello"]}, "messages.0"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"prompt": "x", "reward_model": "72"}, "reward_model"),
        ({"prompt": "x", "tools": "calculator"}, "tools"),
        ({"prompt": "x", "data_source": 3}, "data_source"),
    ],
)
def test_bad_rows_name_row_and_field(raw, field):
    with pytest.raises(RowError) as info:
        parse_row(raw, 12)
    assert info.value.row_index == 12 and info.value.field == field
    assert str(info.value).startswith("row 12:") and f"'{field}" in str(info.value)


def test_jsonl_loading_reports_the_bad_line(tmp_path):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"prompt": "ok"})
    path.write_text(f"{good}\n\n{good}\n{{not json\n")
    with pytest.raises(RowError, match=r"data.jsonl line 4 \(row 2\): invalid JSON"):
        load_rows(path)
    path.write_text(f"{good}\n{good}\n")
    assert [r.messages[0]["content"] for r in load_rows(path)] == ["ok", "ok"]
    assert isinstance(load_rows(iter([{"prompt": "a"}]))[0], DatasetRow)


def test_json_list_and_unsupported_suffix(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    assert len(load_rows(path)) == 2
    with pytest.raises(RowError, match="unsupported file type"):
        load_rows(tmp_path / "rows.csv")
