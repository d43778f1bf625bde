"""The field rules of ``POST /v1/messages`` (Anthropic's Messages API, as the ``anthropic`` SDK
and Claude Code send it), on the proxy's policy (:mod:`pipeline.proxy._policy`): every field
served, enforced, accepted with no effect, or refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.proxy._policy import (
    COMMON_FIELDS,
    EFFORT_NOTE,
    JSON_SCHEMA,
    NO_EFFECT_NOTE,
    SINGLE_CALL,
    SUPPORTED,
    TOOL_NAMED,
    TOOL_REQUIRED,
    FieldRule,
    Refuse,
    check_served,
    hint_parts,
    known_keys,
    no_effect_rule,
    one_of,
    refused_rule,
    whole_hint,
)

ANTHROPIC_EFFORTS = ("low", "medium", "high", "max")
"""The efforts Anthropic's ``output_config.effort`` names."""


def _anthropic_tool_choice(value: Any, body: Mapping[str, Any]) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError("expected an object")
    kind = value.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise ValueError("type: expected one of auto, any, tool, none")
    if kind == "tool" and not isinstance(value.get("name"), str):
        raise ValueError("a tool choice of type tool needs a string name")
    known_keys("tool_choice", value, ("type", "name", "disable_parallel_tool_use"))
    needs: tuple[str, ...] = {"any": (TOOL_REQUIRED,), "tool": (TOOL_NAMED,)}.get(
        str(kind), ())
    if value.get("disable_parallel_tool_use") and body.get("tools") and kind != "none":
        needs += (SINGLE_CALL,)
    return needs or None


def _anthropic_format(fmt: Any) -> str | None:
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or fmt.get("type") != JSON_SCHEMA:
        raise Refuse("format: only json_schema is known")
    if not isinstance(fmt.get("schema"), Mapping):
        raise ValueError("format.schema: expected an object")
    return JSON_SCHEMA


def _output_config(value: Any, body: Mapping[str, Any]) -> str | None:
    value = known_keys("output_config", value, ("effort", "format"))
    if value is None:
        return None
    one_of(ANTHROPIC_EFFORTS)(value.get("effort"), body)
    return _anthropic_format(value.get("format"))


def _context_management(value: Any, body: Mapping[str, Any]) -> str | None:
    """Only ``clear_thinking_*`` edits: the proxy renders earlier replies from the tokens it
    recorded, thinking included, whatever a client asks to clear (clearing tool results would
    change the prompt: refused)."""
    if value is None:
        return None
    edits = value.get("edits") if isinstance(value, Mapping) else None
    if not isinstance(edits, list) or set(value) - {"edits"}:
        raise ValueError("expected an object with a list of edits")
    for edit in edits:
        kind = edit.get("type") if isinstance(edit, Mapping) else None
        if not isinstance(kind, str) or not kind.startswith("clear_thinking"):
            raise Refuse(f"edit {kind!r}: only clear_thinking edits are accepted (the proxy "
                          "keeps the recorded tokens; other edits would change the prompt)")
    return None


def _thinking(value: Any, body: Mapping[str, Any]) -> str | None:
    if value is not None and (not isinstance(value, Mapping) or value.get("type") not in (
            "enabled", "disabled", "adaptive")):
        raise ValueError("type: expected one of enabled, disabled, adaptive")
    return None


MESSAGES_FIELDS: dict[str, FieldRule] = {
    "model": COMMON_FIELDS["model"],
    "messages": SUPPORTED, "system": SUPPORTED, "max_tokens": SUPPORTED,
    "stop_sequences": SUPPORTED, "stream": SUPPORTED, "temperature": SUPPORTED,
    "top_p": SUPPORTED,
    "tools": FieldRule("supported", "client tools (name, description, input_schema); server "
                       "tools refused"),
    "tool_choice": FieldRule("enforced", "auto / none supported; any, tool (named) and "
                             "disable_parallel_tool_use: enforced by the engine, else refused",
                             _anthropic_tool_choice),
    "output_config": FieldRule("enforced", "format json_schema: enforced by the engine, else "
                               "refused; effort: " + EFFORT_NOTE, _output_config,
                               hint_parts("effort")),
    "output_format": FieldRule("enforced", "json_schema (the older beta of "
                               "output_config.format): enforced by the engine, else refused",
                               lambda value, body: _anthropic_format(value)),
    "cache_control": FieldRule("no effect", "accepted (on blocks too: Claude Code sends it on "
                               "every request) and listed in ignored_fields; refused with "
                               "strict_fields", check_served, whole_hint),
    "metadata": no_effect_rule(), "service_tier": no_effect_rule(),
    "inference_geo": no_effect_rule(),
    "user_profile_id": no_effect_rule(), "workspace_id": no_effect_rule(),
    "speed": FieldRule("no effect", "standard / fast: " + NO_EFFECT_NOTE,
                       one_of(("standard", "fast")), whole_hint),
    "diagnostics": refused_rule("diagnostics: the proxy reports no prompt-cache divergence"),
    "thinking": FieldRule("no effect", "enabled / disabled / adaptive: " + NO_EFFECT_NOTE,
                          _thinking, whole_hint),
    "top_k": refused_rule("the proxy serves no top_k (sampling is the session's)"),
    "container": refused_rule("containers: the proxy serves no server tools"),
    "mcp_servers": refused_rule("MCP servers: the proxy serves no server tools"),
    "context_management": FieldRule(
        "no effect", "clear_thinking edits (Claude Code sends one on every request): the "
        "recorded tokens are kept, listed in ignored_fields, refused with strict_fields; other "
        "edits refused", _context_management, whole_hint),
}
"""Every field of ``POST /v1/messages`` (Anthropic's Messages API), and
:data:`MESSAGES_EXTENSION_FIELDS`."""

MESSAGES_EXTENSION_FIELDS = frozenset({"stream", "temperature", "top_p", "top_k",
                                       "output_format", "mcp_servers", "context_management"})
"""Messages fields the ``anthropic`` SDK's create parameters no longer type (sampling knobs,
older betas) that clients still send."""
