"""Garbage-collector settings for a process that runs rollouts, applied only at the edge.

A batch keeps thousands of samples alive, each with its items, records and token lists, and
CPython's default first-generation threshold (700 allocations) then triggers collections so
often that full passes over every live sample pause the event loop for hundreds of
milliseconds. :func:`rollout_gc` raises the threshold and moves what exists at start-up
(engine, model, tokenizer) out of the collector's sight with ``gc.freeze()``.

The library itself never changes the collector: a trainer's worker that imports it keeps its
own settings. Only the sync entry points (:func:`pipeline.asyncio_run`, the ``rollout`` CLI)
use this, and ``ROLLOUT_GC_TUNING=0`` (or ``asyncio_run(gc_tuning=False)``) switches it off.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator

ENV = "ROLLOUT_GC_TUNING"
"""Set to ``0`` to leave the collector's settings alone at the entry points too."""

FIRST_GENERATION_THRESHOLD = 50_000
"""Allocations between first-generation collections (CPython's default: 700)."""


def gc_tuning_enabled(requested: bool | None) -> bool:
    """``requested``, or when None, whether the environment leaves tuning on (default)."""
    if requested is not None:
        return requested
    return os.environ.get(ENV, "1").strip().lower() not in {"0", "false", "no", "off"}


@contextlib.contextmanager
def rollout_gc(enabled: bool = True) -> Iterator[None]:
    """Within the block: fewer collections, and objects alive at entry frozen out of them.

    The previous thresholds are restored on exit, and the frozen objects unfrozen unless the
    host had frozen objects of its own before entry (a server that called ``gc.freeze()``
    after its start-up, as vLLM's does): CPython can only unfreeze everything at once, and
    that would hand the host's start-up heap back to the collector. Its frozen set then keeps
    what was alive at entry too.
    """
    if not enabled:
        yield
        return
    previous = gc.get_threshold()
    host_froze = gc.get_freeze_count() > 0
    gc.freeze()
    gc.set_threshold(FIRST_GENERATION_THRESHOLD, *previous[1:])
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        if not host_froze:
            gc.unfreeze()
