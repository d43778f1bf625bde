"""The ``rollout`` command line.

``rollout run SCENARIO`` runs a scenario end to end and prints a summary table;
``rollout inspect FILE`` and ``rollout trace FILE`` read its trajectory dump;
``rollout dump PID`` asks a running process for a task dump.

The global options (``--log-level``, ``--log-format``, ``--verbose``) go before or after the
subcommand. ``rollout run`` prints the engine choice, one line naming the engine's log file,
a progress bar (on a terminal) and the summary: what a local engine and its processes print
(vLLM's logs, torch and transformers warnings) goes to that file, or to the terminal with
``--verbose``; if the engine fails, its error and the log's last lines are shown.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from pipeline._data.models import Status
from pipeline._exceptions import PipelineError
from pipeline._gc import gc_tuning_enabled
from pipeline._logging import Console, configure_logging, output_to_file, tail_lines
from pipeline._runner.pipeline import Pipeline
from pipeline.cli._report import family_summary, summary
from pipeline.diagnostics import add_dump_arguments, asyncio_run, run_dump
from pipeline.engines import (
    ENGINE_NAMES,
    Engine,
    SimulatedEngine,
    make_engine,
    resolve_engine_name,
    vllm_available,
)
from pipeline.families import FAMILIES
from pipeline.models import ensure_random_tiny_model
from pipeline.observability import (
    BatchProgress,
    TensorBoardSink,
    TrajectoryWriter,
    chain_callbacks,
    inspect_command,
    log_batch_metrics,
    trace_command,
)
from pipeline.testing import ByteTokenizer

SCENARIOS = {"arith": "scenarios.arith_tools", "arith-single": "scenarios.arith"}
"""Scenario name -> module (see ``scenarios/__init__.py`` for what a module provides)."""

USAGE_ERROR = 2
"""Exit status of a refused command line (argparse's, for every check here too)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``rollout run: argument --n: invalid int value: 'x'``."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see: {self.prog} --help)\n")


def _refuse(command: str, message: str) -> NoReturn:
    """End a refused command line: one line on stderr, exit status 2, nothing started."""
    print(f"rollout {command}: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def load_scenario(name: str) -> ModuleType:
    """Import a scenario module by its short name.

    Raises:
        SystemExit: unknown name (one line listing the known ones; status 2).
    """
    if name not in SCENARIOS:
        _refuse("run", f"unknown scenario {name!r}; known: {', '.join(sorted(SCENARIOS))}")
    return importlib.import_module(SCENARIOS[name])


def checkpoint_dtype(model_dir: Path) -> str | None:
    """The dtype a model directory's ``config.json`` records (``dtype``, or ``torch_dtype`` of
    older transformers), or None when it records none or cannot be read."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    found = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return found if isinstance(found, str) else None


def _engine_options(engine: str, model_dir: Path | None) -> dict[str, Any]:
    """``make_engine`` options: vLLM runs a float32 checkpoint (the shipped tiny policy) in
    float32; its ``auto`` dtype would cast it to bfloat16 (and warn once per weight)."""
    chosen, _ = resolve_engine_name(engine)
    if chosen == "vllm" and model_dir is not None and checkpoint_dtype(model_dir) == "float32":
        return {"dtype": "float32"}
    return {}


def scripted(args: argparse.Namespace) -> bool:
    """Whether this run's replies are scripted: ``--engine simulated``, or ``--family`` with
    ``--engine auto`` (a family's tiny model has random weights: it would never call a tool)."""
    return args.engine == "simulated" or (args.family is not None and args.engine == "auto")


async def _build_engine(args: argparse.Namespace, scenario: ModuleType,
                        console: Console) -> tuple[Engine, Any]:
    """The engine and tokenizer ``--engine`` asks for (``auto``: vLLM if installed)."""
    if args.family is not None and scripted(args):
        from pipeline.families import family_tokenizer

        tokenizer = await asyncio.to_thread(family_tokenizer, args.family)
        engine = SimulatedEngine(
            latency_s=0.05 if args.sim_latency is None else args.sim_latency,
            responder=scenario.family_responder(tokenizer, args.family),
            seed=args.seed,
            vocab_size=len(tokenizer),
        )
        return engine, tokenizer
    if args.engine == "simulated":  # check_run_args made sure the scenario has a responder
        tokenizer = ByteTokenizer()
        engine = SimulatedEngine(
            latency_s=0.05 if args.sim_latency is None else args.sim_latency,
            responder=scenario.responder(tokenizer),
            seed=args.seed,
            vocab_size=tokenizer.vocab_size,
        )
        return engine, tokenizer
    if args.model:
        model_dir: Path | None = Path(args.model)
    elif args.engine == "openai":
        model_dir = None
    elif args.family is not None:  # the family's tiny random-weight model
        from pipeline.families import ensure_family_model

        model_dir = await asyncio.to_thread(ensure_family_model, args.family)
    else:
        # a scenario may ship its own default model (arith: the trained tiny policy)
        model_dir = await asyncio.to_thread(getattr(scenario, "default_model",
                                                    ensure_random_tiny_model))
    started = time.monotonic()
    try:
        built = await make_engine(
            args.engine,
            model_dir=model_dir,
            base_url=args.base_url,
            seed=args.seed,
            device=args.device,
            notify=lambda line: print(line, file=console.err),
            options=_engine_options(args.engine, model_dir),
        )
    except PipelineError as exc:
        raise SystemExit(f"rollout run: {exc}") from None
    print(f"engine ready in {time.monotonic() - started:.1f}s", file=console.err)
    return built


def check_run_args(args: argparse.Namespace) -> ModuleType:
    """Check every ``rollout run`` option before anything starts; return the scenario module.

    Raises:
        SystemExit: status 2 with one line naming the option, before any engine, model or
            file is touched.
    """
    for option, value in (("--n", args.n), ("--rows", args.rows),
                          ("--concurrency", args.concurrency), ("--max-tokens", args.max_tokens),
                          ("--max-response-tokens", args.max_response_tokens)):
        if value < 1:
            _refuse("run", f"{option} must be >= 1, got {value}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        _refuse("run", f"--timeout must be a number of seconds > 0, got {args.timeout:g}")
    if not scripted(args) and args.sim_latency is not None:
        _refuse("run", "--sim-latency is for --engine simulated only")
    if args.sim_latency is not None and not (math.isfinite(args.sim_latency)
                                             and args.sim_latency >= 0):
        _refuse("run", f"--sim-latency must be >= 0 seconds, got {args.sim_latency:g}")
    if args.engine == "openai":
        if not args.base_url:
            _refuse("run", "--engine openai needs --base-url URL (an OpenAI-compatible server)")
        for url in args.base_url:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                _refuse("run", f"--base-url must be an http(s) URL, got {url!r}")
    elif args.base_url:
        _refuse("run", f"--base-url is for --engine openai, not --engine {args.engine}")
    if args.device is not None:
        if args.engine not in ("transformers", "auto"):
            _refuse("run", f"--device is for --engine transformers, not --engine {args.engine}")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
            _refuse("run", f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.model is not None:
        if args.engine == "simulated":
            _refuse("run", "--model has no effect with --engine simulated (it has no model)")
        if not Path(args.model).is_dir():
            _refuse("run", f"--model {args.model!r} is not a directory (a model directory "
                           "with config.json and the tokenizer)")
    if args.engine == "vllm" and not vllm_available():
        _refuse("run", "--engine vllm: vLLM is not installed here (bash "
                       "scripts/install_vllm.sh, or --engine transformers)")
    for option, value in (("--out", args.out), ("--tensorboard", args.tensorboard)):
        if value is None:
            continue
        path = Path(value)
        if option == "--out" and path.is_dir():
            _refuse("run", f"--out {value!r} is a directory; give a file name (traj.jsonl)")
        if not path.resolve().parent.is_dir():
            _refuse("run", f"{option} {value!r}: the folder {str(path.parent)!r} does not exist")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        _refuse("run", "--tensorboard needs the tensorboard package (pip install tensorboard)")
    scenario = load_scenario(args.scenario)
    if args.family is not None and not hasattr(scenario, "family_responder"):
        _refuse("run", f"scenario {args.scenario!r} has no model-family version; --family is "
                       "for: arith")
    if args.engine == "simulated" and not hasattr(scenario, "responder"):
        _refuse("run", f"scenario {args.scenario!r} has no scripted reply for the simulated "
                       "engine; use --engine auto|vllm|transformers")
    return scenario


async def _run(args: argparse.Namespace, scenario: ModuleType, console: Console) -> int:
    engine, tokenizer = await _build_engine(args, scenario, console)
    if gc_tuning_enabled(None):
        # asyncio_run froze what existed at start-up; an in-process engine (vLLM, torch) is
        # built after that: freeze it too, as vLLM's own server does (undone on exit).
        gc.freeze()
    tools = scenario.tools() if hasattr(scenario, "tools") else {}
    # a family's stages load vLLM's parsers (an import of seconds): not on the event loop
    stages = (await asyncio.to_thread(scenario.stages, family=args.family) if args.family
              else scenario.stages())
    pipeline = Pipeline(
        stages,
        engine=engine,
        tokenizer=tokenizer,
        tools=tools,
        max_concurrency=args.concurrency,
        sample_timeout_s=args.timeout,
        seed=args.seed,
        sampling={"max_tokens": args.max_tokens, "max_response_tokens": args.max_response_tokens},
    )
    rows = scenario.rows(args.rows, seed=args.seed)
    progress = BatchProgress(len(rows) * args.n, stream=console.err)
    writer = TrajectoryWriter(args.out, tokenizer=tokenizer) if args.out else None
    try:
        if writer is not None:
            writer.begin_batch(step=0, meta={"scenario": args.scenario, "engine": args.engine})
        callback = chain_callbacks(writer.write if writer else None, progress)
        result = await pipeline.run_batch(rows, n=args.n, on_sample_done=callback)
        if writer is not None:
            writer.end_batch(result)
    finally:
        progress.close()
        if writer is not None:
            writer.close()
        await engine.aclose()
    shown = "scripted" if args.family is not None and scripted(args) else args.engine
    print(f"scenario {args.scenario} on the {type(engine).__name__} engine ({shown})",
          file=console.out)
    print(summary(result), file=console.out)
    if args.family is not None:
        print(family_summary(args.family, scripted(args), result), file=console.out)
    if args.out:
        print(f"trajectories written to {args.out} (see: rollout inspect {args.out} --list)",
              file=console.out)
    if args.tensorboard:
        log_batch_metrics(result, [TensorBoardSink(args.tensorboard)], 0)
    completed = result.stats.by_status.get(Status.COMPLETED.value, 0)
    return 0 if completed else 1


def _global_options(defaults: dict[str, Any] | None) -> _Parser:
    """The global options, accepted before and after the subcommand (a fresh parser each
    time: argparse shares the action objects of a parent with its children)."""
    def default(name: str) -> Any:
        return argparse.SUPPRESS if defaults is None else defaults[name]

    common = _Parser(add_help=False)
    common.add_argument("--log-level", default=default("log_level"), type=str.lower,
                        choices=("debug", "info", "warning", "error", "critical"),
                        help="which log lines to print (default warning)")
    common.add_argument("--log-format", default=default("log_format"), choices=("kv", "json"),
                        help="log lines as key=value (default) or JSON")
    common.add_argument("-v", "--verbose", action="store_true", default=default("verbose"),
                        help="rollout run: print the engine's own output (vLLM's logs, torch "
                             "warnings) here instead of into its log file")
    return common


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of the ``rollout`` command."""
    parser = _Parser(prog="rollout", description=__doc__.splitlines()[0],
                     parents=[_global_options(GLOBAL_DEFAULTS)])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        # the subcommand's copies set nothing unless given (SUPPRESS): a value given after
        # the subcommand wins over one given before, and neither given keeps the defaults
        made: argparse.ArgumentParser = sub.add_parser(
            name, parents=[_global_options(None)], **kwargs)
        return made

    run = add("run", help="run a scenario end to end")
    run.add_argument("scenario", help=f"one of: {', '.join(sorted(SCENARIOS))}")
    run.add_argument("--n", type=int, default=4, help="rollouts per prompt")
    run.add_argument("--rows", type=int, default=32, help="prompts to run")
    run.add_argument(
        "--engine",
        choices=ENGINE_NAMES,
        default="auto",
        help="auto: in-process vLLM when installed, else torch + transformers",
    )
    run.add_argument(
        "--model", help="model directory (default: the scenario's own, else the tiny local model)"
    )
    run.add_argument(
        "--base-url",
        action="append",
        help="OpenAI-compatible server URL for --engine openai (repeatable)",
    )
    run.add_argument("--device", help="for --engine transformers: cpu (default) or cuda")
    run.add_argument("--out", help="write trajectories (JSON lines) to this file")
    run.add_argument("--concurrency", type=int, default=256, help="samples running at once")
    run.add_argument("--timeout", type=float, default=600.0, help="per-sample timeout (s)")
    run.add_argument("--max-tokens", type=int, default=96, help="tokens per turn")
    run.add_argument(
        "--max-response-tokens",
        type=int,
        default=512,
        help="response budget of a whole trajectory (tokens)",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--family", choices=sorted(FAMILIES),
        help="a real model family's tokenizer, template, parsers and stop ids (arith); with "
             "--engine auto the replies are scripted in its format, with transformers/vllm "
             "its tiny random-weight model samples them")
    run.add_argument(
        "--sim-latency", type=float, default=None,
        help="median latency of the simulated engine (s, default 0.05)",
    )
    run.add_argument("--tensorboard", metavar="DIR", help="also log batch metrics to TensorBoard")
    trace = add("trace", help="convert a trajectory dump to a Chrome/Perfetto trace")
    trace.add_argument("file", help="dump (.jsonl) or folder of rotated dumps")
    trace.add_argument("-o", "--out", help="trace file (default: FILE with suffix .trace.json)")
    inspect = add("inspect", help="summarize a dump, list its samples, show one, list failures")
    inspect.add_argument("file", help="dump (.jsonl) or folder of rotated dumps")
    shown = inspect.add_mutually_exclusive_group()
    shown.add_argument("--show", metavar="UID", help="print one trajectory (unique uid prefix)")
    shown.add_argument("--failed", action="store_true", help="failures grouped by error")
    shown.add_argument("--list", action="store_true",
                       help="one line per sample: uid, status, reward (the uids --show takes)")
    inspect.add_argument("--limit", type=int, default=50, metavar="N",
                         help="--list: at most N lines (default 50; 0 for all)")
    dump = add("dump", help="ask a running process for a task dump and print it")
    add_dump_arguments(dump)
    return parser


GLOBAL_DEFAULTS: dict[str, Any] = {"log_level": "warning", "log_format": "kv", "verbose": False}
"""Values of the global options when given neither before nor after the subcommand."""

ENGINE_LOG_DIR_VARIABLE = "ROLLOUT_LOG_DIR"
"""Environment variable: the folder of ``rollout run``'s engine log files (default: a
``rollout`` folder in the system's temporary directory)."""

_TAIL = 20
"""Lines of the engine's log shown when ``rollout run`` fails."""


def engine_log_path() -> Path:
    """A new log file for one ``rollout run``: ``$ROLLOUT_LOG_DIR/run-<time>-<pid>.log``."""
    folder = os.environ.get(ENGINE_LOG_DIR_VARIABLE) or os.path.join(tempfile.gettempdir(),
                                                                       "rollout")
    return Path(folder) / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rollout`` console script."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, format=args.log_format)
    try:
        return _dispatch(args)
    except BrokenPipeError:  # `rollout inspect FILE | head`: the reader left, not an error
        sys.stdout = open(os.devnull, "w")
        return 0


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        scenario = check_run_args(args)
        if args.verbose or scripted(args) or args.engine == "openai":  # no engine output
            return asyncio_run(_run(args, scenario, Console(out=sys.stdout, err=sys.stderr)))
        return _run_quietly(args, scenario)
    if args.command == "trace":
        return trace_command(args.file, args.out)
    if args.command == "inspect":
        if args.limit < 0:
            _refuse("inspect", f"--limit must be >= 0, got {args.limit}")
        return inspect_command(args.file, show=args.show, failed=args.failed,
                               listing=args.list, limit=args.limit or None)
    if args.command == "dump":
        return run_dump(args)
    return 2


def _run_quietly(args: argparse.Namespace, scenario: ModuleType) -> int:
    """``rollout run`` with a local engine: its output (and its processes') into a log file
    named in one line; on a failure, the error and the log's last lines on the terminal."""
    log = engine_log_path()
    try:
        with output_to_file(log) as console:
            print(f"engine log: {log} (--verbose prints it here)", file=console.err)
            configure_logging(args.log_level, format=args.log_format, stream=console.err)
            try:
                return asyncio_run(_run(args, scenario, console))
            except BaseException as exc:
                stopped = isinstance(exc, KeyboardInterrupt) or (
                    isinstance(exc, SystemExit) and exc.code in (0, None))
                if not stopped:
                    _show_tail(log, console)
                raise
    finally:
        configure_logging(args.log_level, format=args.log_format)


def _show_tail(log: Path, console: Console) -> None:
    lines = tail_lines(log, _TAIL)
    if lines:
        print(f"rollout run: failed; the last {len(lines)} lines of {log}:", file=console.err)
        for line in lines:
            print(f"  | {line[:300]}", file=console.err)

