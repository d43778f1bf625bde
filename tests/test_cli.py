"""The ``rollout`` command, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.observability import read_trajectories


def rollout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_run_arith_writes_a_summary_and_trajectories(tmp_path):
    out = tmp_path / "traj.jsonl"
    proc = rollout("run", "arith-single", "--engine", "simulated", "--rows", "6", "--n", "2",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "status" in proc.stdout and "completed=12" in proc.stdout
    dump = read_trajectories(out)
    assert len(dump.samples) == 12 and dump.torn_tail is None
    assert all(r.status == "completed" for r in dump.samples)
    assert dump.samples[0].records[0].name == "build_prompt"
    shown = rollout("inspect", str(out), "--show", dump.samples[0].uid)
    assert shown.returncode == 0 and dump.samples[0].uid in shown.stdout
    trace = tmp_path / "trace.json"
    assert rollout("trace", str(out), "-o", str(trace)).returncode == 0
    assert json.loads(trace.read_text())


def test_unknown_scenario_lists_known_ones():
    proc = rollout("run", "nope")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "unknown scenario 'nope'; known: arith, arith-single" in proc.stderr


def test_run_arith_on_the_simulated_engine_runs_the_tool_loop(tmp_path):
    """``rollout run arith --engine simulated`` (the scenario's docstring says it works):
    the scripted agent calls the calculator, then answers with its result."""
    out = tmp_path / "traj.jsonl"
    proc = rollout("run", "arith", "--engine", "simulated", "--rows", "8", "--n", "2",
                   "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    samples = read_trajectories(out).samples
    assert len(samples) == 16 and all(s.status == "completed" for s in samples)
    assert all(s.finish_reason == "stop" for s in samples)  # eos matched: turns end
    with_tool = [s for s in samples if s.agent.tool_turns]
    assert with_tool, "the scripted agent never called the calculator"
    for s in with_tool:
        assert [m["role"] for m in s.agent.messages][-3:] == ["assistant", "tool", "assistant"]
        assert s.reward == 1.0  # the tool's result is the answer


def test_simulated_engine_needs_a_scripted_scenario(monkeypatch, capsys):
    from pipeline import cli

    monkeypatch.setitem(cli.SCENARIOS, "bare", "scenarios")  # a module with no responder
    args = cli.build_parser().parse_args(["run", "bare", "--engine", "simulated"])
    try:
        cli.check_run_args(args)
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("a scenario without a responder was accepted")
    assert "no scripted reply" in capsys.readouterr().err
