"""Models built and updated on the hot path from values that are valid by construction.

``make_items`` builds one :class:`~pipeline.AgentRolloutItem` and one sampling copy per sample
from parts that were validated a moment before (the row, the merged sampling parameters) and
values the runner made itself (uids, seeds, empty lists). Running pydantic's validation again
cost 4-6 µs per sample; :func:`construct` does what ``model_construct`` does without its
per-field Python loop (which is slower than validating).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_new = object.__new__
_set = object.__setattr__
_ALL_FIELDS: dict[type[BaseModel], set[str]] = {}


def construct(cls: type[M], values: dict[str, Any], extra: dict[str, Any] | None = None) -> M:
    """An instance of ``cls`` holding ``values`` (every field, each already valid), unvalidated.

    The instances share one set of field names as their "fields set": every field is set, so
    pydantic's assignment (which adds the assigned name) never changes it, and each sample
    keeps one object less for the collector to walk. Only for models without private
    attributes; ``extra`` is the extra fields of a model that allows them (a dict of its own
    per instance, since assigning an unknown name writes into it), None for any other. Such a
    model must give an instance a set of its own before an extra field is assigned (pydantic
    adds the name to the field set): see :func:`own_fields_set`.
    """
    fields = _ALL_FIELDS.get(cls)
    if fields is None:
        fields = _ALL_FIELDS[cls] = set(cls.model_fields)
    assert len(values) == len(fields), f"{cls.__name__}: every field must be given"
    obj = _new(cls)
    _set(obj, "__dict__", values)
    _set(obj, "__pydantic_fields_set__", fields)
    _set(obj, "__pydantic_extra__", extra)
    _set(obj, "__pydantic_private__", None)
    return obj


def set_fields(model: BaseModel, values: dict[str, Any]) -> None:
    """Assign runner-made values (timestamps, end states) to fields of a model that validates
    nothing on assignment, as one dict update: pydantic's ``__setattr__`` costs about 0.4 µs
    a field, paid several times per sample."""
    model.__dict__.update(values)


def own_fields_set(model: BaseModel) -> None:
    """Give ``model`` a field set of its own if it shares the one :func:`construct` gave it
    (call before assigning an extra field, which pydantic adds to the set)."""
    if model.__pydantic_fields_set__ is _ALL_FIELDS.get(type(model)):
        _set(model, "__pydantic_fields_set__", set(model.__pydantic_fields_set__))


def str_keys(values: dict[Any, Any]) -> bool:
    """Whether every key of ``values`` is a ``str``; an empty dict (most are: no sampling
    overrides, no extra fields) is answered without a generator."""
    return not values or all(type(key) is str for key in values)
