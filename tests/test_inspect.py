"""``rollout inspect``: summary tables, one trajectory, failures grouped, from a real dump."""

from __future__ import annotations

import asyncio

import pytest
from obs_batch import make_pipeline, rows

from pipeline import Status
from pipeline.observability import (
    TrajectoryWriter,
    inspect_command,
    read_trajectories,
    render_failures,
    render_summary,
    render_trajectory,
)
from pipeline.testing import ByteTokenizer


@pytest.fixture(scope="module")
def dump_path(tmp_path_factory):
    """One real batch of 12 samples: 8 complete, 2 fail, 2 time out."""
    path = tmp_path_factory.mktemp("inspect") / "dump.jsonl"

    async def produce() -> None:
        with TrajectoryWriter(path, tokenizer=ByteTokenizer()) as writer:
            writer.begin_batch(step=3)
            result = await make_pipeline().run_batch(rows(6), n=2, on_sample_done=writer.write)
            writer.end_batch(result)

    asyncio.run(produce())
    return path


def test_summary_counts_by_status_finish_reason_and_data_source(dump_path, capsys):
    assert inspect_command(dump_path, show=None, failed=False) == 0
    out = capsys.readouterr().out
    assert "12 samples in 1 batch(es)" in out
    lines = out.splitlines()

    def row(first: str) -> list[str]:
        return next(line.split() for line in lines if line.split()[:1] == [first])

    assert row("completed")[1:] == ["8", "66.7%"]
    assert row("failed")[1:] == ["2", "16.7%"]
    assert row("timeout")[1] == "2"
    assert row("error")[1] == "2"  # finish_reason and exit_reason error: the failed samples
    assert row("trivia")[1:3] == ["6", "4"]  # rows 0, 2 (hangs), 4: 6 samples, 4 completed
    assert row("math")[1:3] == ["6", "4"]  # rows 1 (fails), 3, 5
    assert row("3")[2:4] == ["12", "8"] and row("3")[-1] == "yes"  # the batch of step 3
    assert "latency p50" in out and "reward mean" in out


def test_show_prints_a_readable_conversation_with_counts_and_timeline(dump_path, capsys):
    dump = read_trajectories(dump_path)
    sample = next(s for s in dump.samples if s.status is Status.COMPLETED and s.agent.tool_turns)
    assert inspect_command(dump_path, show=sample.uid, failed=False) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"sample {sample.uid}")
    assert f"reward {sample.reward:g}" in out
    assert f"tokens: prompt {sample.prompt_len}, response {sample.response_len}" in out
    conversation = out.split("--- conversation ---")[1].split("--- raw prompt")[0]
    assert "[system]\nBe brief." in conversation
    assert "what is 6*7?" in conversation
    first_reply = sample.agent.messages[0]
    assert f"[assistant] {first_reply['num_tokens']} tokens" in conversation
    assert '-> call lookup({"q": "x"})' in conversation
    assert "[tool] for call" in conversation and "lookup says 42" in conversation
    assert sample.raw_prompt in out
    timeline = out.split("--- stage timeline ---")[1]
    for stage in ("build_prompt", "loop", "generate", "call_tools", "outcome", "judge"):
        assert stage in timeline
    assert "|" in timeline and "#" in timeline


def test_show_accepts_a_unique_prefix_and_refuses_others(dump_path, capsys):
    dump = read_trajectories(dump_path)
    group = dump.samples[0].group_id
    assert inspect_command(dump_path, show=f"{group}-", failed=False) == 1  # two samples match
    assert "2 samples" in capsys.readouterr().err
    only = next(s for s in dump.samples if s.group_id == group and s.sample_index == 1)
    assert inspect_command(dump_path, show=f"{group}-1", failed=False) == 0
    assert capsys.readouterr().out.startswith(f"sample {only.uid}")
    assert inspect_command(dump_path, show="no-such-uid", failed=False) == 1
    assert "no sample" in capsys.readouterr().err


def test_failed_groups_failures_by_error(dump_path, capsys):
    assert inspect_command(dump_path, show=None, failed=True) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 of 12 samples did not complete")
    blocks = [b for b in out.split("\n\n")[1:] if b.strip()]
    assert len(blocks) == 2  # one cause each, though every message names its own uid
    heads = sorted(b.split("\n")[0].split() for b in blocks)
    assert heads == [["2", "failed", "stage", "outcome"], ["2", "timeout", "stage", "outcome"]]
    assert "raised ValueError: bad row {brace} in sample <id>" in out


def test_failed_sample_shows_its_error_and_failed_stage(dump_path):
    dump = read_trajectories(dump_path)
    failed = next(s for s in dump.samples if s.status is Status.FAILED)
    text = render_trajectory(failed)
    assert "error (outcome): stage 'outcome' raised ValueError" in text
    assert "ValueError: bad row {brace}" in text.split("--- stage timeline ---")[1]


def test_torn_and_missing_dumps(dump_path, tmp_path, capsys):
    assert inspect_command(tmp_path / "missing.jsonl") == 2
    assert "cannot read" in capsys.readouterr().err
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(dump_path.read_bytes()[:-25])  # cut inside the batch_end line
    assert inspect_command(torn) == 0
    out = capsys.readouterr().out
    assert "12 samples" in out and "is torn" in out and "no (cut short)" in out


def test_library_renderers_match_the_streaming_command(dump_path, capsys):
    dump = read_trajectories(dump_path)
    assert inspect_command(dump_path) == 0
    assert capsys.readouterr().out == render_summary(dump) + "\n"
    assert inspect_command(dump_path, failed=True) == 0
    assert capsys.readouterr().out == render_failures(dump) + "\n"
