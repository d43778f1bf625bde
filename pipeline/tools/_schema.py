"""Checking tool-call arguments against a tool's JSON schema (the subset tools use).

Supported keywords: ``type`` (a name or a list of names), ``properties``, ``required``,
``additionalProperties`` (``false`` or a schema), ``items``, ``enum``, ``minimum``, ``maximum``,
``minLength``, ``maxLength``. Unknown keywords are ignored, so a richer schema still works
(it is only checked less strictly). Problems come back as sentences for the model to read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "boolean": (bool,), "object": (dict,), "array": (list,),
    "null": (type(None),), "number": (int, float), "integer": (int, float),
}


def _type_ok(value: Any, name: str) -> bool:
    kinds = _TYPES.get(name)
    if kinds is None:
        return True  # a type this checker does not know: accept
    if name in ("number", "integer") and isinstance(value, bool):
        return False
    if not isinstance(value, kinds):
        return False
    return name != "integer" or isinstance(value, int) or (
        isinstance(value, float) and value.is_integer())


def validate_arguments(schema: Mapping[str, Any], value: Any, path: str = "arguments") -> list[str]:
    """Return what is wrong with ``value`` under ``schema`` (an empty list when it fits).

    Args:
        schema: a JSON schema (usually the tool's ``parameters``).
        value: the decoded arguments.
        path: how to name ``value`` in the messages.

    Returns:
        One sentence per problem, e.g. ``"arguments.expression: expected string, got int"``.
    """
    if not isinstance(schema, Mapping):
        return []
    expected = schema.get("type")
    if expected is not None:
        names = expected if isinstance(expected, list) else [expected]
        if not any(_type_ok(value, str(n)) for n in names):
            return [f"{path}: expected {' or '.join(map(str, names))}, got {_json_type(value)}"]
    problems: list[str] = []
    if "enum" in schema and isinstance(schema["enum"], list) and value not in schema["enum"]:
        problems.append(f"{path}: must be one of {schema['enum']!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if isinstance(schema.get("minimum"), int | float) and value < schema["minimum"]:
            problems.append(f"{path}: must be >= {schema['minimum']}")
        if isinstance(schema.get("maximum"), int | float) and value > schema["maximum"]:
            problems.append(f"{path}: must be <= {schema['maximum']}")
    if isinstance(value, str):
        if isinstance(schema.get("minLength"), int) and len(value) < schema["minLength"]:
            problems.append(f"{path}: shorter than {schema['minLength']} characters")
        if isinstance(schema.get("maxLength"), int) and len(value) > schema["maxLength"]:
            problems.append(f"{path}: longer than {schema['maxLength']} characters")
    if isinstance(value, dict):
        problems.extend(_check_object(schema, value, path))
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, element in enumerate(value):
            problems.extend(validate_arguments(schema["items"], element, f"{path}[{i}]"))
    return problems


def _check_object(schema: Mapping[str, Any], value: dict[str, Any], path: str) -> list[str]:
    problems: list[str] = []
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    required = schema.get("required")
    for name in required if isinstance(required, list) else []:
        if name not in value:
            problems.append(f"{path}: missing required field {name!r}")
    extra = schema.get("additionalProperties", True)
    for name, element in value.items():
        if name in properties:
            problems.extend(validate_arguments(properties[name], element, f"{path}.{name}"))
        elif extra is False:
            problems.append(f"{path}: unexpected field {name!r}")
        elif isinstance(extra, Mapping):
            problems.extend(validate_arguments(extra, element, f"{path}.{name}"))
    return problems


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "string", "object", "array"):
        if isinstance(value, _TYPES[name]):
            return name
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return type(value).__name__
