"""``ProcessPool``: run synchronous functions in worker processes, killable one call at a time.

``concurrent.futures.ProcessPoolExecutor`` cannot kill one worker, and a thread cannot be
killed at all, so a hung reward function would exhaust either. Here each worker is its own
process (its own session, so its children die with it) talking length-prefixed pickles over
pipes, awaited without blocking the event loop. A call that runs past its timeout, or whose
caller is cancelled, has its worker killed; the next call starts a fresh one.

Functions and arguments are pickled, so functions must be importable by reference: defined at
module top level (a ``__main__`` script works when it guards its entry point with
``if __name__ == "__main__":``, as with multiprocessing's spawn); lambdas and closures do not.
A fresh worker imports the function's module before the call's clock starts.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from pipeline.judgers._base import JudgerTimeout, WorkerError

_logger = structlog.get_logger("pipeline.judgers")
_HEADER = struct.Struct(">I")
_WORKER_SCRIPT = str(Path(__file__).with_name("_worker.py"))


class _Worker:
    """One worker process and its pipes."""

    __slots__ = ("calls", "modules", "pid", "proc")

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.calls = 0
        self.modules: set[str] = set()
        """Modules this worker has imported for calls (their calls need no handshake)."""

    async def send(self, message: Any) -> None:
        assert self.proc.stdin is not None
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(_HEADER.pack(len(body)) + body)
        await self.proc.stdin.drain()

    async def recv(self) -> Any:
        assert self.proc.stdout is not None
        header = await self.proc.stdout.readexactly(_HEADER.size)
        body = await self.proc.stdout.readexactly(_HEADER.unpack(header)[0])
        return pickle.loads(body)

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (it leads its own session)."""
        if self.proc.returncode is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass


