"""The in-process vLLM engine's core watched and restarted: :class:`CoreWatch`.

vLLM's V1 ``AsyncLLM`` runs its engine core in a process of its own. When that process dies
(killed, out of memory, a crash in a kernel), vLLM's own monitor thread marks the client dead
(``AsyncLLM.errored``), every request in flight raises ``EngineDeadError`` and every later one
too: the engine is gone until someone builds a new one. The watch is the one owner of that
fact and of the cure:

- a watch task looks at the core every ``interval_s`` (``errored``: the process alive and its
  output handler running), so an idle engine is restarted before the next batch needs it; a
  request that fails on a dead core reports it at once (:meth:`CoreWatch.recovered`);
- one restart task at a time, whoever noticed first: every request that failed on the same
  core waits for that task (shielded: a waiter cancelled by its sample's deadline does not
  cancel the restart), then is sent once more on the new core;
- at most ``max_restarts`` restarts in the engine's life (``restart=False``: none); after
  that, or when a restart fails, the engine is dead for good and every request fails with a
  readable :class:`~pipeline.EngineError` naming the engine and why.

The restart itself (shut the dead engine down, start a new one with the same arguments,
load the current weights and check the policy version) is the engine's ``replace`` callable;
``aclose`` waits through a restart in progress, so no half-started engine is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from pipeline._concurrency.cancel import wait_through_cancellation
from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._vllm_compat import close_zmq_context

_logger = structlog.get_logger("pipeline.engines.vllm")


def check_options(max_restarts: int, interval_s: float) -> None:
    """Raise :class:`~pipeline.ConfigError` naming the bad restart option, if any."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"max_restarts must be an int >= 0, got {max_restarts!r}",
                          field="max_restarts")
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) \
            or not interval_s > 0:
        raise ConfigError(f"health_interval_s must be a number > 0, got {interval_s!r}",
                          field="health_interval_s")


