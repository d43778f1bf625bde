"""Errors of the diagnostics package, under the library's root error::

    PipelineError
    └── DiagnosticsError     a diagnostics facility could not be set up or used
"""

from __future__ import annotations

from pipeline._exceptions import PipelineError


class DiagnosticsError(PipelineError):
    """A diagnostics facility could not be set up or used (names what and why)."""

