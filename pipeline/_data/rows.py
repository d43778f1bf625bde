"""The dataset row schema and loading rows from JSONL / JSON / parquet-like dicts.

A row is::

    {"messages": [{"role": "user", "content": "..."}],   # or "prompt": str | list[message]
     "tools": [{"type": "function", "function": {...}}],  # optional, OpenAI tool schemas
     "ground_truth": ...,                                 # optional, read by judgers
     "data_source": "gsm8k",                              # optional, routes judgers
     "sampling": {"temperature": 0.6},                    # optional per-row overrides
     "chat_template_kwargs": {"enable_thinking": False},  # optional template options
     "extra": {...}}                                      # optional, anything else

verl-style rows load with this mapping: ``prompt`` (a list of chat messages) -> ``messages``,
``reward_model.ground_truth`` -> ``ground_truth``, ``data_source`` -> ``data_source``,
``extra_info`` -> ``extra``; any other top-level key is kept under ``extra``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline._data.config import check_template_kwargs, describe_validation_error
from pipeline._data.construct import construct, str_keys
from pipeline._exceptions import RowError

_ROLES = ("system", "user", "assistant", "tool")


class DatasetRow(BaseModel):
    """One prompt of a dataset, validated. Messages stay plain dicts (OpenAI wire form)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    ground_truth: Any = None
    data_source: str = "default"
    sampling: dict[str, Any] = Field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_template_kwargs(value)


_ROW_FIELDS = frozenset(DatasetRow.model_fields)  # the class property costs ~5 us a read
_validate_row = DatasetRow.__pydantic_validator__.validate_python  # model_validate's core


def parse_row(raw: Mapping[str, Any] | DatasetRow, index: int | None = None) -> DatasetRow:
    """Validate one row (our schema or verl's) into a :class:`DatasetRow`.

    Args:
        raw: the row as a mapping, or an already validated row.
        index: the row's position in its source, used in error messages.

    Raises:
        RowError: naming the row and the field that is missing or invalid.
    """
    if type(raw) is not dict and isinstance(raw, DatasetRow):  # dicts: skip the ABC checks
        return raw
    where = f"row {index}" if index is not None else "row"
    if type(raw) is not dict and not isinstance(raw, Mapping):
        hint = ("; rows are dicts: a single row or a path? pass [row] or load_rows(path)"
                if isinstance(raw, str | bytes) else "")
        raise RowError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r:.40}{hint}",
                       row_index=index)
    data = dict(raw)
    source = "messages"
    if "messages" not in data:
        if "prompt" not in data:
            raise RowError(
                f"{where}: field 'messages' is missing (a row needs 'messages' or 'prompt'); "
                f"keys present: {sorted(data)}",
                row_index=index,
                field="messages",
            )
        source = "prompt"
        prompt = data.pop("prompt")
        data["messages"] = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        )
    reward_model = data.pop("reward_model", None)
    if reward_model is not None:
        if not isinstance(reward_model, Mapping):
            raise RowError(
                f"{where}: field 'reward_model' must be a mapping",
                row_index=index,
                field="reward_model",
            )
        data.setdefault("ground_truth", reward_model.get("ground_truth"))
    extra = data.pop("extra", None) or {}
    if type(extra) is not dict and not isinstance(extra, Mapping):
        raise RowError(f"{where}: field 'extra' must be a mapping, got {type(extra).__name__}",
                       row_index=index, field="extra")
    extra_info = data.pop("extra_info", None)
    unknown = data.keys() - _ROW_FIELDS
    if extra_info is not None or unknown:
        extra = dict(extra)  # the caller's mapping stays as it was
        if extra_info is not None:
            extra.setdefault("extra_info", extra_info)
        for key in unknown:
            extra[key] = data.pop(key)
    data["extra"] = extra
    _check_messages(data["messages"], where, index, source)
    _check_fields(data, where, index)
    row = _plain_row(data)
    if row is not None:
        return row
    try:
        return _validate_row(data)  # type: ignore[no-any-return]
    except ValidationError as exc:
        raise RowError(
            f"{where}: {describe_validation_error(exc)}",
            row_index=index,
            field=".".join(str(p) for p in exc.errors()[0]["loc"]),
        ) from None


def _plain_row(data: dict[str, Any]) -> DatasetRow | None:
    """The row built without pydantic's validation when its values already have exactly the
    field types (checked above and here), else None. Validating would copy the message list
    and every message dict: the row then keeps the caller's (do not change them while the
    batch runs), and one object less per row (its own field set) for the collector."""
    messages, tools = data["messages"], data.get("tools")
    if (type(messages) is not list or type(data.get("data_source", "")) is not str
            or data.get("chat_template_kwargs")  # its options are checked by the validator
            or not all(type(m) is dict and str_keys(m) for m in messages)
            or (tools is not None and (type(tools) is not list
                                       or not all(type(t) is dict for t in tools)))):
        return None
    values = {"messages": messages, "tools": tools, "ground_truth": data.get("ground_truth"),
              "data_source": data.get("data_source", "default")}
    for key in ("sampling", "chat_template_kwargs", "extra"):
        value = data.get(key, {})
        if type(value) is not dict or not str_keys(value):
            return None
        values[key] = value
    return construct(DatasetRow, values)


