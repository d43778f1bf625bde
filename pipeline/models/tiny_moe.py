"""Deprecated import path ``pipeline.models.tiny_moe``, kept for this release only: import from
``pipeline.models`` and build with ``python -m pipeline.models.tiny --kind moe`` (CHANGELOG.md)."""

import sys

from pipeline.models._moe import *  # noqa: F403

if __name__ == "__main__":
    from pipeline.models.tiny.__main__ import main

    sys.exit(main(["--kind", "moe", *sys.argv[1:]]))
