"""A process-pool worker: runs pickled calls sent by :class:`pipeline.judgers.ProcessPool`.

Started as a script (``python -P _worker.py``) so that it imports nothing of this package:
a worker costs one bare interpreter plus the modules of the functions it runs. Frames are a
4-byte big-endian length and a pickle, on the original stdin/stdout; fd 0 is then pointed at
/dev/null and fd 1 at stderr, so a function that prints cannot corrupt the protocol.

Parent to worker: ``("init", {"sys_path": [...], "preload": [module, ...]})``, then
``("call", main_path, announce, payload)`` with ``payload = pickle((fn, args, kwargs))``.
Worker to parent: ``("ready", pid)`` once the preload modules are imported, then per call
``("started",)`` once the function is unpickled (only when ``announce``: the parent asks when
the function's module may still need importing, so import time stays outside the call's
timeout), and ``("ok", result)`` or ``("err", type_name, message, traceback_text)``. EOF on
stdin ends the worker.
"""

import os
import pickle
import struct
import sys
import traceback
import types
from typing import Any

_HEADER = struct.Struct(">I")


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv(fd: int) -> Any:
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _send(fd: int, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(body)) + body)
    while view:
        view = view[os.write(fd, view):]


def _die_with_parent() -> None:
    """Best effort (Linux): get SIGKILL when the parent dies, so no worker outlives it."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _load_main(path: str) -> None:
    """Make functions defined in the parent's ``__main__`` script unpicklable here."""
    import runpy

    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _error(exc: BaseException) -> tuple[str, str, str, str]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable exception>"
    return ("err", type(exc).__name__, message, text[-8000:])


def _plain(value: Any) -> Any:
    """A plain function's value; an awaitable (a plain function that returned a coroutine)
    is closed and refused, the rule of ``pipeline._concurrency.callables.plain_result``."""
    if hasattr(type(value), "__await__"):  # not inspect: the worker stays lean
        close = getattr(value, "close", None)
        if callable(close):
            close()
        raise TypeError(f"the function returned {type(value).__name__}, an awaitable, from a "
                        "plain function: nothing awaits it in a worker process; return the "
                        "value itself")
    return value


def main() -> None:
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    _die_with_parent()
    init = _recv(proto_in)
    if init is None:
        return
    sys.path[:] = init[1]["sys_path"]
    for module in init[1].get("preload", ()):
        try:
            __import__(module)
        except BaseException:
            pass  # the call that needs it reports the error
    _send(proto_out, ("ready", os.getpid()))
    main_loaded = False
    while True:
        message = _recv(proto_in)
        if message is None:
            return
        _, main_path, announce, payload = message
        try:
            if main_path and not main_loaded:
                _load_main(main_path)
                main_loaded = True
            fn, args, kwargs = pickle.loads(payload)
        except BaseException as exc:
            _send(proto_out, _error(exc))
            continue
        if announce:
            _send(proto_out, ("started",))
        reply: tuple[Any, ...]
        try:
            reply = ("ok", _plain(fn(*args, **kwargs)))
        except BaseException as exc:
            reply = _error(exc)
        try:
            _send(proto_out, reply)
        except Exception as exc:  # the result could not be pickled
            _send(proto_out, _error(exc))


if __name__ == "__main__":
    main()
