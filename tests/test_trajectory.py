"""Trajectory dumps: written line by line from a real batch, read back field for field."""

from __future__ import annotations

import json

import numpy as np
import pytest
from obs_batch import make_pipeline, rows

from pipeline import AgentMessage, AgentRolloutItem, Context, Status, artifacts
from pipeline.observability import (
    BatchEnd,
    BatchSummary,
    TrajectoryFormatError,
    TrajectoryReader,
    TrajectoryRecord,
    TrajectoryWriter,
    read_trajectories,
)
from pipeline.testing import ByteTokenizer, capture_logs


def _wire(message: AgentMessage) -> dict:
    out = message.model_dump(mode="json", exclude_none=True)
    ids = out.pop("token_ids", None)
    out.pop("logprobs", None)
    if ids is not None:
        out["num_tokens"] = len(ids)
    return out


async def test_round_trip_keeps_every_field(tmp_path):
    path = tmp_path / "dump.jsonl"
    tok = ByteTokenizer()
    writer = TrajectoryWriter(path, tokenizer=tok)
    writer.begin_batch(step=7, num_samples=12, meta={"model": "simulated"})
    result = await make_pipeline().run_batch(rows(6), n=2, on_sample_done=writer.write)
    writer.end_batch(result)
    writer.close()

    lines = path.read_bytes().splitlines()
    assert json.loads(lines[0])["type"] == "batch" and json.loads(lines[-1])["type"] == "batch_end"
    dump = read_trajectories(path)
    assert dump.torn_tail is None and dump.bad_lines == []
    [summary] = dump.batches
    assert (summary.step, summary.num_samples, summary.meta) == (7, 12, {"model": "simulated"})
    [end] = dump.ends
    assert end.written == 12 and end.stats == result.stats.model_dump(mode="json")
    assert {s.status for s in result.samples} == {Status.COMPLETED, Status.FAILED, Status.TIMEOUT}

    by_uid = {r.uid: r for r in dump.samples}
    assert len(by_uid) == 12
    for item, sample in zip(result.items, result.samples, strict=True):
        rec = by_uid[item.uid]
        assert rec.batch_id == summary.batch_id and rec.step == 7
        assert (rec.group_id, rec.index, rec.sample_index) == (item.group_id, item.index,
                                                               item.sample_index)
        assert rec.status is sample.status and rec.finish_reason is sample.finish_reason
        assert rec.exit_reason == sample.exit_reason and rec.error == sample.error
        assert rec.error_stage == item.error_stage and rec.masked == sample.masked
        assert rec.data_source == item.data.data_source
        assert rec.prompt == item.data.messages
        assert rec.raw_prompt == item.artifacts[artifacts.RAW_PROMPT]
        assert rec.response == tok.decode(sample.response_ids)
        assert (rec.prompt_len, rec.response_len) == (len(sample.prompt_ids),
                                                      len(sample.response_ids))
        assert rec.model_tokens == sum(sample.response_mask)
        assert rec.reward == sample.reward and rec.reward_payload == sample.reward_payload
        assert rec.agent.tools == item.data.tools and rec.agent.tool_turns == sample.tool_turns
        assert rec.conversation() == [_wire(m) for m in item.artifacts[artifacts.MESSAGES]]
        assert [(r.name, r.phase, r.turn, r.status) for r in rec.records] == [
            (r.name, r.phase, r.turn, r.status.value) for r in item.records]
        for got, want in zip(rec.records, item.records, strict=True):
            assert got.duration == pytest.approx(want.duration, abs=2e-6)
        assert rec.latency_s == pytest.approx(item.latency_s, abs=2e-6)
        assert rec.tokens is None
    failed = next(r for r in dump.samples if r.status is Status.FAILED)
    assert "bad row {brace}" in failed.error and failed.error_stage == "outcome"
    assert failed.records[-1].error_type == "ValueError"
    drift = next(r for r in dump.samples if r.counters.get("template_drift"))
    assert drift.counters == {"tool_calls": 1, "tool_errors": 1, "template_drift": 1,
                              "limiter_wait_s": pytest.approx(0.01 * (drift.sample_index + 1))}


