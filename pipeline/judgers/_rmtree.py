"""``remove_tree``: remove a sandboxed run's directory, whatever the program made of it.

The sandbox calls it (in a thread) when a run ends. A test runs these very functions' source
as another uid, so they use nothing but ``os``, ``contextlib``, ``stat`` and ``Path``.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def remove_tree(root: Path) -> str | None:
    """Remove ``root`` and everything in it, whatever a program made of it.

    Iterative and descriptor-based, so depth is no limit (no recursion, no path longer than
    one name); symlinks are unlinked, never followed; fifos, sockets and devices are just
    names; directories made unreadable (mode 000) are opened again after a chmod.

    Returns:
        None when ``root`` is gone, else what stopped it (it never raises).
    """
    try:
        fd = _open_dir(str(root), None)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot open {root}: {exc}"
    problem: str | None = None
    stack: list[tuple[str, list[str]]] = [("", _clear_files(fd))]
    try:
        while True:
            name, subdirs = stack[-1]
            if subdirs:
                child = subdirs.pop()
                try:
                    child_fd = _open_dir(child, fd)
                except OSError:
                    with contextlib.suppress(OSError):  # it changed under us: a plain name
                        os.unlink(child, dir_fd=fd)
                    continue
                os.close(fd)
                fd = child_fd
                stack.append((child, _clear_files(fd)))
                continue
            stack.pop()
            if not stack:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError as exc:
                problem = problem or f"{name}: {exc}"
    except OSError as exc:
        problem = f"{type(exc).__name__}: {exc}"
    finally:
        os.close(fd)
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return problem or f"{root}: {exc}"
    return None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_dir(name: str, dir_fd: int | None) -> int:
    """Open directory ``name`` without following a symlink; make it ours to read first if
    its mode shuts us out (as root that never happens)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            raise
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _clear_files(fd: int) -> list[str]:
    """Unlink every non-directory in the open directory; return its subdirectories."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o700)  # a directory the program made read-only (ours when not root)
    subdirs: list[str] = []
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    subdirs.append(entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)
            except OSError:
                continue
    return subdirs
