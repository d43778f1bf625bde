"""How one stage runs on one sample: its record, the deadline checked at both of its
boundaries, and the stage list's validation (a bare ``async def f(item, ctx)`` is accepted
and named after itself).

A stage is any object with a ``name`` and ``async def run(item, ctx)`` (:class:`Stage`). An
optional ``async def cleanup(item, ctx)`` runs once per sample for every stage that started,
after the sample ends (however it ends), even when the stage ran many times inside a ``Loop``.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Iterable
from typing import Any

from pipeline import artifacts as A
from pipeline._concurrency.cancel import cancel_requested
from pipeline._data.models import AgentRolloutItem, StageRecord, Status, is_finite_number
from pipeline._exceptions import (
    ConfigError,
    ContractError,
    DeadlineExceeded,
    SampleAborted,
    StageDefinitionError,
    StageTimeout,
)
from pipeline._runner.context import Context, Stage, StageFunction
from pipeline._runner.outcome import capped


class FunctionStage:
    """Adapts a bare ``async def f(item, ctx)`` to the :class:`Stage` protocol: ``run`` is
    the function itself (no wrapping coroutine per stage run)."""

    def __init__(self, fn: StageFunction, name: str | None = None) -> None:
        self.fn = fn
        self.run = fn
        self.name: str = name or str(getattr(fn, "__name__", type(fn).__name__))

    def __repr__(self) -> str:
        return f"FunctionStage({self.name})"


def as_stage(obj: Any, position: int | str = "?") -> Stage:
    """Return ``obj`` as a stage, or raise a clear error naming the position and the object.

    Raises:
        StageDefinitionError: ``obj`` is neither a stage nor an async function (a stage
            class instead of an instance included: the message says what to write).
    """
    if isinstance(obj, type):
        raise StageDefinitionError(
            f"stage {position} is the class {obj.__name__}, not a stage: write "
            f"{obj.__name__}() (an instance) in the stage list"
        )
    run = getattr(obj, "run", None)
    if run is not None and callable(run):
        if not inspect.iscoroutinefunction(run):
            raise StageDefinitionError(
                f"stage {position} ({obj!r}): 'run' must be 'async def run(item, ctx)'"
            )
        if not isinstance(getattr(obj, "name", None), str):
            raise StageDefinitionError(f"stage {position} ({obj!r}) has no string 'name'")
        cleanup = getattr(obj, "cleanup", None)
        if cleanup is not None and not inspect.iscoroutinefunction(cleanup):
            raise StageDefinitionError(
                f"stage {position} ({obj!r}): 'cleanup' must be 'async def cleanup(item, ctx)'"
            )
        return obj  # type: ignore[no-any-return]
    if inspect.iscoroutinefunction(obj) or (
        callable(obj) and inspect.iscoroutinefunction(type(obj).__call__)
    ):
        return FunctionStage(obj)  # type: ignore[return-value]  # run: the async function
    raise StageDefinitionError(
        f"stage {position} ({obj!r}) is not a stage: pass an object with 'name' and "
        f"'async def run(item, ctx)', or an 'async def f(item, ctx)' function"
    )


def as_stages(objs: Iterable[Any], where: str = "") -> list[Stage]:
    """Validate a stage list (see :func:`as_stage`); ``where`` names a nested list in errors
    (``" of Loop 'loop'"``)."""
    if isinstance(objs, str | bytes | type) or not isinstance(objs, Iterable):
        hint = " (one stage? wrap it in a list)" if hasattr(objs, "run") else ""
        raise StageDefinitionError(
            f"stages{where} must be a list of stages, got {type(objs).__name__} "
            f"{objs!r:.80}{hint}")
    stages = [as_stage(obj, f"{i}{where}") for i, obj in enumerate(objs)]
    if not stages:
        raise StageDefinitionError(f"the stage list{where} is empty")
    return stages


def stage_names(stages: Iterable[Any]) -> set[str]:
    """Every stage name in a stage list, nested ones (a ``Loop``'s body, a ``Route``'s
    agents) included."""
    names: set[str] = set()
    for stage in stages:
        names.add(stage.name)
        nested = getattr(stage, "stages", None)
        if isinstance(nested, list):
            names |= stage_names(nested)
        agents = getattr(stage, "agents", None)
        if isinstance(agents, dict):
            for agent in agents.values():
                if isinstance(agent, list):
                    names |= stage_names(agent)
    return names


def check_stage_budgets(stages: list[Stage], budgets: dict[str, float]) -> None:
    """Refuse a ``stage_timeout_s`` entry that names no stage of the list (a typo would
    otherwise leave a stage without the budget its user meant it to have).

    Raises:
        ConfigError: naming the entry and the known stage names.
    """
    if not budgets:
        return
    known = stage_names(stages)
    for name in budgets:
        if name not in known:
            raise ConfigError(f"field 'stage_timeout_s.{name}': no stage is named {name!r}; "
                              f"the stages are {sorted(known)}",
                              field=f"stage_timeout_s.{name}")


def stage_budget(stage: Stage, ctx: Context) -> float | None:
    """The stage's own time budget: its ``stage_timeout_s`` attribute, else the config's
    entry for its name, else None."""
    budget = getattr(stage, "stage_timeout_s", None)
    if budget is None and ctx.config.stage_timeout_s:
        budget = ctx.config.stage_timeout_s.get(stage.name)
    return budget


async def _run_within(stage: Stage, item: AgentRolloutItem, ctx: Context, budget: float,
                      start: float) -> None:
    """Run the stage under its budget, decided by the clock as the sample deadline is: the
    budget's cancellation reaches a stage that awaits, and a stage that returns past it (it
    swallowed the cancellation, or blocked the loop) fails the budget all the same."""
    scope = asyncio.timeout(budget)
    try:
        async with scope:
            await stage.run(item, ctx)
    except TimeoutError as exc:
        if scope.expired():
            raise StageTimeout(stage.name, budget) from exc
        raise
    if time.monotonic() - start > budget:
        raise StageTimeout(stage.name, budget, " (it returned late: it swallowed the "
                           "budget's cancellation or blocked the event loop past it)")


async def run_stage(stage: Stage, item: AgentRolloutItem, ctx: Context) -> None:
    """Run one stage on one sample and append its :class:`StageRecord`.

    Exceptions propagate (the sample runner turns them into a status); the record says how the
    stage ended: ``failed`` on an exception (a ``CancelledError`` nobody asked for included),
    ``timeout`` once the sample's deadline passed, ``aborted`` when cancelled otherwise.
    A stage that leaves a reward that is not a finite number fails here, so the error names
    the stage that wrote it.

    The deadline is decided by the clock at both boundaries: no stage starts once it passed
    (:class:`DeadlineExceeded`, before any record), and a stage that returns after it (it
    swallowed the deadline's cancellation, or blocked the event loop past it) ends ``timeout``
    as if the cancellation had gone through. A stage parked by the loop slice before it began
    has no record and no cleanup: it never ran.

    A stage with a budget (:func:`stage_budget`) is held to it the same way, per run: past
    it the stage is cancelled, or fails when it returns late, with :class:`StageTimeout`
    (its record ends ``timeout``; the sample too, the error naming the stage).

    The sample runner runs a pipeline's top-level stages with the same steps written out in
    its own coroutine (:func:`must_wait_turn`, :func:`start_stage`, :func:`stage_returned`,
    :func:`stage_raised`), so that a sample in flight holds no frame
    of this function; nested stage lists (``Loop``, ``Route``) run through it.
    """
    if must_wait_turn(stage, ctx):
        await ctx.loop_slice.wait_turn(ctx._admission)  # type: ignore[union-attr]  # checked above
    record, call = start_stage(stage, item, ctx)
    try:
        await call
        stage_returned(stage, item, ctx)
    except BaseException as exc:
        stage_raised(record, exc, ctx)
        raise
    finally:
        record.end = time.monotonic()


def must_wait_turn(stage: Stage, ctx: Context) -> bool:
    """Before a stage starts: raises :class:`DeadlineExceeded` once the sample's deadline
    passed; True when the loop slice is spent, so the caller awaits
    ``ctx.loop_slice.wait_turn()`` first (:mod:`pipeline._runner.slice`)."""
    if ctx.deadline is not None and ctx.deadline_passed():
        raise DeadlineExceeded(f"the deadline passed before stage '{stage.name}' started")
    return ctx.loop_slice is not None and ctx.loop_slice.spent(ctx.item)


def start_stage(stage: Stage, item: AgentRolloutItem,
                ctx: Context) -> tuple[StageRecord, Awaitable[None]]:
    """Mark ``stage`` started on the sample and append its record; returns the record and
    what to await to run the stage: its own ``run`` coroutine (no frame around it), or that
    run under the stage's budget."""
    start = ctx.mark_started(stage)
    record = StageRecord(stage.name, start, time.time(), "run", ctx.turn)  # positional: faster
    item.records.append(record)
    try:
        budget = (getattr(stage, "stage_timeout_s", None) if not ctx.config.stage_timeout_s
                  else stage_budget(stage, ctx))  # the common case without a function call
        if budget is None:
            return record, stage.run(item, ctx)
        return record, _run_within(stage, item, ctx, budget, start)
    except BaseException as exc:  # a run that cannot even be called (a wrong signature)
        stage_raised(record, exc, ctx)
        record.end = time.monotonic()
        raise


def stage_returned(stage: Stage, item: AgentRolloutItem, ctx: Context) -> None:
    """The checks once a stage returned: the deadline by the clock, a finite reward."""
    if ctx.deadline is not None and ctx.deadline_passed():
        raise DeadlineExceeded(
            f"stage '{stage.name}' returned after the sample's deadline (it swallowed the "
            "deadline's cancellation or blocked the event loop past it)")
    reward = item.artifacts.get(A.REWARD)
    if reward is not None and not is_finite_number(reward):
        raise ContractError(f"stage '{stage.name}' wrote a reward that is not a finite "
                            f"number: {reward!r}")


def stage_raised(record: StageRecord, exc: BaseException, ctx: Context) -> None:
    """Write on ``record`` how its stage ended when it raised ``exc`` (called in the
    stage's task, inside the ``except`` clause: a bare ``CancelledError`` asks the task
    whether somebody cancelled it)."""
    if isinstance(exc, asyncio.CancelledError):
        if ctx.deadline_passed():
            record.status = Status.TIMEOUT
        elif cancel_requested():
            record.status = Status.ABORTED
        else:
            record.status, record.error_type = Status.FAILED, type(exc).__name__
            record.error_message = "CancelledError raised inside the stage; nobody cancelled it"
    elif isinstance(exc, SampleAborted):
        record.status, record.error_type, record.error_message = (
            Status.ABORTED, type(exc).__name__, capped(str(exc)))
    else:
        # Whatever a stage raised once the deadline passed, the deadline is what ended it.
        record.status = (Status.TIMEOUT if ctx.deadline_passed()
                         or isinstance(exc, StageTimeout) else Status.FAILED)
        record.error_type = type(exc).__name__
        record.error_message = capped(str(exc))
