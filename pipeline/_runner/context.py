"""What a stage receives: the pipeline's shared resources and per-sample facts."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import structlog

from pipeline._concurrency.cancel import abort_request
from pipeline._data.config import PipelineConfig, SamplingParams
from pipeline._data.models import AgentRolloutItem, StageRecord, Status
from pipeline._exceptions import ConfigError
from pipeline._runner.slice import LoopSlice
from pipeline._text.tokenizer import Tokenizer
from pipeline.engines import Engine, SimulatedEngine
from pipeline.ratelimit import LimiterRegistry
from pipeline.tools import Tool, make_registry

_logger = structlog.get_logger("pipeline")


@dataclass(kw_only=True)
class Resources:
    """Shared resources a pipeline is built with; every sample's context points at them.

    Attributes:
        engine: the inference engine.
        tokenizer: used by prompt building and decoding.
        tools: tool name -> tool, for tool-calling stages.
        judgers: judgers for the judging stage.
        limiters: the rate-limiter registry; each pipeline gets its own unless one is passed
            (share one registry between pipelines that must share limits).
        extras: anything else custom stages need (a sandbox pool, an HTTP session, ...).
    """

    engine: Engine | None = None
    tokenizer: Tokenizer | None = None
    tools: Mapping[str, Any] = field(default_factory=dict)
    judgers: Sequence[Any] = ()
    limiters: LimiterRegistry = field(default_factory=LimiterRegistry)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse wrong resources now, not in every sample later (see :func:`check_resources`).

        ``tools`` may be given as a list of tools: the registry is built from it.
        """
        if not isinstance(self.tools, Mapping | str | bytes) and isinstance(self.tools, Iterable):
            self.tools = make_registry(_as_tools(self.tools))
        check_resources(self)


def _refuse_class(name: str, value: Any) -> None:
    if isinstance(value, type):
        raise ConfigError(f"{name}={value.__name__} is a class, not an instance: write "
                          f"{name}={value.__name__}(...)", field=name)


def _as_tools(tools: Iterable[Any]) -> list[Any]:
    tools = list(tools)
    for i, tool in enumerate(tools):
        _check_tool(f"tools[{i}]", tool)
    return tools


def _check_tool(where: str, tool: Any) -> None:
    _refuse_class(where, tool)
    if isinstance(tool, Tool):
        return
    if callable(tool) and not hasattr(tool, "name"):
        name = getattr(tool, "__name__", type(tool).__name__)
        raise ConfigError(f"{where} is {name}, a function, not a tool (a function that makes "
                          f"one? call it: {name}())", field=where)
    raise ConfigError(f"{where}={tool!r:.60} is not a tool: it needs name, description, "
                      "parameters, timeout_s and 'async __call__(arguments)'", field=where)


