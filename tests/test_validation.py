"""A newcomer never hits a wall: every wrong call is refused before any work starts.

One table per surface — public constructors, ``run_batch`` arguments, row fields, ``rollout
run`` options — each case a wrong type, a class instead of an instance, an empty value, a value
out of range or an unknown name. Every refusal is a :class:`PipelineError` subclass whose
message names the field (and ``.field`` where the error has one), and no engine call was made.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline import (
    BuildPrompt,
    CallTools,
    ConfigError,
    FunctionTool,
    Generate,
    Judge,
    Loop,
    Pipeline,
    PipelineConfig,
    PipelineError,
    Resources,
    RowError,
    SamplingParams,
    SimulatedEngine,
    StageDefinitionError,
    calculator_tool,
    cli,
    make_engine,
)
from pipeline.judgers import MathJudger
from pipeline.testing import ByteTokenizer
from pipeline.tools import HermesToolParser

TOK = ByteTokenizer()
GOOD_ROW = {"prompt": "What is 2 + 2?", "ground_truth": "4"}


class SyncRun:
    name = "sync"

    def run(self, item: Any, ctx: Any) -> None:  # not async: refused
        pass


async def _tool_fn(**arguments: Any) -> str:
    return "ok"


def engine() -> SimulatedEngine:
    return SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0)


def pipe(stages: Any = None, **kw: Any) -> Pipeline:
    kw.setdefault("engine", engine())
    kw.setdefault("tokenizer", TOK)
    return Pipeline([BuildPrompt(), Generate()] if stages is None else stages, **kw)


def _coroutine_engine() -> Pipeline:
    return pipe(engine=make_engine("simulated", model_dir=None))


# (case id, what is built, the error class, text the message must hold, expected .field)
CONSTRUCTORS: list[tuple[str, Any, type[PipelineError], str, str | None]] = [
    # PipelineConfig / SamplingParams: unknown name, wrong type, bool, out of range, nested
    ("config-unknown", lambda: PipelineConfig(bogus=1), ConfigError, "bogus", "bogus"),
    ("config-type", lambda: PipelineConfig(sample_timeout_s="soon"), ConfigError,
     "sample_timeout_s", "sample_timeout_s"),
    ("config-bool", lambda: PipelineConfig(max_concurrency=True), ConfigError,
     "max_concurrency", "max_concurrency"),
    ("config-negative", lambda: PipelineConfig(sample_timeout_s=-1), ConfigError,
     "sample_timeout_s", "sample_timeout_s"),
    ("config-zero", lambda: PipelineConfig(max_concurrency=0), ConfigError, "max_concurrency",
     "max_concurrency"),
    ("config-nan", lambda: PipelineConfig(cleanup_timeout_s=float("nan")), ConfigError,
     "cleanup_timeout_s", "cleanup_timeout_s"),
    ("config-nested-unknown", lambda: PipelineConfig(sampling={"tempreature": 1}), ConfigError,
     "sampling.tempreature", "sampling.tempreature"),
    ("config-from-dict", lambda: PipelineConfig.from_dict({"seed": "x"}), ConfigError, "seed",
     "seed"),
    ("sampling-range", lambda: SamplingParams(top_p=0), ConfigError, "top_p", "top_p"),
    ("sampling-zero", lambda: SamplingParams(max_tokens=0), ConfigError, "max_tokens",
     "max_tokens"),
    ("sampling-stop-ids", lambda: SamplingParams(stop_token_ids=[-1]), ConfigError,
     "stop_token_ids", "stop_token_ids.0"),
    ("sampling-unknown", lambda: SamplingParams(max_new_tokens=5), ConfigError,
     "max_new_tokens", "max_new_tokens"),
    # Pipeline options and config
    ("pipeline-unknown-option", lambda: pipe(bogus_key=1), ConfigError, "bogus_key",
     "bogus_key"),
    ("pipeline-option-range", lambda: pipe(sample_timeout_s=0), ConfigError,
     "sample_timeout_s", "sample_timeout_s"),
    ("pipeline-config-type", lambda: pipe(config=3), ConfigError, "config", "config"),
    ("pipeline-config-dict", lambda: pipe(config={"seed": "x"}), ConfigError, "seed", "seed"),
    ("pipeline-resources-type", lambda: Pipeline([BuildPrompt()], resources={}), ConfigError,
     "resources", "resources"),
    ("pipeline-resources-and-engine",
     lambda: Pipeline([BuildPrompt()], resources=Resources(), engine=engine()), ConfigError,
     "resources=", None),
    ("pipeline-fill", lambda: pipe(fill=3), ConfigError, "fill", None),
    # stage lists
    ("stage-class", lambda: pipe([BuildPrompt, Generate()]), StageDefinitionError,
     "write BuildPrompt()", None),
    ("stage-class-in-loop", lambda: pipe([BuildPrompt(), Loop([Generate], max_turns=2)]),
     StageDefinitionError, "stage 0 of Loop 'loop' is the class Generate", None),
    ("stages-one-stage", lambda: pipe(BuildPrompt()), StageDefinitionError, "wrap it in a list",
     None),
    ("stages-class", lambda: pipe(Generate), StageDefinitionError, "list of stages", None),
    ("stages-empty", lambda: pipe([]), StageDefinitionError, "empty", None),
    ("stages-string", lambda: pipe("generate"), StageDefinitionError, "list of stages", None),
    ("stage-sync-function", lambda: pipe([lambda item, ctx: None]), StageDefinitionError,
     "not a stage", None),
    ("stage-sync-run", lambda: pipe([SyncRun()]), StageDefinitionError, "async def run", None),
    ("loop-max-turns-zero", lambda: Loop([Generate()], max_turns=0), StageDefinitionError,
     "max_turns", None),
    ("loop-max-turns-bool", lambda: Loop([Generate()], max_turns=True), StageDefinitionError,
     "max_turns", None),
    ("loop-until", lambda: Loop([Generate()], max_turns=2, until=3), StageDefinitionError,
     "until", None),
    ("loop-name", lambda: Loop([Generate()], max_turns=2, name=""), StageDefinitionError,
     "name", None),
    ("loop-empty", lambda: Loop([], max_turns=2), StageDefinitionError, "empty", None),
    # the built-in stages and tools
    ("judge-class", lambda: Judge(MathJudger), ConfigError, "write MathJudger()", "judgers"),
    ("judge-class-in-list", lambda: Judge([(MathJudger, 1.0)]), ConfigError,
     "write MathJudger()", "judgers"),
    ("judge-unknown-name", lambda: Judge("maths"), PipelineError, "known judgers", None),
    ("judge-timeout-type", lambda: Judge(timeout_s="1m"), ConfigError, "timeout_s",
     "timeout_s"),
    ("judge-on-error", lambda: Judge(on_error="ignore"), ConfigError, "on_error", None),
    ("generate-max-model-len", lambda: Generate(max_model_len=0), ConfigError,
     "max_model_len", "max_model_len"),
    ("generate-parser-class", lambda: Generate(parser=HermesToolParser), StageDefinitionError,
     "HermesToolParser()", None),
    ("call-tools-max-calls", lambda: CallTools(max_calls_per_turn=0), ConfigError,
     "max_calls_per_turn", "max_calls_per_turn"),
    ("call-tools-result-chars", lambda: CallTools(max_result_chars=-1), ConfigError,
     "max_result_chars", "max_result_chars"),
    ("tool-name-empty", lambda: FunctionTool(name="", fn=_tool_fn), ConfigError, "name",
     "name"),
    ("tool-fn-sync", lambda: FunctionTool(name="t", fn=len), ConfigError, "async def", "fn"),
    ("tool-rate", lambda: FunctionTool(name="t", fn=_tool_fn, rate=-1), ConfigError, "rate",
     "rate"),
    ("tool-timeout-type", lambda: FunctionTool(name="t", fn=_tool_fn, timeout_s="5"),
     ConfigError, "timeout_s", "timeout_s"),
    ("tool-fairness-key", lambda: FunctionTool(name="t", fn=_tool_fn, fairness_key="tenant"),
     ConfigError, "fairness_key", "fairness_key"),
    # resources
    ("engine-class", lambda: pipe(engine=SimulatedEngine), ConfigError,
     "write engine=SimulatedEngine(...)", "engine"),
    ("engine-name", lambda: pipe(engine="vllm"), ConfigError, "make_engine('vllm'", "engine"),
    ("engine-coroutine", _coroutine_engine, ConfigError, "await make_engine", "engine"),
    ("engine-not-an-engine", lambda: pipe(engine=object()), ConfigError, "async def generate",
     "engine"),
    ("tokenizer-class", lambda: pipe(tokenizer=ByteTokenizer), ConfigError,
     "write tokenizer=ByteTokenizer(...)", "tokenizer"),
    ("tokenizer-path", lambda: pipe(tokenizer="Qwen/Qwen2.5-0.5B"), ConfigError,
     "from_pretrained", "tokenizer"),
    ("tokenizer-not-a-tokenizer", lambda: pipe(tokenizer=object()), ConfigError,
     "encode, decode, apply_chat_template", "tokenizer"),
    ("tools-one-tool", lambda: pipe(tools=calculator_tool()), ConfigError, "wrap it in a list",
     "tools"),
    ("tools-factory", lambda: pipe(tools=[calculator_tool]), ConfigError, "calculator_tool()",
     "tools[0]"),
    ("tools-string", lambda: pipe(tools="calculator"), ConfigError, "list of tools", "tools"),
    ("tools-dict-value", lambda: pipe(tools={"calc": 3}), ConfigError, "tools['calc']",
     "tools['calc']"),
    ("tools-same-name", lambda: pipe(tools=[calculator_tool(), calculator_tool()]),
     ConfigError, "two tools are named 'calculator'", None),
    ("judgers-string", lambda: pipe(judgers="math"), ConfigError, "judgers", "judgers"),
    ("judgers-class", lambda: pipe(judgers=[MathJudger]), ConfigError, "MathJudger(...)",
     "judgers[0]"),
    ("limiters-type", lambda: pipe(limiters={}), ConfigError, "LimiterRegistry", "limiters"),
    ("extras-type", lambda: pipe(extras=[]), ConfigError, "extras", "extras"),
    ("resources-class", lambda: Resources(engine=SimulatedEngine), ConfigError, "engine",
     "engine"),
    ("eos-mismatch", lambda: pipe(engine=SimulatedEngine(eos_token_id=0)), ConfigError,
     "eos", "engine.eos_token_id"),
    # the simulated engine
    ("sim-rate", lambda: SimulatedEngine(error_rate=2), ConfigError, "error_rate",
     "error_rate"),
    ("sim-latency-type", lambda: SimulatedEngine(latency_s="fast"), ConfigError, "latency_s",
     "latency_s"),
    ("sim-latency-negative", lambda: SimulatedEngine(latency_s=-1), ConfigError, "latency_s",
     "latency_s"),
    ("sim-eos", lambda: SimulatedEngine(eos_token_id=-1), ConfigError, "eos_token_id",
     "eos_token_id"),
    ("sim-vocab", lambda: SimulatedEngine(vocab_size=0), ConfigError, "vocab_size",
     "vocab_size"),
    ("sim-responder", lambda: SimulatedEngine(responder=3), ConfigError, "responder",
     "responder"),
]


@pytest.mark.parametrize(("build", "error", "text", "field"),
                         [c[1:] for c in CONSTRUCTORS], ids=[c[0] for c in CONSTRUCTORS])
def test_constructors_refuse_wrong_arguments(build, error, text, field):
    with pytest.raises(error) as info:
        build()
    assert text in str(info.value)
    if field is not None:
        assert info.value.field == field


# (case id, run_batch keywords, the error class, text the message must hold, expected .field)
BATCH_ARGS: list[tuple[str, dict[str, Any], type[PipelineError], str, str | None]] = [
    ("rows-none", {"rows": None}, RowError, "list of rows", "rows"),
    ("rows-one-row", {"rows": GOOD_ROW}, RowError, "pass [row]", "rows"),
    ("rows-path", {"rows": "data.jsonl"}, RowError, "load_rows(path)", "rows"),
    ("rows-path-object", {"rows": Path("data.jsonl")}, RowError, "load_rows(path)", "rows"),
    ("rows-number", {"rows": 3}, RowError, "list of rows", "rows"),
    ("rows-of-strings", {"rows": ["What is 2 + 2?"]}, RowError, "expected a mapping", None),
    ("n-zero", {"n": 0}, ConfigError, "'n'", "n"),
    ("n-negative", {"n": -2}, ConfigError, "'n'", "n"),
    ("n-float", {"n": 1.5}, ConfigError, "'n'", "n"),
    ("n-bool", {"n": True}, ConfigError, "'n'", "n"),
    ("n-string", {"n": "2"}, ConfigError, "'n'", "n"),
    ("num-needed-zero", {"num_needed": 0}, ConfigError, "num_needed", None),
    ("num-needed-too-many", {"num_needed": 99}, ConfigError, "num_needed", None),
    ("num-needed-bool", {"num_needed": True}, ConfigError, "num_needed", None),
    ("num-needed-float", {"num_needed": 1.5}, ConfigError, "num_needed", None),
]


@pytest.mark.parametrize(("kwargs", "error", "text", "field"), [c[1:] for c in BATCH_ARGS],
                         ids=[c[0] for c in BATCH_ARGS])
async def test_run_batch_refuses_wrong_arguments(kwargs, error, text, field):
    kwargs = {"rows": [GOOD_ROW, GOOD_ROW], "n": 2, **kwargs}
    p = pipe()
    with pytest.raises(error) as info:
        await p.run_batch(kwargs.pop("rows"), **kwargs)
    assert text in str(info.value)
    if field is not None:
        assert info.value.field == field
    assert p.resources.engine.calls == 0 and p.samples_done == 0


def test_on_sample_done_must_be_callable():
    """Refused when the batch starts, not logged once per sample."""
    p = pipe()
    with pytest.raises(ConfigError, match="on_sample_done"):
        asyncio.run(p.run_batch([GOOD_ROW], on_sample_done=3))
    assert p.resources.engine.calls == 0


# (case id, the bad row, the error class, text the message must hold, expected .field)
ROWS: list[tuple[str, Any, type[PipelineError], str, str | None]] = [
    ("no-messages", {"question": "hi"}, RowError, "'messages' is missing", "messages"),
    ("prompt-empty", {"prompt": ""}, RowError, "no user message with content", "prompt"),
    ("prompt-blank", {"prompt": "  \n"}, RowError, "no user message with content", "prompt"),
    ("prompt-number", {"prompt": 3}, RowError, "'prompt' must be", "prompt"),
    ("prompt-empty-list", {"prompt": []}, RowError, "'prompt' must be", "prompt"),
    ("messages-not-list", {"messages": "hi"}, RowError, "'messages' must be", "messages"),
    ("message-not-mapping", {"messages": ["hi"]}, RowError, "messages.0", "messages.0"),
    ("role-unknown", {"messages": [{"role": "human", "content": "hi"}]}, RowError,
     "messages.0.role", "messages.0.role"),
    ("content-number", {"messages": [{"role": "user", "content": 3}]}, RowError,
     "messages.0.content", "messages.0.content"),
    ("only-system", {"messages": [{"role": "system", "content": "be brief"}]}, RowError,
     "no user message with content", "messages"),
    ("user-content-empty", {"messages": [{"role": "system", "content": "x"},
                                         {"role": "user", "content": ""}]}, RowError,
     "no user message with content", "messages"),
    ("user-parts-empty", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                     "text": ""}]}]},
     RowError, "no user message with content", "messages"),
    ("content-key-typo", {"messages": [{"role": "user", "contents": "hi"}]}, RowError,
     "no user message with content", "messages"),
    ("tools-not-list", {**GOOD_ROW, "tools": {"name": "calculator"}}, RowError, "'tools'",
     "tools"),
    ("tools-bad-schema", {**GOOD_ROW, "tools": [{"name": "calculator"}]}, RowError,
     "'tools.0'", "tools.0"),
    ("data-source-empty", {**GOOD_ROW, "data_source": ""}, RowError, "data_source",
     "data_source"),
    ("data-source-number", {**GOOD_ROW, "data_source": 7}, RowError, "data_source",
     "data_source"),
    ("sampling-not-dict", {**GOOD_ROW, "sampling": [1]}, RowError, "sampling", "sampling"),
    ("sampling-unknown", {**GOOD_ROW, "sampling": {"temprature": 0.5}}, ConfigError,
     "row 1: sampling.temprature", "sampling.temprature"),
    ("sampling-range", {**GOOD_ROW, "sampling": {"temperature": -1}}, ConfigError,
     "sampling.temperature", "sampling.temperature"),
    ("sampling-type", {**GOOD_ROW, "sampling": {"max_tokens": "many"}}, ConfigError,
     "sampling.max_tokens", "sampling.max_tokens"),
    ("reward-model-not-mapping", {**GOOD_ROW, "reward_model": "4"}, RowError, "reward_model",
     "reward_model"),
    ("extra-not-dict", {**GOOD_ROW, "extra": [1]}, RowError, "extra", None),
]


@pytest.mark.parametrize(("row", "error", "text", "field"), [c[1:] for c in ROWS],
                         ids=[c[0] for c in ROWS])
async def test_rows_are_refused_before_any_sample_runs(row, error, text, field):
    p = pipe()
    with pytest.raises(error) as info:
        await p.run_batch([GOOD_ROW, row, GOOD_ROW], n=2)
    assert text in str(info.value)
    assert "row 1" in str(info.value)
    if isinstance(info.value, RowError):
        assert info.value.row_index == 1
    if field is not None:
        assert info.value.field == field
    assert p.resources.engine.calls == 0 and p.samples_done == 0


# (case id, argv after "rollout", text the one line must hold)
CLI: list[tuple[str, list[str], str]] = [
    ("timeout-negative", ["run", "arith", "--timeout", "-1"], "--timeout"),
    ("timeout-zero", ["run", "arith", "--timeout", "0"], "--timeout"),
    ("timeout-nan", ["run", "arith", "--timeout", "nan"], "--timeout"),
    ("timeout-type", ["run", "arith", "--timeout", "soon"], "--timeout"),
    ("n-zero", ["run", "arith", "--n", "0"], "--n"),
    ("n-type", ["run", "arith", "--n", "two"], "--n"),
    ("rows-zero", ["run", "arith", "--rows", "0"], "--rows"),
    ("concurrency-zero", ["run", "arith", "--concurrency", "0"], "--concurrency"),
    ("max-tokens-zero", ["run", "arith", "--max-tokens", "0"], "--max-tokens"),
    ("max-response-tokens", ["run", "arith", "--max-response-tokens", "-5"],
     "--max-response-tokens"),
    ("seed-type", ["run", "arith", "--seed", "1.5"], "--seed"),
    ("sim-latency-engine", ["run", "arith", "--sim-latency", "0.1"], "--sim-latency"),
    ("sim-latency-negative", ["run", "arith", "--engine", "simulated", "--sim-latency", "-1"],
     "--sim-latency"),
    ("engine-unknown", ["run", "arith", "--engine", "sglang"], "--engine"),
    ("openai-no-url", ["run", "arith", "--engine", "openai"], "--base-url"),
    ("openai-bad-url", ["run", "arith", "--engine", "openai", "--base-url", "localhost:8000"],
     "--base-url"),
    ("url-wrong-engine", ["run", "arith", "--base-url", "http://127.0.0.1:8000"], "--base-url"),
    ("device-unknown", ["run", "arith", "--engine", "transformers", "--device", "tpu"],
     "--device"),
    ("device-wrong-engine", ["run", "arith", "--engine", "simulated", "--device", "cpu"],
     "--device"),
    ("model-missing", ["run", "arith", "--model", "no/such/model"], "--model"),
    ("model-simulated", ["run", "arith", "--engine", "simulated", "--model", "."], "--model"),
    ("out-folder-missing", ["run", "arith", "--out", "no/such/folder/t.jsonl"], "--out"),
    ("out-is-folder", ["run", "arith", "--out", "."], "--out"),
    ("tensorboard-folder-missing", ["run", "arith", "--tensorboard", "no/such/folder/tb"],
     "--tensorboard"),
    ("scenario-unknown", ["run", "arithmetic"], "unknown scenario 'arithmetic'"),
    ("option-unknown", ["run", "arith", "--turns", "3"], "--turns"),
    ("log-level-unknown", ["--log-level", "loud", "run", "arith"], "--log-level"),
    ("log-format-unknown", ["--log-format", "xml", "run", "arith"], "--log-format"),
    ("command-unknown", ["serve"], "serve"),
    ("inspect-no-file", ["inspect"], "file"),
]


@pytest.mark.parametrize(("argv", "text"), [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli_refuses_wrong_options_in_one_line(argv, text, capsys, monkeypatch):
    """Parsed and checked exactly as ``main`` does, short of starting anything."""
    started = []
    monkeypatch.setattr(cli, "_run", lambda *a: started.append(a))
    with pytest.raises(SystemExit) as info:
        args = cli.build_parser().parse_args(argv)
        if args.command == "run":
            cli.check_run_args(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and text in err, err
    assert not started


def test_cli_refusal_in_a_real_process_starts_no_engine(tmp_path):
    """``rollout run arith --timeout -1``: exit 2, one line naming --timeout; the tiny model
    (the first thing a run would build) is never touched."""
    model_dir = tmp_path / "tiny"
    env = {**os.environ, "ROLLOUT_TINY_MODEL_DIR": str(model_dir)}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "arith", "--timeout",
                           "-1"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--timeout" in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert not model_dir.exists()
