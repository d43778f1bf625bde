"""Errors of the diagnostics package, under the library's root error::

    PipelineError
    └── DiagnosticsError     a diagnostics facility could not be set up or used
        └── AddressInUseError a server port stayed busy after the bind retries
"""

from __future__ import annotations

from pipeline._exceptions import PipelineError


class DiagnosticsError(PipelineError):
    """A diagnostics facility could not be set up or used (names what and why)."""


class AddressInUseError(DiagnosticsError):
    """A server could not bind its address after retrying; names host, port and attempts."""
