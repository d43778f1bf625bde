"""Where dumps go, how the directories are opened safely, and the locator ``rollout dump``
reads.

``$ROLLOUT_DUMP_DIR/<pid>/`` when that variable is set, else
``<tempdir>/rollout-dumps-<uid>/<pid>/``. The locator ``<base>/<pid>.json`` names a
process's dump directory, signal and socket even when it was given another directory.

The base may sit in a world-writable place (``/tmp``) where another user can create it
first and later swap ``<pid>`` for a symlink, making a root trainer write wherever they
like. So a directory is used only when every directory on its path is owned by root or by
us and writable by nobody else unless sticky (``/tmp``), symlinks on the way are followed
only when root or we own them, and the directory itself is ours and writable by nobody
else. Missing directories are created with mode 0700. A base that fails the check is
replaced by a fresh private ``<tempdir>/rollout-dumps-<uid>-XXXXXXXX/`` (logged once as
``dump_dir_fallback``); ``rollout dump`` looks there too. Files are written through the
opened directory's descriptor with ``O_NOFOLLOW | O_EXCL``, then renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import threading
from pathlib import Path

import structlog

DUMP_DIR_ENV = "ROLLOUT_DUMP_DIR"
"""Environment variable: the base directory for dumps (``<base>/<pid>/``)."""

FAULTHANDLER_FILE = "faulthandler.txt"
SOCKET_FILE = "dump.sock"
FALLBACK_PREFIX = "rollout-dumps-{uid}-"
"""Name prefix of the private fallback bases, in the temp directory."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_MAX_LINKS = 40
_logger = structlog.get_logger("pipeline.diagnostics")
_fallbacks: dict[str, Path] = {}
_fallback_lock = threading.Lock()


class UnsafeDirectoryError(OSError):
    """A directory on the dump path is a foreign symlink, owned by another user, or
    writable by others."""


def dump_base_dir(uid: int | None = None) -> Path:
    """The base dump directory: ``$ROLLOUT_DUMP_DIR``, else ``<tempdir>/rollout-dumps-<uid>``."""
    env = os.environ.get(DUMP_DIR_ENV)
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / f"rollout-dumps-{os.getuid() if uid is None else uid}"


def default_dump_dir(pid: int | None = None, uid: int | None = None) -> Path:
    """Where process ``pid`` (default: this one) writes dumps unless told otherwise (or
    unless that base is unsafe: see the module doc)."""
    return dump_base_dir(uid) / str(os.getpid() if pid is None else pid)


def locator_path(pid: int, uid: int | None = None) -> Path:
    """The locator file that tells ``rollout dump`` where process ``pid`` writes dumps."""
    return dump_base_dir(uid) / f"{pid}.json"


def open_private_dir(path: str | Path, *, create: bool = True) -> int:
    """Open directory ``path`` after checking every directory on the way (see the module doc).

    Returns:
        A close-on-exec descriptor of the directory; the caller closes it.

    Raises:
        UnsafeDirectoryError: the path fails the check.
        OSError: it cannot be created or opened.
    """
    todo = list(Path(os.path.abspath(path)).parts[1:])
    stack = [os.open("/", _DIR_FLAGS)]  # the directories walked so far, innermost last
    links = 0
    try:
        while todo:
            name = todo.pop(0)
            if name in (".", ""):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                continue
            final = not todo
            try:
                child = _open_child(stack[-1], name, create=create)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or final:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _unsafe(name, "is a symlink or not a directory") from exc
                    raise
                # A symlink on the way: follow it only if root or we own it.
                info = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
                if not stat.S_ISLNK(info.st_mode) or info.st_uid not in (0, os.geteuid()):
                    raise _unsafe(name, "is a symlink owned by another user or not a "
                                        "directory") from exc
                links += 1
                if links > _MAX_LINKS:
                    raise _unsafe(name, "has too many symlinks") from exc
                target = os.readlink(name, dir_fd=stack[-1])
                todo[:0] = Path(target).parts[1:] if os.path.isabs(target) else \
                    Path(target).parts
                if os.path.isabs(target):
                    while len(stack) > 1:
                        os.close(stack.pop())
                continue
            stack.append(child)
            _check(child, name, final=final)
        fd = stack.pop()
        return fd
    finally:
        for other in stack:
            os.close(other)


def open_private_child(parent_fd: int, name: str) -> int:
    """Open (creating it with mode 0700) the private directory ``name`` inside an opened one.

    Raises:
        UnsafeDirectoryError: it is a symlink, not ours, or writable by others.
    """
    try:
        fd = _open_child(parent_fd, name, create=True)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _unsafe(name, "is a symlink or not a directory") from exc
        raise
    try:
        _check(fd, name, final=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_child(parent_fd: int, name: str, *, create: bool) -> int:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)
    return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)


def _check(fd: int, name: str, *, final: bool) -> None:
    info = os.fstat(fd)
    me = os.geteuid()
    if final:
        if info.st_uid != me:
            raise _unsafe(name, f"is owned by uid {info.st_uid}, not {me}")
        if info.st_mode & 0o022:
            raise _unsafe(name, f"is writable by other users (mode {info.st_mode & 0o7777:o})")
        return
    if info.st_uid not in (0, me):
        raise _unsafe(name, f"is owned by uid {info.st_uid}")
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise _unsafe(name, f"is writable by other users and not sticky "
                            f"(mode {info.st_mode & 0o7777:o})")


def _unsafe(name: str, why: str) -> UnsafeDirectoryError:
    return UnsafeDirectoryError(errno.EPERM, f"unsafe dump path: {name!r} {why}")


def open_dump_base() -> tuple[Path, int]:
    """Open this process's dump base, or its private fallback when the base is unsafe.

    Returns:
        The base's path and an open descriptor of it (the caller closes it).

    Raises:
        OSError: neither the base nor a fallback can be opened.
    """
    base = dump_base_dir()
    fallback = _fallbacks.get(str(base))
    if fallback is None:
        try:
            return base, open_private_dir(base)
        except OSError as exc:
            with _fallback_lock:
                fallback = _fallbacks.get(str(base))
                if fallback is None:
                    fallback = Path(tempfile.mkdtemp(
                        prefix=FALLBACK_PREFIX.format(uid=os.geteuid())))
                    _fallbacks[str(base)] = fallback
                    _logger.warning("dump_dir_fallback", refused=str(base), reason=str(exc),
                                    directory=str(fallback))
    return fallback, open_private_dir(fallback, create=False)


def write_atomic(dir_fd: int, name: str, text: str) -> None:
    """Write ``text`` to ``name`` in an opened directory through a temporary file and a rename
    (a reader never sees half a file); neither name's symlink is ever followed."""
    tmp = f".{name}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
    with open(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
