"""Walking await chains and thread stacks into plain data, safely from any thread.

Everything here only reads: ``cr_await``/``gi_yieldfrom``/``ag_await`` links, code objects and
line numbers. Each attribute read is atomic under the GIL, so a chain read while the loop
thread runs may be stale by a step but never crashes; a frame that finishes under us reads
as ``None`` and ends the walk. ``f_locals`` (used only to describe what a suspended coroutine
waits on) is read only from suspended frames.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_MAX_CHAIN = 64
_MAX_STACK = 80
_REPR_LIMIT = 160

# Objects that wrap an awaitable without exposing it as an attribute: an async generator's
# ``asend``/``athrow`` awaitables and the C ``Future.__await__`` iterator.
_WRAPPER_NAMES = frozenset({"async_generator_asend", "async_generator_athrow", "FutureIter"})


@dataclass(frozen=True, slots=True)
class FrameInfo:
    """One frame: where a coroutine is suspended, or a thread's stack entry."""

    filename: str
    lineno: int
    name: str

    def __str__(self) -> str:
        return f"{short_path(self.filename)}:{self.lineno} in {self.name}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"file": self.filename, "line": self.lineno, "name": self.name}


_frame_cache: dict[tuple[types.CodeType, int], FrameInfo] = {}

HIDDEN_CODES: set[types.CodeType] = set()
"""Code of diagnostics' own signal handler: left out of stacks (it is not what the thread
was doing when the signal came)."""


def frame_info(frame: types.FrameType) -> FrameInfo:
    """A :class:`FrameInfo` for ``frame``; equal frames share one object (cheap grouping)."""
    code = frame.f_code
    lineno = frame.f_lineno or code.co_firstlineno
    key = (code, lineno)
    info = _frame_cache.get(key)
    if info is None:
        info = FrameInfo(code.co_filename, lineno, code.co_qualname)
        if len(_frame_cache) > 50_000:
            _frame_cache.clear()
        _frame_cache[key] = info
    return info


def short_path(filename: str) -> str:
    """``filename`` relative to the longest ``sys.path`` entry (or cwd) that contains it."""
    best = ""
    for entry in (*sys.path, os.getcwd()):
        if entry and filename.startswith(entry) and len(entry) > len(best):
            best = entry
    if not best:
        return filename
    return filename[len(best):].lstrip(os.sep) or filename


@dataclass(frozen=True, slots=True)
class AwaitChain:
    """What walking one awaitable's chain found.

    Attributes:
        frames: coroutine/generator frames, outermost first.
        frame_objects: the live frames behind ``frames`` (not rendered; used to match the
            running task's innermost frame in its thread's stack).
        leaf: the innermost object that is not a coroutine or generator (usually a Future),
            or None.
        suspended: whether the innermost coroutine is suspended (not running right now).
    """

    frames: tuple[FrameInfo, ...]
    frame_objects: tuple[types.FrameType, ...]
    leaf: Any
    suspended: bool


def walk_await_chain(awaitable: Any) -> AwaitChain:
    """Follow ``cr_await``/``gi_yieldfrom``/``ag_await`` from ``awaitable`` to what it waits on.

    Async generator ``asend``/``athrow`` objects and C future iterators expose no attribute for
    what they wrap; their referent (``gc.get_referents``) is followed instead.
    """
    frames: list[FrameInfo] = []
    objects: list[types.FrameType] = []
    suspended = True
    current = awaitable
    for _ in range(_MAX_CHAIN):
        kind = type(current)
        if kind is _Coroutine:
            frame, nxt, running = current.cr_frame, current.cr_await, current.cr_running
        elif kind is _Generator:
            frame, nxt, running = current.gi_frame, current.gi_yieldfrom, current.gi_running
        elif kind is _AsyncGenerator:
            frame, nxt, running = current.ag_frame, current.ag_await, current.ag_running
        elif kind.__name__ in _WRAPPER_NAMES:
            current = next((r for r in gc.get_referents(current) if _is_awaitable_link(r)), None)
            continue
        elif current is None:
            return AwaitChain(tuple(frames), tuple(objects), None, suspended)
        elif hasattr(current, "cr_await"):  # e.g. Cython coroutines
            frame, nxt = getattr(current, "cr_frame", None), current.cr_await
            running = getattr(current, "cr_running", False)
        else:  # a Future, a Task or another awaitable: what the chain waits on
            return AwaitChain(tuple(frames), tuple(objects), current, suspended)
        if frame is not None:
            frames.append(frame_info(frame))
            objects.append(frame)
            suspended = not running
        current = nxt
    return AwaitChain(tuple(frames), tuple(objects), current, suspended)


