"""``python -m pipeline.models.tiny [DIR] [--kind dense|moe] [--seed N] [--force]``: build the
tiny dense (Qwen2) or MoE (Qwen3-MoE) chat model and print its directory."""

from __future__ import annotations

import sys

from pipeline.models._cache import build_cli
from pipeline.models._moe import MOE, TinyMoeSpec
from pipeline.models.tiny import DENSE, TinyModelSpec


def main(argv: list[str] | None = None) -> int:
    """Build (or find cached) the chosen tiny model and print its directory.

    Returns:
        The exit status: 0 on success, 2 when the directory is unusable.
    """
    return build_cli({"dense": (DENSE, lambda seed: TinyModelSpec(seed=seed)),
                      "moe": (MOE, lambda seed: TinyMoeSpec(seed=seed))},
                     "python -m pipeline.models.tiny", argv)


if __name__ == "__main__":
    sys.exit(main())
