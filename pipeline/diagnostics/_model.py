"""The snapshot's data: plain frozen records, rendered by :mod:`pipeline.diagnostics._render`.

They are dataclasses rather than pydantic models on purpose: a snapshot is built from a
signal-woken thread, possibly for 10,000 tasks, and must stay cheap; ``to_dict`` /
:func:`~pipeline.diagnostics._render.snapshot_to_dict` give the JSON wire form.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.diagnostics._frames import FrameInfo

_STDLIB = sysconfig.get_paths()["stdlib"]

TaskState = Literal["pending", "running", "cancelling"]


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
        return user_frame(self.chain + self.blocking)

    @property
    def group_key(self) -> tuple[Any, ...]:
        """Tasks with equal keys are "the same stuck thing" and print as one line."""
        return (self.state, self.chain, self.blocking)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (frames written out in full)."""
        return {"name": self.name, "state": self.state, "age_s": round_or_none(self.age_s),
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
    stuck: bool = False
    """In its current stage longer than its pipeline's ``stuck_stage_s``."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"uid": self.uid, "group_id": self.group_id, "stage": self.stage,
                "stuck": self.stuck,
                "turn": self.turn, "running_s": round_or_none(self.running_s),
                "in_stage_s": round_or_none(self.in_stage_s), "pipeline": self.pipeline,
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
    flow: tuple[dict[str, Any], ...] = field(default=())
    """Each running pipeline's flow control (``Pipeline.flow_state()``): concurrency limit,
    admitted samples, the adaptive controller (bounds, decision, the engine's figures, the
    last change and why), the circuit breaker and each server's health (``servers``)."""

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


def user_frame(frames: tuple[FrameInfo, ...]) -> FrameInfo | None:
    """The innermost frame outside the standard library (where user code waits), else the
    innermost frame."""
    for frame in reversed(frames):
        if not frame.filename.startswith(_STDLIB):
            return frame
    return frames[-1] if frames else None


def round_or_none(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
