"""``python -m pipeline.models.tiny [DIR] [--seed N] [--force]``: build the tiny model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline._exceptions import ConfigError
from pipeline.models.tiny import ENV_DIR, TinyModelSpec, default_model_dir, ensure_tiny_model


def main(argv: list[str] | None = None) -> int:
    """Build (or find cached) the tiny model and print its directory.

    Returns:
        The exit status: 0 on success, 2 when the directory is unusable.
    """
    parser = argparse.ArgumentParser(prog="python -m pipeline.models.tiny",
                                     description="Build the tiny local Qwen2 chat model.")
    parser.add_argument("directory", nargs="?", type=Path, default=None,
                        help=f"output directory (default: ${ENV_DIR} or the user cache)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if a finished build is there")
    args = parser.parse_args(argv)
    directory: Path = args.directory or default_model_dir()
    try:
        ensure_tiny_model(directory, TinyModelSpec(seed=args.seed), rebuild=args.force)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