def _check_messages(messages: Any, where: str, index: int | None,
                    source: str = "messages") -> None:
    if not isinstance(messages, list) or not messages:
        what = "a non-empty string or " if source == "prompt" else ""
        raise RowError(
            f"{where}: field '{source}' must be {what}a non-empty list of chat messages, "
            f"got {messages!r:.60}",
            row_index=index,
            field=source,
        )
    for i, msg in enumerate(messages):
        if type(msg) is not dict and not isinstance(msg, Mapping):
            field = f"{source}.{i}"
            raise RowError(
                f"{where}: field '{field}' must be a mapping with 'role' and 'content'",
                row_index=index,
                field=field,
            )
        if msg.get("role") not in _ROLES:
            raise RowError(
                f"{where}: field '{source}.{i}.role' must be one of {_ROLES}, got "
                f"{msg.get('role')!r}",
                row_index=index,
                field=f"{source}.{i}.role",
            )
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RowError(
                f"{where}: field '{source}.{i}.content' must be a string, a list of parts "
                f"or null, got {type(content).__name__}",
                row_index=index,
                field=f"{source}.{i}.content",
            )
    if not any(m.get("role") == "user" and _has_text(m.get("content")) for m in messages):
        raise RowError(
            f"{where}: field '{source}' has no user message with content: the model would "
            "see the chat template alone",
            row_index=index,
            field=source,
        )


def _has_text(content: Any) -> bool:
    """Whether message content holds anything: non-blank text, or a non-text part."""
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, list):
        return any(not isinstance(p, Mapping) or p.get("type", "text") != "text"
                   or _has_text(p.get("text")) for p in content)
    return False


def _check_fields(data: dict[str, Any], where: str, index: int | None) -> None:
    """The optional fields' shapes, beyond their types (which the model checks)."""
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise RowError(f"{where}: field 'tools' must be a list of OpenAI tool schemas, "
                           f"got {type(tools).__name__}", row_index=index, field="tools")
        for i, schema in enumerate(tools):
            function = schema.get("function") if isinstance(schema, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) \
                    or not function["name"]:
                raise RowError(
                    f"{where}: field 'tools.{i}' must be an OpenAI tool schema "
                    "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}, "
                    f"got {schema!r:.80}", row_index=index, field=f"tools.{i}")
    source = data.get("data_source", "default")
    if not isinstance(source, str) or not source:
        raise RowError(f"{where}: field 'data_source' must be a non-empty string, got "
                       f"{source!r:.40}", row_index=index, field="data_source")


def check_rows_argument(rows: Any) -> None:
    """Refuse a ``rows`` argument that is not a collection of rows (before any is read).

    A single row dict, a path, a string or ``None`` would otherwise iterate into nonsense
    (a dict's keys, a string's characters).

    Raises:
        RowError: naming what was passed and what to pass instead.
    """
    if isinstance(rows, Mapping | DatasetRow):
        raise RowError("rows must be a list of rows, got a single row: pass [row]",
                       field="rows")
    if isinstance(rows, str | bytes | Path):
        raise RowError(f"rows must be a list of rows, got {type(rows).__name__} {rows!r:.60}: "
                       "for a file, pass load_rows(path)", field="rows")
    if not isinstance(rows, Iterable):
        raise RowError(f"rows must be a list of rows, got {type(rows).__name__}", field="rows")


def iter_rows(source: str | Path | Iterable[Mapping[str, Any]]) -> Iterator[DatasetRow]:
    """Stream validated rows from a ``.jsonl``/``.json``/``.parquet`` path or an iterable of dicts.

    Parquet needs ``pyarrow`` (not a dependency of this package). Rows are validated as they
    are read, so the first bad row raises before later ones are touched.

    Raises:
        RowError: a row is malformed (bad JSON included), naming its index (and line).
        FileNotFoundError: the path does not exist.
    """
    if not isinstance(source, str | Path):
        for i, raw in enumerate(source):
            yield parse_row(raw, i)
        return
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as fh:
            index = 0
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise RowError(
                        f"{path.name} line {lineno} (row {index}): invalid JSON: {exc.msg}",
                        row_index=index,
                    ) from None
                yield parse_row(raw, index)
                index += 1
    elif suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise RowError(f"{path.name}: expected a JSON list of rows")
        for i, raw in enumerate(data):
            yield parse_row(raw, i)
    elif suffix == ".parquet":
        import pyarrow.parquet as pq  # optional; only parquet users need it

        for i, raw in enumerate(pq.read_table(path).to_pylist()):
            yield parse_row(raw, i)
    else:
        raise RowError(
            f"{path.name}: unsupported file type {suffix!r} (use .jsonl, .json, .parquet)"
        )


def load_rows(source: str | Path | Iterable[Mapping[str, Any]]) -> list[DatasetRow]:
    """Load and validate every row of ``source`` (see :func:`iter_rows`)."""
    return list(iter_rows(source))
