"""Deprecated import path ``pipeline.stages.judge``, kept for this release only: import from
``pipeline.stages`` instead (see CHANGELOG.md)."""

from pipeline.stages._judge import *  # noqa: F403