def check_resources(resources: Resources) -> None:
    """Check each resource's type and protocol, so a wrong one fails at construction.

    A :class:`SimulatedEngine` built without ``eos_token_id`` takes the tokenizer's eos here;
    one whose eos differs from the tokenizer's is refused (its replies would never stop). Every
    entry point that pairs an engine with a tokenizer runs this check by building
    :class:`Resources` (``Pipeline``, ``ProxyServer``, ``make_engine``).

    Raises:
        ConfigError: naming the resource (``engine``, ``tokenizer``, ``tools[...]``, ...)
            and what to write instead.
    """
    engine, tokenizer = resources.engine, resources.tokenizer
    if engine is not None:
        _refuse_class("engine", engine)
        if isinstance(engine, str):
            raise ConfigError(f"engine={engine!r} is a name, not an engine: build one with "
                              f"'engine, tokenizer = await make_engine({engine!r}, "
                              "model_dir=...)'", field="engine")
        if inspect.iscoroutine(engine):
            engine.close()
            raise ConfigError("engine is a coroutine: make_engine(...) must be awaited "
                              "('await make_engine(...)')", field="engine")
        if not inspect.iscoroutinefunction(getattr(engine, "generate", None)):
            raise ConfigError(f"engine={type(engine).__name__} is not an engine: it needs "
                              "'async def generate(prompt_ids, sampling, request_id)'",
                              field="engine")
    if tokenizer is not None:
        _refuse_class("tokenizer", tokenizer)
        if isinstance(tokenizer, str | os.PathLike):
            raise ConfigError(f"tokenizer={str(tokenizer)!r} is a name or path, not a "
                              "tokenizer: load it, e.g. AutoTokenizer.from_pretrained(...)",
                              field="tokenizer")
        missing = [m for m in ("encode", "decode", "apply_chat_template")
                   if not callable(getattr(tokenizer, m, None))]
        if missing:
            raise ConfigError(f"tokenizer={type(tokenizer).__name__} is not a tokenizer: it "
                              f"lacks {', '.join(missing)}", field="tokenizer")
    if not isinstance(resources.tools, Mapping):
        hint = " (one tool? wrap it in a list)" if isinstance(resources.tools, Tool) else ""
        raise ConfigError(f"tools must be a list of tools or a dict name -> tool, got "
                          f"{type(resources.tools).__name__}{hint}", field="tools")
    for name, tool in resources.tools.items():
        _check_tool(f"tools[{name!r}]", tool)
    if isinstance(resources.judgers, str | bytes | Mapping) or not isinstance(
            resources.judgers, Sequence):
        raise ConfigError(f"judgers must be a list, got {type(resources.judgers).__name__}",
                          field="judgers")
    for i, judger in enumerate(resources.judgers):
        _refuse_class(f"judgers[{i}]", judger)
    if not isinstance(resources.limiters, LimiterRegistry):
        raise ConfigError(f"limiters must be a LimiterRegistry, got "
                          f"{type(resources.limiters).__name__}", field="limiters")
    if not isinstance(resources.extras, dict):
        raise ConfigError(f"extras must be a dict, got {type(resources.extras).__name__}",
                          field="extras")
    if engine is not None and tokenizer is not None:
        _match_eos(engine, tokenizer)


def _match_eos(engine: Any, tokenizer: Any) -> None:
    """Pair a :class:`SimulatedEngine` (also one inside a wrapper that holds its engine in
    ``.engine``, as test recorders do) with the tokenizer's eos."""
    for _ in range(8):  # a bounded walk down wrappers
        if isinstance(engine, SimulatedEngine):
            break
        engine = vars(engine).get("engine") if hasattr(engine, "__dict__") else None
        if engine is None:
            return
    else:
        return
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        return
    if engine.eos_token_id is None:
        engine.eos_token_id = eos
    elif engine.eos_token_id != eos:
        raise ConfigError(f"SimulatedEngine(eos_token_id={engine.eos_token_id}) differs from "
                          f"the tokenizer's eos ({eos}): generations would not stop where the "
                          f"tokenizer ends a turn; leave eos_token_id out (it then takes the "
                          f"tokenizer's) or pass {eos}", field="engine.eos_token_id")


@runtime_checkable
class Stage(Protocol):
    """One step of a rollout. Write artifacts on ``item``; raise to fail the sample."""

    name: str

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        """Do the stage's work on one sample."""
        ...


StageFunction = Callable[[AgentRolloutItem, "Context"], Awaitable[None]]
"""A bare ``async def f(item, ctx)`` stage."""


