"""Deprecated import path ``pipeline.engines.consistency``, kept for this release only: import from
``pipeline.engines`` instead (see CHANGELOG.md)."""

from pipeline.engines._consistency import *  # noqa: F403
