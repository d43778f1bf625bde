"""The exceptions the rate limiters raise.

::

    RateLimitError
    ├── LimiterClosed     acquire() on a closed limiter, or a waiter woken by aclose()
    └── LimiterConflict   registry.get() with parameters that differ from the existing bucket
                          (also a ValueError)

A timed-out ``acquire`` raises the builtin :class:`TimeoutError`; bad arguments raise
:class:`ValueError` naming the argument. ``RateLimitError`` derives from
:class:`pipeline.PipelineError` (whose module imports nothing else of the package).
"""

from __future__ import annotations

from pipeline._exceptions import PipelineError


class RateLimitError(PipelineError):
    """Root of every error the rate limiters raise on purpose."""


class LimiterClosed(RateLimitError):
    """The limiter was closed: new acquires are refused and queued waiters are woken with it."""


class LimiterConflict(RateLimitError, ValueError):
    """A registry name requested again with different parameters; names both sets."""
