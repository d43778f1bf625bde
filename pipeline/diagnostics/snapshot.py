"""The snapshot API: every task, every thread and every in-flight sample, as plain data.

:func:`capture_snapshot` may be called from any thread, including a dumper or watchdog thread
while the event loop's thread is blocked. It never raises: a section that cannot be read is
recorded in :attr:`Snapshot.errors` and the rest is still returned. Rendering is separate
(:mod:`pipeline.diagnostics.render`).

Task ages are known for tasks created on a loop that :func:`track_task_ages` was installed on
(``asyncio_run`` does it); other tasks report ``age_s=None``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.diagnostics._frames import (
    FrameInfo,
    describe_wait,
    frames_below,
    iter_list_retrying,
    stack_of,
    walk_await_chain,
)

_STDLIB = sysconfig.get_paths()["stdlib"]

TaskState = Literal["pending", "running", "cancelling"]

_created: weakref.WeakKeyDictionary[asyncio.Future[Any], float] = weakref.WeakKeyDictionary()
_loop_threads: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """One asyncio task.

    Attributes:
        name: the task's name (``sample:<uid>`` for pipeline samples).
        state: ``running`` (it is the loop's current task: if the loop is blocked, this task
            blocks it), ``cancelling`` (cancel requested) or ``pending``.
        age_s: seconds since the task was created, when known.
        chain: the await chain, outermost coroutine frame first.
        awaiting: what the innermost coroutine waits on, in words.
        blocking: for the running task, the synchronous frames it is executing below its
            innermost coroutine (the code that holds the loop), innermost last.
        sample_uid: the pipeline sample this task runs, if any.
        loop_id: ``id()`` of the task's event loop.
    """

    name: str
    state: TaskState
    age_s: float | None
    chain: tuple[FrameInfo, ...]
    awaiting: str | None
    blocking: tuple[FrameInfo, ...]
    sample_uid: str | None
    loop_id: int

    @property
    def location(self) -> FrameInfo | None:
        """Where the task is, in user code: its innermost frame outside the standard library
        (else its innermost frame)."""
        return _user_frame(self.chain + self.blocking)

    @property
    def group_key(self) -> tuple[Any, ...]:
        """Tasks with equal keys are "the same stuck thing" and print as one line."""
        return (self.state, self.chain, self.blocking)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (frames written out in full)."""
        return {"name": self.name, "state": self.state, "age_s": _round(self.age_s),
                "chain": [f.to_dict() for f in self.chain], "awaiting": self.awaiting,
                "blocking": [f.to_dict() for f in self.blocking],
                "sample_uid": self.sample_uid, "loop_id": self.loop_id}


@dataclass(frozen=True, slots=True)
class TaskGroupInfo:
    """Tasks sharing one await chain and state, counted (10,000 stuck tasks read as one).

    Attributes:
        count: how many tasks.
        state / chain / blocking: shared by every member.
        awaiting: what the first member waits on (members may wait on different objects
            of the same kind).
        names: every member's name, oldest first when ages are known.
        age_min_s / age_max_s: the youngest and oldest member's age, when known.
    """

    count: int
    state: TaskState
    chain: tuple[FrameInfo, ...]
    blocking: tuple[FrameInfo, ...]
    awaiting: str | None
    names: tuple[str, ...]
    age_min_s: float | None
    age_max_s: float | None


@dataclass(frozen=True, slots=True)
class ThreadInfo:
    """One thread and its Python stack (outermost first)."""

    ident: int
    name: str
    daemon: bool
    is_loop_thread: bool
    stack: tuple[FrameInfo, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"ident": self.ident, "name": self.name, "daemon": self.daemon,
                "is_loop_thread": self.is_loop_thread,
                "stack": [f.to_dict() for f in self.stack]}


