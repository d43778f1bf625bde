"""User callables: one rule for every function the library takes from its users.

A callable the library accepts has one of three contracts, fixed per field and checked once,
at construction (``check_callable``):

* ``"sync"`` — called from synchronous code and its value used as is (a reward function, a
  score parser, a judger factory, ``fill``). An ``async def`` is refused, naming the field.
* ``"async"`` — awaited (a tool function, a judger's ``judge``, a tool's ``__call__``). A
  plain function is refused, naming the field.
* ``"either"`` — called from the pipeline's own async code (``DynamicSampling.keep``,
  ``on_sample_done``, ``Loop(until=...)``): an ``async def`` is awaited, a plain one called.

"Async" means what :func:`is_async_callable` says: an ``async def`` function or method, a
``functools.partial`` of one, or an object whose ``__call__`` is ``async def``. Generator
functions (sync or async) are refused everywhere: calling one runs nothing.

A callable judged plain that returns an awaitable at run time (``lambda x: some_async(x)``)
is a bug that would otherwise pass silently (a coroutine is truthy, and is never run):
:func:`plain_result` closes the awaitable and raises :class:`ContractError`, which fails the
sample or group that called it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from pipeline._exceptions import ConfigError, ContractError

T = TypeVar("T")

Contract = Literal["sync", "async", "either"]


def _unwrap(fn: Any) -> Any:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def is_async_callable(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine by declaration: an ``async def`` function or
    method, a ``functools.partial`` of one, or an instance whose ``__call__`` is ``async def``
    (a class is not: calling it builds an instance)."""
    fn = _unwrap(fn)
    if inspect.iscoroutinefunction(fn):
        return True
    if not callable(fn) or isinstance(fn, type) or inspect.isroutine(fn):
        return False
    return inspect.iscoroutinefunction(type(fn).__call__)


def _is_generator_callable(fn: Any) -> bool:
    fn = _unwrap(fn)
    if callable(fn) and not (isinstance(fn, type) or inspect.isroutine(fn)):
        fn = type(fn).__call__
    return inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)


def check_callable(fn: Any, field: str, contract: Contract, *, shape: str = "",
                   owner: str = "", error: type[Exception] = ConfigError) -> bool:
    """Refuse ``fn`` unless it is a callable that fits ``contract`` (see the module doc).

    Args:
        fn: the user's callable.
        field: the argument's name, given to the error (``.field`` where it takes one).
        contract: ``"sync"``, ``"async"`` or ``"either"``.
        shape: how it is called, for the message (``"(item, sample) -> None"``).
        owner: what takes it, for the message (``"DynamicSampling"``).
        error: the exception type to raise (default :class:`ConfigError`).

    Returns:
        Whether ``fn`` is async (for an ``"either"`` field: whether to await it).

    Raises:
        error: ``fn`` is not callable, is a generator function, or has the wrong kind.
    """
    where = f"{owner}: field '{field}'" if owner else f"field '{field}'"
    what = f"{fn!r:.80}"
    if not callable(fn):
        _raise(error, f"{where}: must be callable {shape}, got {what}".replace("  ", " "),
               field)
    if _is_generator_callable(fn):
        _raise(error, f"{where}: {what} is a generator function; pass a function that "
               f"returns its value {shape}".rstrip(), field)
    is_async = is_async_callable(fn)
    if contract == "sync" and is_async:
        _raise(error, f"{where}: {what} is async, but it is called synchronously: pass a "
               f"plain 'def' function {shape}".rstrip(), field)
    if contract == "async" and not is_async:
        _raise(error, f"{where}: {what} is not async: pass an 'async def' function (or an "
               f"object with 'async def __call__') {shape}".rstrip(), field)
    return is_async


def _raise(error: type[Exception], message: str, field: str) -> None:
    if issubclass(error, ConfigError):
        raise error(message, field=field)
    raise error(message)


def plain_result(value: T, field: str) -> T:
    """``value`` as returned by a plain (non-async) user callable, refused if it is an
    awaitable: it is closed (a coroutine) or cancelled (a future), so nothing is left never
    awaited, and :class:`ContractError` names ``field``.

    Raises:
        ContractError: ``value`` is awaitable.
    """
    if inspect.isawaitable(value):
        _discard(value)
        raise ContractError(
            f"{field} returned {type(value).__name__}, an awaitable, from a plain function: "
            f"make it 'async def' where awaiting is supported, or return the value itself")
    return value


def _discard(awaitable: Awaitable[Any]) -> None:
    close = getattr(awaitable, "close", None)
    if inspect.iscoroutine(awaitable) or inspect.isgenerator(awaitable):
        awaitable.close()
    elif isinstance(awaitable, asyncio.Future):
        awaitable.cancel()
    elif callable(close):
        close()


async def call_either(fn: Callable[..., Any], is_async: bool, field: str, *args: Any) -> Any:
    """Call an ``"either"`` callable: await it when ``is_async`` (from
    :func:`check_callable`), else call it and check its value with :func:`plain_result`."""
    if is_async:
        return await fn(*args)
    return plain_result(fn(*args), field)
