"""A worker's samples on the wire: each ``(sample, item)`` pickled on its own, so that one
that cannot be (an unpicklable artifact) fails alone, named, instead of its whole chunk."""

from __future__ import annotations

from typing import Any

import ray
import structlog

from pipeline._data.models import AgentRolloutItem, RolloutSample, Status
from pipeline._runner.context import Context
from pipeline._runner.fill import fill_sample, minimal_sample
from pipeline._runner.outcome import force_end
from pipeline._runner.pipeline import Pipeline

_logger = structlog.get_logger("pipeline.distributed")

Packed = tuple[str, bytes | None, str | None]
"""One sample on the wire: ``(uid, cloudpickled (sample, item) or None, error or None)``."""
Chunk = list[Packed]


def failed_sample(pipeline: Pipeline, item: AgentRolloutItem, error: str) -> RolloutSample:
    """The trainer view of an ``item`` already ended ``failed``: the pipeline's fill, else
    the minimal masked sample built from the pad id alone."""
    try:
        return fill_sample(item, Context(pipeline.resources, pipeline.config, item))
    except Exception:
        return minimal_sample(item, pipeline.pad_token_id, error)


def pack(worker_id: str, pipeline: Pipeline, sample: RolloutSample,
         item: AgentRolloutItem) -> Packed:
    """``(sample, item)`` pickled for the driver; one that cannot be ends ``failed`` here,
    its unpicklable artifacts replaced by a note (or, failing that, the driver ends it from
    the error alone)."""
    try:
        return item.uid, _dumps((sample, item)), None
    except BaseException as exc:  # a __reduce__ may raise anything
        cause = f"{type(exc).__name__}: {exc}"
    bad = [key for key, value in item.artifacts.items() if not _picklable(value)]
    where = (f"artifact{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}" if bad
             else "its sample or item")
    why = (f"worker {worker_id} could not send the sample back: {where} cannot be "
           f"pickled ({cause})")
    _logger.error("worker_sample_unpicklable", uid=item.uid, artifacts=bad, error=cause)
    for key in bad:
        item.artifacts[key] = f"<not picklable: {type(item.artifacts[key]).__name__}>"
    force_end(item, Status.FAILED, why)
    try:
        return item.uid, _dumps((failed_sample(pipeline, item, why), item)), None
    except BaseException:
        return item.uid, None, why


def _dumps(value: Any) -> bytes:
    data: bytes = ray.cloudpickle.dumps(value, protocol=5)
    return data


def _picklable(value: Any) -> bool:
    try:
        _dumps(value)
    except BaseException:
        return False
    return True
