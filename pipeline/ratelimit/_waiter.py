"""A caller queued on a :class:`~pipeline.ratelimit.FairAsyncTokenBucket`, and how it is woken.

Every queued caller carries its own event loop. The lock-protected :class:`State`, not the
future, decides who owns tokens: a grant resolves the caller's future on its loop (directly,
or through ``call_soon_threadsafe`` from another thread), and a future cancelled meanwhile is
left alone (:func:`settle`); the bucket reads the state to refund or drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Hashable
from dataclasses import dataclass


class State(enum.Enum):
    QUEUED = enum.auto()
    GRANTED = enum.auto()  # tokens issued, caller not resumed yet
    RETURNED = enum.auto()
    REFUNDED = enum.auto()
    DROPPED = enum.auto()  # cancelled or timed out while queued, or woken by aclose()


@dataclass(eq=False, slots=True)
class Waiter:
    key: Hashable
    cost: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    queued_at: float
    state: State = State.QUEUED
    granted_at: float = 0.0  # when the grant was made (bucket clock)
    ideal: float = 0.0  # when it was due: the time it is booked at


def notify(waiter: Waiter, exc: BaseException | None) -> None:
    """Resolve ``waiter``'s future on its own loop: its grant (``exc`` None) or ``exc``."""
    if running_loop() is waiter.loop:
        settle(waiter.future, exc)
        return
    with contextlib.suppress(RuntimeError):  # its loop closed: nobody is left to wake
        waiter.loop.call_soon_threadsafe(settle, waiter.future, exc)


def settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile; the waiter state says who owns the tokens
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
