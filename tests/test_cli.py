"""The ``rollout`` command, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys


def rollout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_run_arith_writes_a_summary_and_trajectories(tmp_path):
    out = tmp_path / "traj.jsonl"
    proc = rollout("run", "arith", "--rows", "6", "--n", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "status" in proc.stdout and "completed=12" in proc.stdout
    lines = out.read_text().splitlines()
    assert len(lines) == 13
    first = json.loads(lines[1])
    assert first["status"] == "completed" and first["records"][0]["name"] == "build_prompt"


def test_unknown_scenario_lists_known_ones():
    proc = rollout("run", "nope")
    assert proc.returncode != 0 and "unknown scenario 'nope'; known: arith" in proc.stderr