class ProcessPool:
    """A small pool of worker processes for synchronous (CPU-bound or blocking) functions.

    Workers start lazily, at most ``size`` at a time, and stay up between calls. All of them
    belong to the pool: :meth:`aclose` ends them and reaps every process, including those
    killed on timeout. Use ``async with ProcessPool() as pool:`` or call ``aclose``.

    Args:
        size: most calls running at once (and most live workers); default: CPU count, <= 8.
        start_timeout_s: limit for starting a worker and importing the function's module.
    """

    def __init__(self, size: int | None = None, *, start_timeout_s: float = 60.0) -> None:
        if size is None:
            size = max(1, min(os.cpu_count() or 1, 8))
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"ProcessPool size must be an int >= 1, got {size!r}")
        self.size = size
        self.start_timeout_s = start_timeout_s
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._reapers: set[asyncio.Task[None]] = set()
        self._slots: asyncio.Semaphore | None = None
        self._closed = False
        self.started = 0
        """Workers started so far."""
        self.killed = 0
        """Workers killed (timeout, cancellation or crash) so far."""

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (idle and busy)."""
        return [w.pid for w in [*self._idle, *self._busy]]

    async def call(self, fn: Any, /, *args: Any, timeout_s: float | None = None,
                   **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` in a worker and return its result.

        Args:
            fn: an importable top-level function (see the module doc).
            timeout_s: limit on the function's own run time; waiting for a free worker and
                starting one are not counted. None: no limit.

        Raises:
            JudgerTimeout: the function ran past ``timeout_s``; its worker was killed.
            WorkerError: the function raised (``remote_type``/``remote_traceback`` say what),
                the worker died, or ``fn``/arguments could not be pickled.
            RuntimeError: the pool is closed.
        """
        if self._closed:
            raise RuntimeError("ProcessPool is closed")
        label = getattr(fn, "__qualname__", repr(fn))
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise WorkerError(f"cannot send {label} to a worker process: {exc} (functions must "
                              f"be importable top-level functions; see ProcessPool)") from exc
        module = getattr(fn, "__module__", None) or "?"
        main_path = _main_path() if module == "__main__" else None
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            worker = self._idle.pop() if self._idle else await self._spawn(module)
            self._busy.add(worker)
            healthy = False
            try:
                reply = await self._run(worker, label, module, main_path, payload, timeout_s)
                healthy = True
            finally:
                self._busy.discard(worker)
                if healthy and not self._closed:
                    self._idle.append(worker)
                else:
                    self._retire(worker)
        if reply[0] == "ok":
            return reply[1]
        _, remote_type, message, text = reply
        raise WorkerError(f"{label} raised {remote_type}: {message}", remote_type=remote_type,
                          remote_traceback=text)

    async def _run(self, worker: _Worker, label: str, module: str, main_path: str | None,
                   payload: bytes, timeout_s: float | None) -> Any:
        announce = module not in worker.modules
        limit, what = self.start_timeout_s, f"importing {module} for {label}"
        try:
            if announce:  # it may import the function's module first: not on the clock
                async with asyncio.timeout(limit):
                    await worker.send(("call", main_path, True, payload))
                    reply = await worker.recv()
                if reply[0] != "started":
                    return reply  # unpickling failed in the worker: the worker is fine
                worker.modules.add(module)
            worker.calls += 1
            limit, what = timeout_s, label  # type: ignore[assignment]
            async with asyncio.timeout(timeout_s):
                if not announce:
                    await worker.send(("call", main_path, False, payload))
                return await worker.recv()
        except TimeoutError:
            raise JudgerTimeout(
                f"{what} ran past its {limit}s limit; worker {worker.pid} was killed"
            ) from None
        except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError) as exc:
            code = await _exit_code(worker)
            raise WorkerError(f"worker {worker.pid} died while running {label} "
                              f"({_describe_exit(code)})") from exc

    async def _spawn(self, module: str) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-P", _WORKER_SCRIPT, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, start_new_session=True)
        worker = _Worker(proc)
        self.started += 1
        try:
            async with asyncio.timeout(self.start_timeout_s):
                preload = [] if module in ("__main__", "?") else [module]
                await worker.send(("init", {"sys_path": list(sys.path), "preload": preload}))
                ready = await worker.recv()
        except BaseException as exc:
            self._retire(worker)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise WorkerError(f"worker process failed to start: {type(exc).__name__}: {exc}"
                              ) from exc
        if ready[0] != "ready" or self._closed:
            self._retire(worker)
            raise WorkerError("the pool was closed while a worker started" if self._closed
                              else f"worker process sent {ready[0]!r} instead of 'ready'")
        worker.modules.update(preload)
        return worker

    def _retire(self, worker: _Worker) -> None:
        """Kill ``worker`` now; a task owned by the pool reaps it."""
        if worker.proc.returncode is None:
            self.killed += 1
            worker.kill()
        task = asyncio.get_running_loop().create_task(_reap(worker), name=f"reap:{worker.pid}")
        self._reapers.add(task)
        task.add_done_callback(self._reapers.discard)

    async def aclose(self) -> None:
        """End every worker (idle ones get EOF, busy ones are killed) and reap them all.

        Calls still running raise :class:`WorkerError`. Safe to call more than once.
        """
        self._closed = True
        idle, self._idle = self._idle, []
        for worker in idle:
            if worker.proc.stdin is not None:
                worker.proc.stdin.close()
        deadline = time.monotonic() + 2.0
        for worker in idle:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await worker.proc.wait()
            except TimeoutError:
                pass
            self._retire(worker)
        for worker in list(self._busy):
            worker.kill()
        while self._reapers or self._busy:
            await asyncio.gather(*self._reapers)
            if self._busy:
                await asyncio.sleep(0.01)

    async def __aenter__(self) -> ProcessPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _reap(worker: _Worker) -> None:
    """Wait for the (killed) worker to exit and release its pipes."""
    if worker.proc.stdin is not None:
        worker.proc.stdin.close()
    await worker.proc.wait()
    if worker.proc.stdout is not None:
        # Drain to EOF so the pipe transport closes (bounded: an escaped grandchild may
        # still hold the pipe open).
        try:
            async with asyncio.timeout(1.0):
                await worker.proc.stdout.read()
        except TimeoutError:
            _logger.warning("worker_pipe_held_open", pid=worker.pid)


async def _exit_code(worker: _Worker) -> int | None:
    try:
        async with asyncio.timeout(1.0):
            return await worker.proc.wait()
    except TimeoutError:
        return None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _main_path() -> str | None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if isinstance(path, str) else None
