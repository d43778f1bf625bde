"""The adapters against the field names and shapes of docs/trainer_mapping.md.

The tables in the doc are parsed here, so a field added to (or dropped from) an adapter without
the doc, or the other way round, fails a test.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline import BuildPrompt, Generate, Pipeline, SimulatedEngine, Status, artifacts
from pipeline.batch import (
    STATUS_KEYS,
    VERL_BATCH_KEYS,
    VERL_OPTIONAL_KEYS,
    collate,
    to_verl_batch,
    to_verl_outputs,
    to_xtuner,
)
from pipeline.testing import ByteTokenizer

DOC = Path(__file__).resolve().parents[1] / "docs" / "trainer_mapping.md"
LAYERS, TOPK = 3, 2


def table(heading: str) -> list[list[str]]:
    """Rows (cells) of the first table under the heading that contains ``heading``."""
    text = DOC.read_text(encoding="utf-8")
    section = next(part for part in text.split("\n## ") if part.splitlines()[0].find(heading) >= 0)
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert rows, f"no table under {heading!r}"
    return rows


def name(cell: str) -> str:
    return cell.strip("`")


def shape_of(cell: str, dims: dict[str, int]) -> tuple[int, ...]:
    """``"`[B, P + R]` int64"`` -> the shape with the dimensions filled in."""
    inner = re.search(r"\[([^\]]*)\]", cell)
    assert inner is not None, cell
    return tuple(int(eval(part, {}, dims)) for part in inner.group(1).split(","))


async def judge(item, ctx):
    response = item.artifacts[artifacts.RESPONSE_IDS]
    item.artifacts[artifacts.REWARD] = float(len(response) % 3)
    item.artifacts[artifacts.REWARD_PAYLOAD] = {"score": float(len(response) % 3), "acc": True}
    item.artifacts[artifacts.EXTRA_FIELDS] = {"turn_lengths": [len(response)]}


async def fail_some(item, ctx):
    if item.sample_index == 1:
        raise RuntimeError("judge service down")


@pytest.fixture(scope="module")
def batch():
    rows = [{"messages": [{"role": "user", "content": "q" * (5 + 4 * i)}],
             "ground_truth": str(i), "extra": {"row": i}} for i in range(3)]
    pipe = Pipeline([BuildPrompt(offload=False), Generate(), fail_some, judge],
                    engine=SimulatedEngine(latency_s=0.001, latency_sigma=0, tail_prob=0),
                    tokenizer=ByteTokenizer(), sampling={"max_tokens": 16})
    result = asyncio.run(pipe.run_batch(rows, n=3))
    rng = np.random.default_rng(0)
    for s in result.samples:  # routing as an MoE engine would report it (tests/test_moe_*.py
        if not s.masked:      # has the real model); the failed samples have none
            length = len(s.prompt_ids) + len(s.response_ids) - 1
            s.routed_experts = rng.integers(0, 8, (length, LAYERS, TOPK), dtype=np.int16)
    assert {s.status for s in result.samples} == {Status.COMPLETED, Status.FAILED}
    return result


def test_collate_keys_and_shapes_match_the_doc(batch):
    # rows for vision-language samples only are checked in tests/test_multimodal_verl.py
    rows = [r for r in table("`collate` output") if "samples only" not in r[2]]
    out = collate(batch.samples, pad_token_id=0, max_prompt_len=40, max_response_len=20,
                  return_tensors="np")
    assert {name(r[0]) for r in rows} == set(out)
    dims = {"B": len(batch.samples), "P": 40, "R": 20, "L": LAYERS, "K": TOPK}
    for row in rows:
        assert out[name(row[0])].shape == shape_of(row[1], dims), row[0]
        kind = row[1].split("`")[-1].strip()
        if kind in ("int64", "float32", "bool"):
            assert out[name(row[0])].dtype == np.dtype(kind), row[0]


def test_verl_outputs_match_the_doc(batch):
    rows = table("`AgentLoopOutput` (per sample)")
    outputs = to_verl_outputs(batch.samples, items=batch.items, use_verl=False)
    assert len(outputs) == len(batch.samples)
    for sample, out in zip(batch.samples, outputs, strict=True):
        assert set(out) == {name(r[0]) for r in rows}
        length = len(sample.prompt_ids) + len(sample.response_ids)
        assert out["routed_experts"].shape == (length, LAYERS, TOPK)
        assert len(out["response_logprobs"]) == len(out["response_ids"]) == len(
            out["response_mask"])
        assert out["num_turns"] == 2  # user + assistant, from the item's messages
        metrics_row = next(r for r in rows if r[0] == "`metrics`")
        assert set(out["metrics"]) == set(re.findall(r"`(\w+)`", metrics_row[2])) - {"items",
                                                                                  "as_dict"}
        assert out["metrics"]["generate_sequences"] > 0 and out["metrics"]["num_preempted"] == -1
        extra_row = next(r for r in rows if r[0] == "`extra_fields`")
        documented = set(re.findall(r"`((?:rollout|reward|min_global|max_global)_\w+)`",
                                    extra_row[2]))
        assert set(out["extra_fields"]) == documented | {"turn_lengths"}
        assert set(out["extra_fields"]["reward_extra_info"]) == {"acc", "score"}
        if sample.masked:
            assert not out["routed_experts"].any() and not any(out["response_mask"])
            assert out["reward_score"] == 0.0
        else:
            assert out["reward_score"] == sample.reward
            assert (out["routed_experts"][:length - 1] == sample.routed_experts).all()


def test_verl_batch_matches_the_doc(batch):
    rows = table("batch (`DataProto`)")
    out = to_verl_batch(batch.samples, pad_token_id=0, max_prompt_len=40, max_response_len=20,
                        items=batch.items, use_verl=False)
    where: dict[str, set[str]] = {"batch": set(), "non_tensor_batch": set(), "meta_info": set()}
    for row in rows:
        where[row[1]].add(name(row[0]))
    assert set(out["batch"]) == where["batch"] == set(VERL_BATCH_KEYS + VERL_OPTIONAL_KEYS)
    payload_and_extra = {"score", "acc", "turn_lengths"}
    assert set(out["non_tensor_batch"]) == where["non_tensor_batch"] | payload_and_extra
    assert out["non_tensor_batch"]["multi_modal_inputs"].tolist() == [{}] * len(batch.samples)
    assert out["non_tensor_batch"]["raw_prompt"][0] == batch.items[0].data.messages
    assert set(STATUS_KEYS) <= where["non_tensor_batch"]
    assert set(out["meta_info"]) == where["meta_info"]
    dims = {"B": len(batch.samples), "P": 40, "R": 20, "L": LAYERS, "K": TOPK}
    for row in rows:
        key = name(row[0])
        value = out[row[1]][key]
        if row[1] == "batch":
            assert tuple(value.shape) == shape_of(row[2], dims), key
        elif row[1] == "non_tensor_batch":
            assert value.shape == (dims["B"],), key
    assert out["non_tensor_batch"]["uid"].tolist() == [s.group_id for s in batch.samples]
    assert out["meta_info"]["reward_extra_keys"] == ["acc", "score"]
    assert not out["non_tensor_batch"]["rollout_overlong"].any()
    failed = [i for i, s in enumerate(batch.samples) if s.masked]
    assert failed and all(np.isnan(out["non_tensor_batch"]["score"][i]) for i in failed)
    without_uid = to_verl_batch(batch.samples, pad_token_id=0, max_prompt_len=40,
                                max_response_len=20, uid_key=None, use_verl=False)
    assert "uid" not in without_uid["non_tensor_batch"]


def test_verl_batch_counts_overlong_samples(batch):
    out = to_verl_batch(batch.samples, pad_token_id=0, max_prompt_len=40, max_response_len=8,
                        use_verl=False)
    over = [len(s.response_ids) > 8 for s in batch.samples]
    assert "num_overlong" not in out["meta_info"]  # meta_info must be equal across workers
    assert out["non_tensor_batch"]["rollout_overlong"].tolist() == over
    assert sum(over) > 0


def leaves(record: dict[str, Any], documented: set[str], prefix: str = "") -> set[str]:
    """Paths of ``record``, descending only where the doc names deeper fields."""
    found = set()
    for key, value in record.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and any(d.startswith(path + ".") for d in documented):
            found |= leaves(value, documented, path + ".")
        else:
            found.add(path)
    return found


def test_xtuner_records_match_the_doc(batch):
    documented = {name(r[0]) for r in table("XTuner: `RLDataFlowItem`")}
    records = to_xtuner(batch.samples, items=batch.items, tokenizer=ByteTokenizer())
    assert len(records) == len(batch.samples)
    for sample, record in zip(batch.samples, records, strict=True):
        assert leaves(record, documented) == documented
        rollout = record["env"]["rollout"]
        assert rollout["response_ids"] == sample.response_ids
        assert rollout["num_return_tokens"] == len(sample.response_ids)
        assert rollout["response"] == ByteTokenizer().decode(sample.response_ids,
                                                             skip_special_tokens=True)
        assert rollout["extra_info"]["routed_experts"].shape[1:] == (LAYERS, TOPK)
        assert rollout["state"] == ("completed" if not sample.masked else "failed")
        assert rollout["finish_reason"] in ("stop", "length", "failed")
        assert record["data"]["input_ids"] == sample.prompt_ids
        assert record["env"]["judger"]["reward"]["score"] == sample.reward
    by_group: dict[int, set[int]] = {}
    for record in records:
        uid = record["uid"]
        assert uid["root_id"] == uid["action_id"] and 0 <= uid["observation_id"] < 2**63
        by_group.setdefault(uid["root_id"], set()).add(uid["observation_id"])
    assert sorted(len(v) for v in by_group.values()) == [3, 3, 3]
    again = to_xtuner(batch.samples)
    assert [r["uid"] for r in again] == [r["uid"] for r in records]  # ids are stable


def test_xtuner_rollout_extra_info_holds_only_xtuners_keys(batch):
    """XTuner v1.0.1 types ``RLRolloutResponseItem.extra_info`` as a closed ``TypedDict``
    (``routed_experts``, ``partial_rollout_input_ids``) under ``extra="forbid"``: any other key
    there makes ``RLDataFlowItem.model_validate`` refuse the record (checked by hand with
    XTuner's code, which is not on PyPI). The mask and versions ride in the agent's dict."""
    records = to_xtuner(batch.samples, items=batch.items)
    for sample, record in zip(batch.samples, records, strict=True):
        assert set(record["env"]["rollout"]["extra_info"]) <= {"routed_experts",
                                                               "partial_rollout_input_ids"}
        agent = record["env"]["agent"]["extra_info"]
        assert agent["response_mask"] == ([0] * len(sample.response_ids) if sample.masked
                                          else sample.response_mask)
        assert record["data"]["extra_info"]["train_prompt_ids"] == sample.prompt_ids


def test_adapters_apply_the_routing_rule(batch):
    samples = [s.model_copy() for s in batch.samples]
    victim = next(s for s in samples if not s.masked)
    victim.routed_experts = None
    for adapter in (lambda: to_verl_outputs(samples, use_verl=False), lambda: to_xtuner(samples)):
        with pytest.raises(Exception, match=f"sample {victim.uid} .*no routed_experts"):
            adapter()


def test_use_verl_true_needs_verl(batch):
    try:
        import verl  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            to_verl_outputs(batch.samples, use_verl=True)
        return
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
    from verl.protocol import DataProto

    assert isinstance(to_verl_outputs(batch.samples)[0], AgentLoopOutput)
    assert isinstance(to_verl_batch(batch.samples, pad_token_id=0, max_prompt_len=40,
                                    max_response_len=20), DataProto)


def test_items_must_match_the_samples(batch):
    from pipeline import ConfigError

    for adapter in (lambda: to_verl_outputs(batch.samples, items=batch.items[:2], use_verl=False),
                    lambda: to_xtuner(batch.samples, items=batch.items[1:])):
        with pytest.raises(ConfigError, match="items has"):
            adapter()
