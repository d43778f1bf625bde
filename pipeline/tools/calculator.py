"""Deprecated import path ``pipeline.tools.calculator``, kept for this release only: import from
``pipeline.tools`` instead (see CHANGELOG.md)."""

from pipeline.tools._calculator import *  # noqa: F403
