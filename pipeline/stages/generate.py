"""Deprecated import path ``pipeline.stages.generate``, kept for this release only: import from
``pipeline.stages`` instead (see CHANGELOG.md)."""

from pipeline.stages._generate import *  # noqa: F403
