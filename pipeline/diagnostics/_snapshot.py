"""The snapshot API: every task, every thread and every in-flight sample, as plain data.

:func:`capture_snapshot` may be called from any thread, including a dumper or watchdog thread
while the event loop's thread is blocked. It never raises: a section that cannot be read is
recorded in :attr:`Snapshot.errors` and the rest is still returned. Rendering is separate
(:mod:`pipeline.diagnostics._render`).

Task ages are known for tasks created on a loop that :func:`track_task_ages` was installed on
(``asyncio_run`` does it); other tasks report ``age_s=None``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

from pipeline.diagnostics._frames import (
    FrameInfo,
    describe_wait,
    frames_below,
    iter_list_retrying,
    stack_of,
    walk_await_chain,
)
from pipeline.diagnostics._model import (
    LoopInfo,
    SampleInfo,
    Snapshot,
    TaskInfo,
    TaskState,
    ThreadInfo,
)

_created: weakref.WeakKeyDictionary[asyncio.Future[Any], float] = weakref.WeakKeyDictionary()
_loop_threads: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = (
    weakref.WeakKeyDictionary())


def track_task_ages(loop: asyncio.AbstractEventLoop) -> None:
    """Record each new task's creation time on ``loop`` (wraps any existing task factory).

    Costs about a microsecond per task. Installing twice on one loop is a no-op.
    """
    previous = loop.get_task_factory()
    if getattr(previous, "_records_task_ages", False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        task: asyncio.Future[Any] = (asyncio.Task(coro, loop=loop, **kwargs)
                                     if previous is None else previous(loop, coro, **kwargs))
        _created[task] = time.monotonic()
        return task

    factory._records_task_ages = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


def note_loop_thread(loop: asyncio.AbstractEventLoop, ident: int | None = None) -> None:
    """Remember which thread runs ``loop`` (default: the calling thread), for snapshots.

    uvloop loops do not say which thread runs them; the dumper, the watchdog and
    ``asyncio_run`` call this from the loop's thread.
    """
    _loop_threads[loop] = threading.get_ident() if ident is None else ident


def capture_snapshot(*, reason: str = "manual", loops: Iterable[asyncio.AbstractEventLoop] = (),
                     loop_threads: dict[int, int] | None = None,
                     lags: dict[int, float] | None = None,
                     include_samples: bool = True) -> Snapshot:
    """Take a snapshot of this process's tasks, threads and in-flight samples.

    Safe to call from any thread; never raises.

    Args:
        reason: why the snapshot was taken (shown in the dump).
        loops: loops whose tasks to include; every loop with tasks is found on its own when
            the interpreter allows it, so this matters only as a fallback.
        loop_threads: ``id(loop) -> thread ident`` where known (marks the loop thread).
        lags: ``id(loop) -> seconds`` the loop has not answered a heartbeat (from a watchdog).
        include_samples: include the running pipelines' in-flight samples.

    Returns:
        The :class:`Snapshot`.
    """
    start = time.perf_counter()
    errors: list[str] = []
    loop_threads = dict(loop_threads or {})
    frames: dict[int, Any] = {}
    try:
        frames = sys._current_frames()
    except Exception as exc:
        errors.append(f"threads: {type(exc).__name__}: {exc}")
    tasks_raw: list[asyncio.Task[Any]] = []
    try:
        tasks_raw = _all_tasks(list(loops))
    except Exception as exc:
        errors.append(f"tasks: {type(exc).__name__}: {exc}")
    loop_objs: dict[int, asyncio.AbstractEventLoop] = {id(lp): lp for lp in loops}
    for task in tasks_raw:
        lp = task.get_loop()
        loop_objs.setdefault(id(lp), lp)
    for lid, lp in loop_objs.items():
        ident = _loop_threads.get(lp, getattr(lp, "_thread_id", None))
        if lid not in loop_threads and isinstance(ident, int):
            loop_threads[lid] = ident
    currents = {lid: _current_task(lp) for lid, lp in loop_objs.items()}
    tasks: list[TaskInfo] = []
    now = time.monotonic()
    cache: dict[Any, str] = {}
    for task in tasks_raw:
        try:
            tasks.append(_task_info(task, now, currents, loop_threads, frames, cache))
        except Exception as exc:  # one odd task must not cost the whole dump
            errors.append(f"task {_name(task)}: {type(exc).__name__}: {exc}")
    loops_info = tuple(
        LoopInfo(loop_id=lid, loop_type=f"{type(lp).__module__}.{type(lp).__qualname__}",
                 thread_ident=loop_threads.get(lid), current_task=_name(currents[lid]),
                 lag_s=(lags or {}).get(lid))
        for lid, lp in loop_objs.items())
    samples: tuple[SampleInfo, ...] = ()
    flow: tuple[dict[str, Any], ...] = ()
    if include_samples:
        try:
            samples = _samples({t.sample_uid: t for t in tasks if t.sample_uid})
        except Exception as exc:
            errors.append(f"samples: {type(exc).__name__}: {exc}")
        try:
            flow = _flow()
        except Exception as exc:
            errors.append(f"flow: {type(exc).__name__}: {exc}")
    threads = _threads(frames, set(loop_threads.values()), errors)
    return Snapshot(pid=os.getpid(), reason=reason, taken_at=time.time(),
                    capture_s=time.perf_counter() - start, python=sys.version.split()[0],
                    loops=loops_info, tasks=tuple(tasks), threads=threads,
                    samples=samples, errors=tuple(errors), flow=flow)


def task_infos(tasks: Iterable[asyncio.Task[Any]]) -> tuple[TaskInfo, ...]:
    """:class:`TaskInfo` of each of ``tasks`` (e.g. the ones left running at exit)."""
    tasks = list(tasks)
    now = time.monotonic()
    loops = {id(t.get_loop()): t.get_loop() for t in tasks}
    currents = {lid: _current_task(lp) for lid, lp in loops.items()}
    return tuple(_task_info(t, now, currents, {}, {}, {}) for t in tasks)


def _all_tasks(loops: list[asyncio.AbstractEventLoop]) -> list[asyncio.Task[Any]]:
    """Pending tasks of every loop (copied defensively; another thread may be adding some).

    Python 3.11 keeps every task in one registry (``_all_tasks``), 3.12 and 3.13 in two
    (``_scheduled_tasks`` and ``_eager_tasks``): reading them finds the tasks of loops
    nobody registered. Elsewhere, the tasks of ``loops`` are listed.
    """
    registries = [getattr(asyncio.tasks, name, None)
                  for name in ("_all_tasks", "_scheduled_tasks", "_eager_tasks")]
    found: list[asyncio.Task[Any]] = []
    if any(r is not None for r in registries):
        for registry in registries:
            if registry is not None:
                found.extend(iter_list_retrying(registry))
    else:
        for lp in loops:
            found.extend(iter_list_retrying(asyncio.all_tasks(lp)))
    seen: set[int] = set()
    out = []
    for task in found:
        if not task.done() and id(task) not in seen:
            seen.add(id(task))
            out.append(task)
    return out


def _current_task(loop: asyncio.AbstractEventLoop) -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task(loop)
    except Exception:
        return None


def _name(task: asyncio.Task[Any] | None) -> str | None:
    if task is None:
        return None
    try:
        return task.get_name()
    except Exception:
        return repr(task)


def _task_info(task: asyncio.Task[Any], now: float,
               currents: dict[int, asyncio.Task[Any] | None], loop_threads: dict[int, int],
               frames: dict[int, Any], cache: dict[Any, str]) -> TaskInfo:
    loop_id = id(task.get_loop())
    name = _name(task) or "?"
    running = currents.get(loop_id) is task
    state: TaskState = ("running" if running
                        else "cancelling" if task.cancelling() else "pending")
    chain = walk_await_chain(task.get_coro())
    blocking: tuple[FrameInfo, ...] = ()
    if running and chain.frame_objects and loop_id in loop_threads:
        blocking = frames_below(frames.get(loop_threads[loop_id]), chain.frame_objects[-1])
    created = _created.get(task)
    return TaskInfo(
        name=name, state=state, age_s=None if created is None else now - created,
        chain=chain.frames, awaiting=None if running else describe_wait(chain, cache),
        blocking=blocking, sample_uid=name[7:] if name.startswith("sample:") else None,
        loop_id=loop_id)


def _samples(by_uid: dict[str | None, TaskInfo]) -> tuple[SampleInfo, ...]:
    from pipeline._runner.pipeline import running_pipelines  # the core imports diagnostics

    out: list[SampleInfo] = []
    pipes: list[Any] = []
    for attempt in range(100):  # its WeakSet may change under us: retry like all_tasks()
        try:
            pipes = running_pipelines()
            break
        except RuntimeError:
            if attempt == 99:
                raise
    for index, pipe in enumerate(pipes):
        stuck_s = pipe.config.stuck_stage_s
        for sample in pipe.inflight():
            task = by_uid.get(sample.uid)
            location = None if task is None else task.location
            out.append(SampleInfo(
                uid=sample.uid, group_id=sample.group_id, stage=sample.stage, turn=sample.turn,
                running_s=sample.running_s, in_stage_s=sample.in_stage_s, pipeline=index,
                task_state=None if task is None else task.state,
                awaiting=None if task is None else task.awaiting, location=location,
                stuck=(stuck_s is not None and sample.in_stage_s is not None
                       and sample.in_stage_s > stuck_s)))
    out.sort(key=lambda s: -(s.in_stage_s if s.in_stage_s is not None else s.running_s))
    return tuple(out)


def _flow() -> tuple[dict[str, Any], ...]:
    from pipeline._runner.pipeline import running_pipelines  # the core imports diagnostics

    states = [(index, pipe.flow_state()) for index, pipe in enumerate(running_pipelines())]
    return tuple({"pipeline": index, **state} for index, state in states if state is not None)


def _threads(frames: dict[int, Any], loop_idents: set[int],
             errors: list[str]) -> tuple[ThreadInfo, ...]:
    known = {}
    try:
        known = {t.ident: t for t in threading.enumerate()}
    except Exception as exc:
        errors.append(f"thread names: {type(exc).__name__}: {exc}")
    out = []
    for ident, frame in frames.items():
        thread = known.get(ident)
        out.append(ThreadInfo(
            ident=ident, name=thread.name if thread is not None else f"thread-{ident}",
            daemon=bool(thread is not None and thread.daemon),
            is_loop_thread=ident in loop_idents,
            stack=stack_of(frame)))
    out.sort(key=lambda t: (not t.is_loop_thread, t.ident != threading.main_thread().ident))
    return tuple(out)
