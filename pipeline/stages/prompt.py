"""Deprecated import path ``pipeline.stages.prompt``, kept for this release only: import from
``pipeline.stages`` instead (see CHANGELOG.md)."""

from pipeline._render import *  # noqa: F403
from pipeline.stages._prompt import *  # noqa: F403
