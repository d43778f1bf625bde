"""Diagnostics: the one sync entry point (more in later modules)."""

from pipeline.diagnostics.run import asyncio_run

__all__ = ["asyncio_run"]
