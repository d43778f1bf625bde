"""Deprecated import path ``pipeline.stages.base``, kept for this release only: import from
``pipeline.stages`` instead (see CHANGELOG.md)."""

from pipeline.stages._base import *  # noqa: F403
