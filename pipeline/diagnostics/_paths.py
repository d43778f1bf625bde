"""Where dumps go, and the locator file that lets ``rollout dump PID`` find them.

``$ROLLOUT_DUMP_DIR/<pid>/`` when that variable is set, else
``<tempdir>/rollout-dumps-<uid>/<pid>/``. The locator ``<base>/<pid>.json`` names a
process's dump directory, signal and socket even when it was given another directory.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

DUMP_DIR_ENV = "ROLLOUT_DUMP_DIR"
"""Environment variable: the base directory for dumps (``<base>/<pid>/``)."""

FAULTHANDLER_FILE = "faulthandler.txt"
SOCKET_FILE = "dump.sock"


def dump_base_dir(uid: int | None = None) -> Path:
    """The base dump directory: ``$ROLLOUT_DUMP_DIR``, else ``<tempdir>/rollout-dumps-<uid>``."""
    env = os.environ.get(DUMP_DIR_ENV)
    if env:
        return Path(env)
    return Path(tempfile.gettempdir()) / f"rollout-dumps-{os.getuid() if uid is None else uid}"


def default_dump_dir(pid: int | None = None, uid: int | None = None) -> Path:
    """Where process ``pid`` (default: this one) writes dumps unless told otherwise."""
    return dump_base_dir(uid) / str(os.getpid() if pid is None else pid)


def locator_path(pid: int, uid: int | None = None) -> Path:
    """The locator file that tells ``rollout dump`` where process ``pid`` writes dumps."""
    return dump_base_dir(uid) / f"{pid}.json"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: a reader never sees
    half a file."""
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