class Context:
    """Per-sample context handed to every stage: resources plus the sample's own facts.

    Attributes:
        resources: the pipeline's shared :class:`Resources`.
        config: the pipeline's :class:`PipelineConfig`.
        item: the sample being run.
        deadline: event-loop time when the sample times out, or None.
        exit_stack: closed once when the sample ends (after stage cleanups); put resources
            that must live as long as the sample here (a sandbox, a proxy session).
        stage: name of the stage running now.
        stage_started: monotonic time the current stage started.
        turn: the current ``Loop`` turn (0-based), or None outside loops.
        loop_slice: the event loop's slice clock the runner yields by (set by the runner;
            None where the context is not run by a pipeline).
        timed_out: set when the runner's deadline timer fired for this sample (it then
            cancels the sample's task).
    """

    __slots__ = (
        "_admission",
        "_cleanups",
        "_exit_stack",
        "abort_requested",
        "config",
        "deadline",
        "item",
        "loop_slice",
        "resources",
        "stage",
        "stage_started",
        "timed_out",
        "turn",
    )

    def __init__(
        self,
        resources: Resources,
        config: PipelineConfig,
        item: AgentRolloutItem,
        deadline: float | None = None,
    ) -> None:
        self.resources = resources
        self.config = config
        self.item = item
        self.deadline = deadline
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self.stage: str | None = None
        self.stage_started: float | None = None
        self.turn: int | None = None
        self.abort_requested = False
        self._cleanups: dict[int, Stage] | None = None
        """Started stages that have a ``cleanup``, made at the first: most samples run none,
        and an empty dict per sample would be one more object for the collector to walk."""
        self.loop_slice: LoopSlice | None = None
        self._admission = 0
        """The sample's admission number on ``loop_slice`` (:meth:`LoopSlice.admit`): parked
        samples go lowest first."""
        self.timed_out = False

    @property
    def exit_stack(self) -> contextlib.AsyncExitStack:
        """Closed once when the sample ends, after stage cleanups (created on first use)."""
        if self._exit_stack is None:
            self._exit_stack = contextlib.AsyncExitStack()
        return self._exit_stack

    @property
    def has_exit_stack(self) -> bool:
        """Whether a stage used the exit stack (so there is something to close)."""
        return self._exit_stack is not None

    @property
    def engine(self) -> Engine:
        """The engine; raises a clear error when the pipeline has none."""
        if self.resources.engine is None:
            raise RuntimeError(f"stage {self.stage!r} needs an engine but the pipeline has none")
        return self.resources.engine

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer; raises a clear error when the pipeline has none."""
        if self.resources.tokenizer is None:
            raise RuntimeError(f"stage {self.stage!r} needs a tokenizer but the pipeline has none")
        return self.resources.tokenizer

    @property
    def sampling(self) -> SamplingParams:
        """The sample's effective sampling parameters."""
        return self.item.sampling

    @property
    def log(self) -> Any:
        """A structlog logger bound to the sample's uid, group and current stage."""
        return _logger.bind(uid=self.item.uid, group_id=self.item.group_id, stage=self.stage)

    def time_left(self) -> float | None:
        """Seconds until the sample's deadline (may be negative), or None without one."""
        if self.deadline is None:
            return None
        return self.deadline - asyncio.get_running_loop().time()

    def deadline_passed(self) -> bool:
        """Whether the sample's deadline has passed (or its deadline timer fired)."""
        if self.timed_out:
            return True
        deadline = self.deadline  # time_left() inlined: this runs twice per stage run
        return deadline is not None and asyncio.get_running_loop().time() >= deadline

    def mark_started(self, stage: Stage) -> float:
        """Note that ``stage`` ran on this sample, so its cleanup runs once at the end;
        returns the ``time.monotonic()`` it started at."""
        if getattr(stage, "cleanup", None) is not None:
            if self._cleanups is None:
                self._cleanups = {}
            self._cleanups.setdefault(id(stage), stage)
        self.stage = stage.name
        self.stage_started = now = time.monotonic()
        return now

    async def abort_engine_request(self, request_id: str) -> None:
        """Abort ``request_id`` on the engine from a cancellation path (timeout, abort).

        Bounded by ``cleanup_timeout_s`` and shielded; a failure is logged and recorded as an
        ``engine_abort`` cleanup record on the item, never raised, so it cannot replace how
        the sample ends.
        """
        start, start_wall = time.monotonic(), time.time()
        error = await abort_request(self.engine, request_id, self.config.cleanup_timeout_s,
                                    uid=self.item.uid, stage=self.stage)
        if error is not None:
            self.item.records.append(StageRecord(
                name=f"{self.stage}:engine_abort", phase="cleanup", turn=self.turn,
                start=start, end=time.monotonic(), start_wall=start_wall,
                status=Status.FAILED, error_type="EngineAbortError", error_message=error))

    @property
    def cleanup_stages(self) -> list[Stage]:
        """Stages with a ``cleanup`` that started on this sample, in first-start order."""
        return [] if self._cleanups is None else list(self._cleanups.values())
