"""Decoding constraints as vLLM's structured outputs (``StructuredOutputsParams`` in process,
``structured_outputs`` in a server's request body).

The proxy hands an engine that declares ``enforces`` a ``pipeline.proxy.Constraints`` (read
here by its attributes, so that engines need not import the proxy): ``features`` (names of
``pipeline.proxy.ENFORCEABLE``), ``response_format`` in chat's shape, ``tool_choice``,
``tools`` and ``call_format`` (the model's tool-call format, the proxy's tool parser).

- ``json_object`` / ``json_schema``: a JSON object / JSON held to the schema (as a structural
  tag, which bounds whitespace runs: :data:`MAX_WHITESPACE`);
- ``tool_choice_required``, ``tool_choice_function``, ``single_tool_call``: the model's own
  call format, built by xgrammar (vLLM's structured-output backend) as a structural tag:
  ``hermes`` is xgrammar's ``qwen_3`` format (``<tool_call>\\n{"name": ..., "arguments": ...}
  \\n</tool_call>``, arguments constrained by the tool's JSON schema): required = at least one
  call, a named function = exactly that call, single = stop after the first call. The sampled
  tokens stay the model's: the constraint only masks what it may sample.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any, Literal

from pipeline._exceptions import EngineError

FORMAT_CONSTRAINTS = frozenset({"json_object", "json_schema"})
"""Constraints any vLLM structured-output backend enforces."""
TOOL_CONSTRAINTS = frozenset({"tool_choice_required", "tool_choice_function",
                              "single_tool_call"})
"""Constraints enforced in the model's call format (:data:`CALL_FORMATS`)."""
XGRAMMAR = importlib.util.find_spec("xgrammar") is not None
"""Whether xgrammar (it comes with vLLM) is here to build tool-call structural tags."""
MAX_WHITESPACE = 32
"""Longest run of whitespace allowed inside constrained JSON: room for indented output, and a
bound on a model that would pad with whitespace until its token limit (a JSON grammar allows
any amount between tokens)."""
CALL_FORMATS = {"hermes": "qwen_3"}
"""Tool-call formats (the proxy's tool parser names) -> xgrammar's model format key."""


def structured_outputs(constraints: Any) -> dict[str, Any]:
    """vLLM's structured-output parameters for ``constraints`` (see the module doc).

    Raises:
        EngineError: constraints that cannot be combined (a JSON format and a tool
            constraint), or a call format with no structural tag here.
    """
    features = frozenset(constraints.features)
    tools = features & TOOL_CONSTRAINTS
    fmt = constraints.response_format or {}
    if tools and features & FORMAT_CONSTRAINTS:
        raise EngineError(f"cannot enforce {sorted(features)} together: a JSON reply and a "
                          "tool call are two different outputs")
    if "json_schema" in features:
        return _json_tag((fmt.get("json_schema") or {}).get("schema", {}))
    if "json_object" in features:
        return _json_tag({"type": "object"})
    call_format = getattr(constraints, "call_format", "hermes")
    key = CALL_FORMATS.get(call_format)
    if key is None:
        raise EngineError(f"no structural tag for the tool-call format {call_format!r} "
                          f"(known: {sorted(CALL_FORMATS)})")
    return {"structural_tag": json.dumps(_tool_tag(constraints, key, tools))}


def _json_tag(schema: Any) -> dict[str, Any]:
    """A JSON reply held to ``schema``, as a structural tag (vLLM's ``json`` option has no
    bound on whitespace runs; this one has :data:`MAX_WHITESPACE`)."""
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}})}


def _tool_tag(constraints: Any, key: str, tools: frozenset[str]) -> dict[str, Any]:
    from xgrammar import get_model_structural_tag  # vLLM's backend; imported when used

    offered = list(constraints.tools or ())
    choice: Any = "auto"
    if "tool_choice_function" in tools:
        name = constraints.tool_choice["function"]["name"]
        offered = [t for t in offered if t["function"]["name"] == name]
        if not offered:
            raise EngineError(f"tool_choice names {name!r}, which is not among the tools")
        choice = "required"
    elif "tool_choice_required" in tools:
        choice = "required"
    reasoning: Literal["auto", "disabled"] = (
        "auto" if getattr(constraints, "reasoning", False) else "disabled")
    single = "single_tool_call" in tools or "tool_choice_function" in tools
    tag = get_model_structural_tag(key, tools=[_schema_tool(t) for t in offered],
                                   tool_choice=choice, reasoning=reasoning,
                                   parallel_tool_calls=not single,
                                   max_whitespace_cnt=MAX_WHITESPACE)
    if choice == "required":  # calls only: xgrammar's "required" lets text follow the calls
        tag.format = _calls_only(tag.format, single)
    return dict(tag.model_dump(mode="json"))


def _calls_only(fmt: Any, single: bool) -> Any:
    """``fmt`` with its triggered tool-call tags (text, then calls) made one or more calls
    with nothing around them (one newline between two, as hermes writes them); a sequence
    (a reasoning block first) keeps its other parts."""
    from xgrammar.structural_tag import (
        SequenceFormat,
        TagsWithSeparatorFormat,
        TriggeredTagsFormat,
    )

    if isinstance(fmt, SequenceFormat):
        return SequenceFormat(elements=[*fmt.elements[:-1],
                                        _calls_only(fmt.elements[-1], single)])
    if isinstance(fmt, TriggeredTagsFormat):
        return TagsWithSeparatorFormat(tags=fmt.tags, separator="\n", at_least_one=True,
                                       stop_after_first=single)
    return fmt


def _schema_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A chat tool with a parameters schema (a tool without one takes any object)."""
    function = dict(tool["function"])
    function.setdefault("parameters", {"type": "object"})
    return {"type": "function", "function": function}
