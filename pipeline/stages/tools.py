"""Deprecated import path ``pipeline.stages.tools``, kept for this release only: import from
``pipeline.stages`` instead (see CHANGELOG.md)."""

from pipeline.stages._tools import *  # noqa: F403