async def test_each_line_is_on_disk_when_its_sample_finishes(tmp_path):
    path = tmp_path / "dump.jsonl"
    writer = TrajectoryWriter(path)
    seen: list[int] = []

    def on_done(item: AgentRolloutItem, sample) -> None:
        writer.write(item, sample)
        # A second, independent reader sees the line already: nothing waits in a buffer.
        seen.append(sum(1 for _ in TrajectoryReader(path).samples()))

    await make_pipeline().run_batch(rows(4), n=2, on_sample_done=on_done)
    assert seen == list(range(1, 9))
    writer.close()


async def test_token_ids_only_behind_the_flag(tmp_path):
    result = await make_pipeline().run_batch(rows(4), n=1)
    with TrajectoryWriter(tmp_path / "ids.jsonl", include_token_ids=True) as with_ids:
        with_ids.write_batch(result)
    with TrajectoryWriter(tmp_path / "no_ids.jsonl") as without:
        without.write_batch(result)
    full = read_trajectories(tmp_path / "ids.jsonl")
    lean = read_trajectories(tmp_path / "no_ids.jsonl")
    assert full.batches[0].include_token_ids and not lean.batches[0].include_token_ids
    for sample, a, b in zip(result.samples, full.samples, lean.samples, strict=True):
        assert a.tokens is not None and b.tokens is None
        assert a.tokens.prompt_ids == sample.prompt_ids
        assert a.tokens.response_ids == sample.response_ids
        assert a.tokens.response_mask == sample.response_mask
        assert a.tokens.logprobs == pytest.approx(sample.logprobs)
        for m_full, m_lean in zip(a.agent.messages, b.agent.messages, strict=True):
            if m_full["role"] == "assistant":
                assert "token_ids" not in m_lean
                assert m_lean["num_tokens"] == len(m_full["token_ids"]) > 0
    assert (tmp_path / "ids.jsonl").stat().st_size > (tmp_path / "no_ids.jsonl").stat().st_size


async def test_batches_append_to_one_file_or_rotate_by_step(tmp_path):
    pipe = make_pipeline()
    one = TrajectoryWriter(tmp_path / "all.jsonl")
    rotating = TrajectoryWriter(tmp_path / "steps" / "step_{step:04d}.jsonl")
    for step in (3, 4):
        result = await pipe.run_batch(rows(3), n=1)
        one.write_batch(result, step=step)
        rotating.write_batch(result, step=step)
    one.close()
    rotating.close()

    dump = read_trajectories(tmp_path / "all.jsonl")
    assert [b.step for b in dump.batches] == [3, 4] and len(dump.ends) == 2
    assert [s.step for s in dump.samples] == [3, 3, 3, 4, 4, 4]
    assert len({s.batch_id for s in dump.samples}) == 2
    files = sorted(p.name for p in (tmp_path / "steps").iterdir())
    assert files == ["step_0003.jsonl", "step_0004.jsonl"]
    assert [len(read_trajectories(tmp_path / "steps" / f).samples) for f in files] == [3, 3]
    folder = read_trajectories(tmp_path / "steps")
    assert [s.step for s in folder.samples] == [3, 3, 3, 4, 4, 4]
    unpadded = TrajectoryWriter(tmp_path / "unpadded" / "step_{step}.jsonl")
    for step in (9, 10):
        unpadded.write_batch(result, step=step)
    unpadded.close()
    assert [b.step for b in read_trajectories(tmp_path / "unpadded").batches] == [9, 10]