@dataclass(frozen=True, slots=True)
class SampleInfo:
    """An in-flight pipeline sample: where it is, for how long, and what it waits on."""

    uid: str
    group_id: str
    stage: str | None
    turn: int | None
    running_s: float
    in_stage_s: float | None
    pipeline: int
    task_state: TaskState | None
    awaiting: str | None
    location: FrameInfo | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"uid": self.uid, "group_id": self.group_id, "stage": self.stage,
                "turn": self.turn, "running_s": _round(self.running_s),
                "in_stage_s": _round(self.in_stage_s), "pipeline": self.pipeline,
                "task_state": self.task_state, "awaiting": self.awaiting,
                "location": None if self.location is None else self.location.to_dict()}


@dataclass(frozen=True, slots=True)
class LoopInfo:
    """An event loop that has tasks, and what diagnostics know about its thread."""

    loop_id: int
    loop_type: str
    thread_ident: int | None
    current_task: str | None
    lag_s: float | None
    """How long the loop has not answered the watchdog's heartbeat (when a watchdog runs)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a dump shows, as data. Render with :func:`render_text`/:func:`render_json`."""

    pid: int
    reason: str
    taken_at: float
    """Unix time of the snapshot."""
    capture_s: float
    python: str
    loops: tuple[LoopInfo, ...]
    tasks: tuple[TaskInfo, ...]
    threads: tuple[ThreadInfo, ...]
    samples: tuple[SampleInfo, ...]
    errors: tuple[str, ...] = field(default=())

    def task_groups(self) -> list[TaskGroupInfo]:
        """Tasks grouped by (state, await chain), largest group first."""
        buckets: dict[tuple[Any, ...], list[TaskInfo]] = {}
        for task in self.tasks:
            buckets.setdefault(task.group_key, []).append(task)
        groups = []
        for members in buckets.values():
            members.sort(key=lambda t: -(t.age_s or 0.0))
            ages = [t.age_s for t in members if t.age_s is not None]
            first = members[0]
            groups.append(TaskGroupInfo(
                count=len(members), state=first.state, chain=first.chain,
                blocking=first.blocking, awaiting=first.awaiting,
                names=tuple(t.name for t in members), age_min_s=min(ages) if ages else None,
                age_max_s=max(ages) if ages else None))
        order = {"running": 0, "cancelling": 1, "pending": 2}
        groups.sort(key=lambda g: (order[g.state], -g.count, -(g.age_max_s or 0.0)))
        return groups


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
    if include_samples:
        try:
            samples = _samples({t.sample_uid: t for t in tasks if t.sample_uid})
        except Exception as exc:
            errors.append(f"samples: {type(exc).__name__}: {exc}")
    threads = _threads(frames, set(loop_threads.values()), errors)
    return Snapshot(pid=os.getpid(), reason=reason, taken_at=time.time(),
                    capture_s=time.perf_counter() - start, python=sys.version.split()[0],
                    loops=loops_info, tasks=tuple(tasks), threads=threads,
                    samples=samples, errors=tuple(errors))


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
    from pipeline._pipeline import running_pipelines  # the core imports diagnostics

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
        for sample in pipe.inflight():
            task = by_uid.get(sample.uid)
            location = None if task is None else task.location
            out.append(SampleInfo(
                uid=sample.uid, group_id=sample.group_id, stage=sample.stage, turn=sample.turn,
                running_s=sample.running_s, in_stage_s=sample.in_stage_s, pipeline=index,
                task_state=None if task is None else task.state,
                awaiting=None if task is None else task.awaiting, location=location))
    out.sort(key=lambda s: -(s.in_stage_s if s.in_stage_s is not None else s.running_s))
    return tuple(out)


def _user_frame(frames: tuple[FrameInfo, ...]) -> FrameInfo | None:
    """The innermost frame outside the standard library (where user code waits), else the
    innermost frame."""
    for frame in reversed(frames):
        if not frame.filename.startswith(_STDLIB):
            return frame
    return frames[-1] if frames else None


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


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