_Coroutine = types.CoroutineType
_Generator = types.GeneratorType
_AsyncGenerator = types.AsyncGeneratorType
_MISSING = object()


def _is_awaitable_link(obj: Any) -> bool:
    return isinstance(obj, types.CoroutineType | types.GeneratorType | types.AsyncGeneratorType
                      | asyncio.Future) or hasattr(obj, "cr_await")


def describe_wait(chain: AwaitChain, cache: dict[Any, str] | None = None) -> str | None:
    """A one-line answer to "awaiting what?" for a suspended chain.

    The innermost coroutine call with its receiver or arguments
    (``Event.wait() on <asyncio.locks.Event ... [unset]>``, ``sleep(delay=30)``), then the leaf
    (``Future pending``, ``task 'sample:...'``, ``gather of 3``). ``cache`` (one per
    snapshot) keeps the text of receivers seen before: many tasks wait on one object.
    """
    if not chain.frames:
        return describe_leaf(chain.leaf)
    parts = []
    if chain.suspended:
        parts.append(_describe_call(chain.frame_objects[-1], {} if cache is None else cache))
    leaf = describe_leaf(chain.leaf)
    if leaf is not None:
        parts.append(f"-> {leaf}")
    return " ".join(p for p in parts if p) or None


def _describe_call(frame: types.FrameType, cache: dict[Any, str]) -> str:
    code = frame.f_code
    try:
        local = frame.f_locals
    except Exception:  # an exotic frame; the name alone still helps
        return f"{code.co_qualname}()"
    receiver = local.get("self", _MISSING)
    if receiver is not _MISSING and code.co_argcount >= 1 and code.co_varnames[0] == "self":
        key = (code, id(receiver))
        text = cache.get(key)
        if text is None:
            text = cache[key] = f"{code.co_qualname}() on {safe_repr(receiver)}"
        return text
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    args = ", ".join(f"{n}={safe_repr(local[n], 40)}" for n in names if n in local)
    return f"{code.co_qualname}({args})"


def describe_leaf(leaf: Any) -> str | None:
    """Short description of what the innermost coroutine awaits (a future, a task, ...)."""
    if leaf is None:
        return None
    if isinstance(leaf, asyncio.Task):
        return f"task {leaf.get_name()!r}"
    if isinstance(leaf, asyncio.Future):
        children = getattr(leaf, "_children", None)
        state = "done" if leaf.done() else "pending"
        if isinstance(children, list):
            left = sum(1 for c in children if not c.done())
            return f"gather of {len(children)} ({left} pending)"
        return f"{type(leaf).__name__} {state}"
    return f"{type(leaf).__qualname__} object"


def safe_repr(obj: Any, limit: int = _REPR_LIMIT) -> str:
    """``repr(obj)`` cut to ``limit`` characters; never raises."""
    try:
        text = repr(obj)
    except Exception as exc:
        text = f"<{type(obj).__qualname__} (repr failed: {type(exc).__name__})>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def stack_of(frame: types.FrameType | None, limit: int = _MAX_STACK) -> tuple[FrameInfo, ...]:
    """The stack ending at ``frame``, outermost first (at most ``limit`` innermost frames)."""
    out: list[FrameInfo] = []
    while frame is not None and len(out) < limit:
        if frame.f_code not in HIDDEN_CODES:
            out.append(frame_info(frame))
        frame = frame.f_back
    out.reverse()
    return tuple(out)


def frames_below(thread_frame: types.FrameType | None,
                 anchor: types.FrameType) -> tuple[FrameInfo, ...]:
    """The frames a thread runs inside ``anchor`` (what a running coroutine is blocked in).

    Returns the thread's stack from just below ``anchor`` to its innermost frame, or ``()``
    when ``anchor`` is not on the thread's stack.
    """
    inner: list[types.FrameType] = []
    frame = thread_frame
    for _ in range(_MAX_STACK * 4):
        if frame is None:
            return ()
        if frame is anchor:
            return tuple(frame_info(f) for f in reversed(inner[-_MAX_STACK:]))
        if frame.f_code not in HIDDEN_CODES:
            inner.append(frame)
        frame = frame.f_back
    return ()


def iter_list_retrying(collection: Any, attempts: int = 100) -> Iterator[Any]:
    """Copy a collection another thread may be changing, retrying on a concurrent change."""
    for attempt in range(attempts):
        try:
            items = list(collection)
        except RuntimeError:  # "Set changed size during iteration" and the like
            if attempt == attempts - 1:
                raise
            continue
        return iter(items)
    return iter(())