class CoreWatch:
    """Watches one in-process engine's core and restarts it (see the module doc).

    Args:
        name: the engine as messages name it (``in-process vLLM engine (model)``).
        is_dead: why the current core is dead, or None while it lives (cheap, no I/O).
        replace: shut the dead engine down and start a new one in its place; raises when
            it cannot.
        restart: restart a dead core at all.
        max_restarts: restarts allowed in the engine's life.
        interval_s: seconds between two looks at the core.

    Attributes:
        generation: how many cores were replaced so far (a request remembers the one it ran
            on, so that it waits only for the restart of its own core).
        restart_s: wall seconds each restart took, in order.
        failure: why the engine is dead for good, or None.
    """

    def __init__(self, name: str, *, is_dead: Callable[[], str | None],
                 replace: Callable[[], Awaitable[None]], restart: bool = True,
                 max_restarts: int = 3, interval_s: float = 1.0) -> None:
        check_options(max_restarts, interval_s)
        self.name = name
        self.restart = restart
        self.max_restarts = max_restarts
        self.interval_s = interval_s
        self.generation = 0
        self.restart_s: list[float] = []
        self.failure: str | None = None
        self._is_dead = is_dead
        self._replace = replace
        self._watch: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def restarts(self) -> int:
        """Restarts done so far (successful ones)."""
        return len(self.restart_s)

    def start(self) -> None:
        """Start the watch task (idempotent; needs a running loop); :meth:`aclose` ends it."""
        if not self._closed and (self._watch is None or self._watch.done()):
            self._watch = asyncio.get_running_loop().create_task(
                self._look(), name="pipeline-vllm-core-watch")

    async def _look(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.failure is None and self._restarting is None \
                    and (reason := self._is_dead()) is not None:
                self._begin(self.generation, f"found by the health watch: {reason}")

    def _begin(self, generation: int, reason: str) -> asyncio.Task[None]:
        """The restart of core ``generation``: the one running, or a new one."""
        if self._restarting is None:
            self._restarting = asyncio.get_running_loop().create_task(
                self._restart(generation, reason), name="pipeline-vllm-core-restart")
        return self._restarting

    async def _restart(self, generation: int, reason: str) -> None:
        try:
            if self.generation != generation:  # that core was replaced meanwhile
                return
            if not self.restart:
                self.failure = f"{self.name}: the engine core died ({reason}); restart=False"
            elif self.restarts >= self.max_restarts:
                self.failure = (f"{self.name}: the engine core died again ({reason}) after "
                                f"{self.restarts} restart(s) (max_restarts="
                                f"{self.max_restarts})")
            if self.failure is not None:
                _logger.error("vllm_engine_dead", engine=self.name, error=self.failure)
                return
            _logger.warning("vllm_engine_core_died", engine=self.name, reason=reason,
                            restarts=self.restarts)
            began = time.monotonic()
            try:
                await self._replace()
            except Exception as exc:
                self.failure = (f"{self.name}: the engine core died ({reason}) and could not "
                                f"be restarted: {type(exc).__name__}: {exc}")
                _logger.error("vllm_engine_restart_failed", engine=self.name,
                              error=self.failure)
                return
            self.restart_s.append(time.monotonic() - began)
            self.generation += 1
            _logger.warning("vllm_engine_restarted", engine=self.name,
                            restart_s=round(self.restart_s[-1], 3), restarts=self.restarts)
        finally:
            self._restarting = None

    async def recovered(self, generation: int, reason: str) -> None:
        """Return once core ``generation`` (which a request saw die of ``reason``) has been
        replaced: at once if it was, after the restart in progress, or after one started
        here. A cancelled caller stops waiting; the restart goes on.

        Raises:
            EngineError: the engine is dead for good (restart off, no restarts left, or the
                restart failed), naming the engine and why.
        """
        if self.failure is None and generation == self.generation:
            if self._closed:
                raise EngineError(f"{self.name}: closed while its engine core was dead")
            await asyncio.shield(self._begin(generation, reason))
        if self.failure is not None:
            raise EngineError(self.failure)

    async def ready(self) -> None:
        """Wait for a restart in progress, if any.

        Raises:
            EngineError: the engine is dead for good.
        """
        if self._restarting is not None:
            await asyncio.shield(self._restarting)
        if self.failure is not None:
            raise EngineError(self.failure)

    async def aclose(self) -> None:
        """Stop the watch and wait through a restart in progress (idempotent; the caller's
        cancellation is deferred until then, so a half-started engine is never left)."""
        self._closed = True
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()
        tasks = [t for t in (watch, self._restarting) if t is not None]
        cancelled = await wait_through_cancellation(tasks)
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: each logged its own failure
        if cancelled:
            raise asyncio.CancelledError


class CoreDied(Exception):
    """A request's engine core died under it (internal: the request is retried or fails)."""


def core_dead(llm: Any) -> bool:
    """Whether ``llm``'s engine core is dead (vLLM's ``errored``: the core process gone or
    its output handler ended)."""
    return llm is not None and bool(getattr(llm, "errored", False))


class StepClock:
    """When the engine core last stepped while it had work: a core that holds requests and
    takes no step for ``stall_s`` seconds is hung (alive to the OS, useless to the batch).

    Args:
        stall_s: seconds without a step, with requests in flight, that make a core hung;
            None: never (a hung core is left to the sample deadlines).
    """

    def __init__(self, stall_s: float | None) -> None:
        if stall_s is not None and (isinstance(stall_s, bool) or not stall_s > 0):
            raise ConfigError(f"stall_s must be a number > 0 or None, got {stall_s!r}",
                              field="stall_s")
        self.stall_s = stall_s
        self._steps = -1
        self._since = 0.0

    def stalled(self, steps: int, busy: bool, now: float) -> float | None:
        """Seconds since the last step once they pass ``stall_s`` while ``busy``, else None;
        ``steps``: the core's step count now (it moves while the core works)."""
        if not busy or steps != self._steps:
            self._steps, self._since = steps, now
            return None
        waited = now - self._since
        return waited if self.stall_s is not None and waited >= self.stall_s else None


def kill_core(llm: Any) -> list[int]:
    """SIGKILL ``llm``'s engine core processes (a hung core: vLLM's own monitor then marks
    the engine dead, as for any other death); their pids."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None),
                      "engine_manager", None)
    pids = [int(p.pid) for p in getattr(manager, "processes", ())
            if p.pid is not None and p.exitcode is None]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def why_dead(llm: Any, exc: BaseException | None = None) -> str:
    """Why ``llm``'s engine core died, readably: the process's exit (``EngineCore exited
    with SIGKILL``) where vLLM's process manager saw it, else the exception."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None),
                      "engine_manager", None)
    finished = getattr(manager, "finished_procs", None)
    exits = finished() if callable(finished) else {}
    if exits:
        return "; ".join(f"{name} exited with " + (signal.Signals(-code).name if code < 0
                                                   else f"code {code}")
                         for name, code in exits.items())
    return "vLLM reports it errored" if exc is None else f"{type(exc).__name__}: {exc}"


async def shut_down(llm: Any) -> None:
    """Shut ``llm`` (an ``AsyncLLM``, alive or dead) down: its output handler, its engine
    processes (joined in a thread: seconds) and its ZMQ context."""
    # vLLM stops its output handler only after the engine core; with shutdown in a thread
    # the handler would see the core die first and log EngineDeadError. Stop it here.
    handler = getattr(llm, "output_handler", None)
    if isinstance(handler, asyncio.Task) and not handler.done():
        handler.cancel()
        await asyncio.wait([handler])
    await asyncio.to_thread(llm.shutdown)
    close_zmq_context(llm)
