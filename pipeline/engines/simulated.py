"""Deprecated import path ``pipeline.engines.simulated``, kept for this release only: import from
``pipeline.engines`` instead (see CHANGELOG.md)."""

from pipeline.engines._simulated import *  # noqa: F403