async def test_torn_tail_is_reported_then_sealed_by_the_next_writer(tmp_path):
    path = tmp_path / "dump.jsonl"
    result = await make_pipeline().run_batch(rows(3), n=1)
    with TrajectoryWriter(path) as writer:
        writer.begin_batch(step=0)
        for item, sample in zip(result.items, result.samples, strict=True):
            writer.write(item, sample)
    data = path.read_bytes()
    last_sample_line = data.rstrip(b"\n").rsplit(b"\n", 2)[-2]  # the batch_end line is last
    cut = data.index(last_sample_line) + len(last_sample_line) // 2
    path.write_bytes(data[:cut])  # what a writer killed mid-line leaves

    with capture_logs() as logs:
        dump = read_trajectories(path)
    assert [s.uid for s in dump.samples] == [it.uid for it in result.items[:2]]
    torn = dump.torn_tail
    assert torn is not None and torn.line == 4 and torn.offset == data.index(last_sample_line)
    assert torn.size == len(last_sample_line) // 2 and torn.preview.startswith('{"type":"sample"')
    assert any(e["event"] == "trajectory_torn_tail" for e in logs)
    read_trajectories(path, strict=True)  # a torn tail is what a crash leaves: never an error

    with TrajectoryWriter(path) as writer:  # appending after a crash seals the torn line
        writer.write_batch(result, step=1)
    dump = read_trajectories(path)
    assert dump.torn_tail is None and len(dump.samples) == 5
    [bad] = dump.bad_lines
    assert bad.line == 4 and "JSON" in bad.reason
    with pytest.raises(TrajectoryFormatError, match="line 4"):
        read_trajectories(path, strict=True)


async def test_odd_artifacts_never_break_the_line_or_the_batch(tmp_path):
    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    async def odd(item: AgentRolloutItem, ctx: Context) -> None:
        item.artifacts[artifacts.REWARD_PAYLOAD] = {"score": np.float32(0.5),
                                                   "per_token": np.arange(3), "tags": {"a"}}
        if item.index == 1:
            item.artifacts[artifacts.EXTRA_FIELDS] = {"bad": Unprintable()}

    pipe = make_pipeline(extra_stages=(odd,))
    path = tmp_path / "dump.jsonl"
    writer = TrajectoryWriter(path)
    with capture_logs() as logs:
        result = await pipe.run_batch(rows(1) * 3, n=1, on_sample_done=writer.write)
    writer.close()
    assert writer.errors == 0 and len(result.samples) == 3
    dump = read_trajectories(path)
    good = [s for s in dump.samples if s.dump_error is None]
    assert len(good) == 2 and good[0].reward_payload == {"score": 0.5, "per_token": [0, 1, 2],
                                                         "tags": ["a"]}
    [minimal] = [s for s in dump.samples if s.dump_error is not None]
    assert minimal.uid == result.items[1].uid and "no repr" in minimal.dump_error
    assert any(e["event"] == "trajectory_line_failed" for e in logs)


async def test_write_errors_are_counted_not_raised_into_the_batch(tmp_path):
    writer = TrajectoryWriter(tmp_path)  # a folder: every open fails with a real OSError
    with capture_logs() as logs:
        result = await make_pipeline().run_batch(rows(3), n=1, on_sample_done=writer.write)
    assert len(result.samples) == 3 and writer.errors == 3 and writer.written == 0
    assert sum(e["event"] == "trajectory_write_failed" for e in logs) == 3
    strict = TrajectoryWriter(tmp_path, raise_errors=True)
    with pytest.raises(IsADirectoryError):
        strict.write(result.items[0], result.samples[0])


def test_reader_reports_a_missing_dump(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trajectory dump"):
        read_trajectories(tmp_path / "nope.jsonl")


def test_line_models_accept_lines_from_newer_writers():
    line = {"type": "sample", "uid": "u", "group_id": "g", "status": "completed",
            "finish_reason": "stop", "future_field": {"x": 1}}
    rec = TrajectoryRecord.model_validate_json(json.dumps(line))
    assert rec.model_extra == {"future_field": {"x": 1}}
    assert BatchSummary(batch_id="b", started_wall=1.0, monotonic=2.0).type == "batch"
    assert BatchEnd(batch_id="b", ended_wall=1.0, monotonic=2.0, written=0).type == "batch_end"


def test_public_names_are_sorted_and_importable():
    import pipeline.observability as obs

    def kind(name: str) -> tuple[int, str]:  # constants, classes, functions (ruff's RUF022)
        return (0 if name.isupper() else 1 if name[0].isupper() else 2, name)

    assert obs.__all__ == sorted(obs.__all__, key=kind)
    assert all(hasattr(obs, name) for name in obs.__all__)
