"""Deprecated import path ``pipeline.engines.factory``, kept for this release only: import from
``pipeline.engines`` instead (see CHANGELOG.md)."""

from pipeline.engines._factory import *  # noqa: F403
