"""Where a locally built model lives and how it is built once: one rule for every kind.

A kind (the tiny dense model, the tiny MoE model) names its cache folder, the environment
variable that moves it, its marker file and its builder. :meth:`ModelKind.ensure` finds a
finished build by its marker (the spec it was built from) or builds into a temporary sibling
and renames it into place, so concurrent callers never see half-written files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline._exceptions import ConfigError


@dataclass(frozen=True)
class ModelKind:
    """One kind of locally built model.

    Attributes:
        label: how errors and the CLI name it ("tiny-model").
        env_var: the environment variable that overrides its cache folder.
        cache_name: its folder under ``$XDG_CACHE_HOME/rollout-pipeline``.
        marker: the file written last into a finished build (holds the spec).
        builder_version: bumped when the builder changes what it writes.
        build: ``(directory, spec) -> directory``; writes everything but the marker.
    """

    label: str
    env_var: str
    cache_name: str
    marker: str
    builder_version: int
    build: Callable[[Path, Any], object]

    def default_dir(self) -> Path:
        """``$<env_var>``, else ``$XDG_CACHE_HOME/rollout-pipeline/<cache_name>`` (``~/.cache``
        when XDG is unset)."""
        override = os.environ.get(self.env_var)
        if override:
            return Path(override).expanduser()
        base = os.environ.get("XDG_CACHE_HOME")
        root = Path(base).expanduser() if base else Path.home() / ".cache"
        return root / "rollout-pipeline" / self.cache_name

    @staticmethod
    def save_model(model: Any, directory: Path) -> None:
        """``model.save_pretrained(directory)`` with transformers' progress bar off (a
        one-file save needs none; builders call this)."""
        import importlib

        hf_logging: Any = importlib.import_module("transformers.utils.logging")
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            model.save_pretrained(str(directory))
        finally:
            if bars:
                hf_logging.enable_progress_bar()

    def payload(self, spec: Any) -> dict[str, Any]:
        return {"builder_version": self.builder_version, "spec": asdict(spec)}

    def is_built(self, directory: Path, spec: Any) -> bool:
        """Whether ``directory`` holds a finished build of exactly ``spec``."""
        try:
            found = json.loads((directory / self.marker).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return bool(found == self.payload(spec))

    def build_into(self, directory: Path, spec: Any) -> Path:
        """Build into ``directory`` (created if needed) and write the marker last."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.build(directory, spec)
        (directory / self.marker).write_text(json.dumps(self.payload(spec), indent=1),
                                             encoding="utf-8")
        return directory

    def ensure(self, directory: Path | None, spec: Any, *, rebuild: bool = False) -> Path:
        """A directory holding a finished build of ``spec``, built first if needed.

        Raises:
            ConfigError: ``directory`` exists, is not empty and is not a build of this kind.
        """
        target = Path(directory) if directory is not None else self.default_dir()
        if not rebuild and self.is_built(target, spec):
            return target
        if target.exists() and any(target.iterdir()) and not (target / self.marker).exists():
            raise ConfigError(f"{target} exists and is not a {self.label} build; "
                              f"pass an empty or new directory (or set {self.env_var})")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f".{target.name}.build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.build_into(staging, spec)
            if not rebuild and self.is_built(target, spec):  # another process finished first
                return target
            if target.exists():
                shutil.rmtree(target)
            try:
                os.rename(staging, target)
            except OSError:
                if not self.is_built(target, spec):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target


def build_cli(kinds: dict[str, tuple[ModelKind, Callable[[int], Any]]], prog: str,
              argv: list[str] | None = None) -> int:
    """``prog [DIR] [--kind K] [--seed N] [--force]``: build (or find) a model, print its folder.

    Args:
        kinds: kind name -> (its :class:`ModelKind`, ``seed -> spec``); the first is the default.

    Returns:
        0 on success, 2 when the directory is unusable.
    """
    names = list(kinds)
    parser = argparse.ArgumentParser(prog=prog, description="Build a tiny local chat model "
                                     "(no download, seeded, a few seconds on a CPU).")
    parser.add_argument("directory", nargs="?", type=Path, default=None,
                        help="output directory (default: the kind's environment variable or "
                             "the user cache)")
    parser.add_argument("--kind", choices=names, default=names[0],
                        help=f"which model (default {names[0]})")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if a finished build is there")
    args = parser.parse_args(argv)
    kind, make_spec = kinds[args.kind]
    try:
        directory = kind.ensure(args.directory, make_spec(args.seed), rebuild=args.force)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(directory)
    return 0
