"""What the proxy does with every request field: serve it, have the engine enforce it, or
refuse it. No field is silently ignored.

Each field of ``POST /v1/chat/completions``, ``POST /v1/responses`` (as the official SDK
names them) and ``POST /v1/messages`` (as the ``anthropic`` SDK does) has a
:class:`FieldRule`:

- ``supported``: the proxy honours it;
- ``no effect``: a hint the proxy cannot act on — hosted-service bookkeeping (``user``,
  ``metadata``, ``store``, prompt-cache keys, ...) and output hints (``verbosity``,
  ``reasoning_effort`` where the chat template has no such option): accepted, and listed per
  turn, per session and on the sample (``ignored_fields``: :func:`read_hints`), so that a
  trainer can tell which requests asked for something they did not get; refused like the
  ``refused`` fields with ``ProxyConfig(strict_fields=True)``. A hint the chat template reads
  (``reasoning_effort``, Responses' ``reasoning.effort``: gpt-oss's template) becomes that
  template option instead (:data:`TEMPLATE_HINTS`);
- ``enforced``: a decoding constraint (``response_format`` json, ``tool_choice`` required or
  named, ``parallel_tool_calls: false``): served only when the engine declares that it enforces
  it (:func:`engine_enforces`), which then gets a :class:`Constraints` with ``generate``;
  otherwise refused;
- ``refused``: a value other than the default/null is refused.

A refusal is a final error (404, ``x-should-retry: false``, code ``unsupported_parameter``): an
agent that asks for JSON output and silently gets free text would train on a task it was not
given. A field no rule names (a vendor extension such as ``top_k``) is refused the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pipeline.proxy._errors import FinalError, ProxyRequestError

JSON_OBJECT = "json_object"
"""The reply must be a JSON object (``response_format``/``text.format`` ``json_object``)."""
JSON_SCHEMA = "json_schema"
"""The reply must match a JSON schema (``json_schema``)."""
TOOL_REQUIRED = "tool_choice_required"
"""The reply must call a tool (``tool_choice: "required"``)."""
TOOL_NAMED = "tool_choice_function"
"""The reply must call the named function (``tool_choice: {"type": "function", ...}``)."""
SINGLE_CALL = "single_tool_call"
"""At most one tool call per reply (``parallel_tool_calls: false`` with tools)."""
ENFORCEABLE = (JSON_OBJECT, JSON_SCHEMA, SINGLE_CALL, TOOL_NAMED, TOOL_REQUIRED)
TOOL_CONSTRAINTS = frozenset({SINGLE_CALL, TOOL_NAMED, TOOL_REQUIRED})
"""The constraints on tool calls (enforced in the model's call format)."""
CALL_FORMATS = ("hermes",)
"""Tool-call formats engines build tool constraints for (``pipeline.engines._structured``);
on a proxy whose model writes another format, tool constraints are refused."""
"""The constraint names an engine may list in its ``enforces`` attribute."""

Policy = Literal["supported", "no effect", "enforced", "refused"]


@dataclass(frozen=True, slots=True)
class Constraints:
    """The decoding constraints of one request, handed to an engine that enforces them as
    ``engine.generate(prompt_ids, sampling, request_id, constraints=...)``.

    Attributes:
        features: the constraint names in force (a subset of :data:`ENFORCEABLE`).
        response_format: chat's shape, ``{"type": "json_object"}`` or ``{"type":
            "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the Responses API's
            ``text.format`` is converted to it).
        tool_choice: ``"required"`` or ``{"type": "function", "function": {"name": ...}}``.
        tools: the tool schemas offered (chat's shape).
        call_format: see below; reasoning: see below.
    """

    features: frozenset[str]
    response_format: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = field(default=None)
    call_format: str = "hermes"
    """The model's tool-call format (the proxy's tool parser): tool constraints follow it."""
    reasoning: bool = False
    """The model may open with a reasoning block (the proxy reads one with its parser)."""


def engine_enforces(engine: Any) -> frozenset[str]:
    """The constraints ``engine`` declares it enforces (its optional ``enforces`` attribute,
    any iterable of :data:`ENFORCEABLE` names); empty when it has none."""
    declared = getattr(engine, "enforces", None) or ()
    return frozenset(str(name) for name in declared) & frozenset(ENFORCEABLE)


# A check gets (value, body) and returns None (served as is), a constraint name or several
# (needs the engine), or raises Refuse with the reason.
Check = Callable[[Any, Mapping[str, Any]], str | tuple[str, ...] | None]


class Refuse(Exception):
    pass


# The hint parts of a field's value, by path (``{"text.verbosity": "low"}``); called with the
# field's name and its value, once the value passed the field's check.
HintParts = Callable[[str, Any], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class FieldRule:
    """What the proxy does with one request field (see the module doc).

    ``hints``: for a field that is, or holds, a hint the proxy does not act on; it names the
    parts of a value that are (see :func:`read_hints`).
    """

    policy: Policy
    note: str
    check: Check | None = None
    hints: HintParts | None = None


TEMPLATE_HINTS: dict[str, str] = {"reasoning_effort": "reasoning_effort",
                                  "reasoning.effort": "reasoning_effort",
                                  "output_config.effort": "reasoning_effort"}
"""Hint paths that become a chat-template option (path -> template variable) where the
tokenizer's chat template reads that variable (:func:`template_hints`)."""

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
"""The reasoning efforts OpenAI's API names (``reasoning_effort``, ``reasoning.effort``)."""
VERBOSITIES = ("low", "medium", "high")
"""The verbosities OpenAI's API names (``verbosity``, ``text.verbosity``)."""


@dataclass(frozen=True, slots=True)
class Hints:
    """What :func:`read_hints` found in a request.

    Attributes:
        ignored: paths of the hints sent that the proxy did not act on, in body order
            (``metadata``, ``text.verbosity``, ...).
        options: chat-template options hints became (``{"reasoning_effort": "low"}``).
    """

    ignored: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


def template_hints(tokenizer: Any) -> frozenset[str]:
    """The variables of :data:`TEMPLATE_HINTS` that ``tokenizer``'s chat template reads (a
    template that names the variable reads it: the templates of the families that have such
    an option pass it to their system prompt)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # transformers' named templates
        template = "\n".join(str(t) for t in template.values())
    if not isinstance(template, str):
        return frozenset()
    return frozenset(name for name in TEMPLATE_HINTS.values()
                     if re.search(rf"\b{name}\b", template))


def read_hints(body: Mapping[str, Any], rules: Mapping[str, FieldRule],
               template_options: frozenset[str], *, strict: bool = False) -> Hints:
    """The hints of a body that already passed :func:`check_fields`: the template options
    they become (those of ``template_options``, what the chat template reads) and the paths
    the proxy ignores.

    Raises:
        FinalError: ``strict`` and a hint would be ignored (404, ``unsupported_parameter``,
            ``param`` names its path).
    """
    ignored: list[str] = []
    options: dict[str, Any] = {}
    for name, value in body.items():
        rule = rules.get(name)
        if rule is None or rule.hints is None:
            continue
        for path, part in rule.hints(name, value).items():
            option = TEMPLATE_HINTS.get(path)
            if option is not None and option in template_options:
                options[option] = part
            elif strict:
                raise FinalError(f"{path}: the proxy cannot act on this hint, and "
                                 "strict_fields refuses what it would ignore", param=path,
                                 code="unsupported_parameter")
            else:
                ignored.append(path)
    return Hints(tuple(ignored), options)


def whole_hint(name: str, value: Any) -> dict[str, Any]:
    """The whole value is the hint (any value but null)."""
    return {} if value is None else {name: value}


def hint_parts(*keys: str) -> HintParts:
    """The hint parts of an object value: its ``keys`` that are not null."""
    def parts(name: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            return {}
        return {f"{name}.{key}": value[key] for key in keys if value.get(key) is not None}
    return parts


def _include_hints(name: str, value: Any) -> dict[str, Any]:
    wanted = "reasoning.encrypted_content"
    return {f"{name}.{wanted}": True} if wanted in (value or ()) else {}


def one_of(allowed: tuple[str, ...]) -> Check:
    """Null or one of ``allowed`` (any other value is a 400 naming the field)."""
    def check(value: Any, body: Mapping[str, Any]) -> str | None:
        if value is not None and value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return None
    return check


def check_served(value: Any, body: Mapping[str, Any]) -> str | None:
    return None


def _only(*allowed: Any, why: str) -> Check:
    """Refused unless null or one of ``allowed``."""
    def check(value: Any, body: Mapping[str, Any]) -> str | None:
        if value is None or value in allowed:
            return None
        raise Refuse(why)
    return check


def _falsy(why: str) -> Check:
    """Refused unless null, zero, false or empty."""
    def check(value: Any, body: Mapping[str, Any]) -> str | None:
        if not value:
            return None
        raise Refuse(why)
    return check


def _format_need(fmt: Any) -> str | None:
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if fmt is None or kind == "text":
        return None
    if kind in (JSON_OBJECT, JSON_SCHEMA):
        return str(kind)
    raise Refuse(f"format {kind!r} is not known")


def _response_format(value: Any, body: Mapping[str, Any]) -> str | None:
    return _format_need(value)


def _text(value: Any, body: Mapping[str, Any]) -> str | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise Refuse("text must be an object")
    one_of(VERBOSITIES)(value.get("verbosity"), body)
    return _format_need(value.get("format"))


def _tool_choice(value: Any, body: Mapping[str, Any]) -> str | None:
    if value in (None, "none", "auto"):
        return None
    if value == "required":
        return TOOL_REQUIRED
    if isinstance(value, Mapping) and value.get("type") == "function":
        named = value.get("function", value)  # chat nests the name, Responses does not
        if not isinstance(named, Mapping) or not isinstance(named.get("name"), str):
            raise ValueError("a named tool_choice needs a string name")  # a 400
        return TOOL_NAMED
    raise Refuse(f"tool_choice {value!r} names no function tool the proxy serves")


def _parallel(value: Any, body: Mapping[str, Any]) -> str | None:
    return SINGLE_CALL if value is False and body.get("tools") else None


def known_keys(name: str, value: Any, known: Collection[str]) -> Mapping[str, Any] | None:
    """The object value of field ``name`` once every key is one of ``known``; None for null.

    Raises:
        ValueError: the value is no object (a 400 naming the field).
        Refuse: a key outside ``known`` (an option the proxy does not know is not ignored).
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError("expected an object")
    unknown = set(value) - set(known)
    if unknown:
        raise Refuse(f"{name} {sorted(unknown)} are not known")
    return value


def _stream_options(value: Any, body: Mapping[str, Any]) -> str | None:
    if value is not None and not isinstance(value, Mapping):
        raise Refuse("stream_options must be an object")
    known_keys("stream_options", value, ("include_usage", "include_obfuscation"))
    return None


def _include(value: Any, body: Mapping[str, Any]) -> str | None:
    unknown = set(value or ()) - {"message.output_text.logprobs", "reasoning.encrypted_content"}
    if unknown:
        raise Refuse(f"include {sorted(unknown)}: the proxy serves no hosted tools or images")
    return None


_REASONING_KEYS = ("effort", "summary", "generate_summary")


def _reasoning(value: Any, body: Mapping[str, Any]) -> str | None:
    value = known_keys("reasoning", value, _REASONING_KEYS)
    if value is not None and value.get("effort") is not None and value["effort"] not in EFFORTS:
        raise ValueError(f"effort: expected one of {', '.join(EFFORTS)}")
    return None


NO_EFFECT_NOTE = ("accepted and listed in ignored_fields; refused with strict_fields")
EFFORT_NOTE = ("a chat-template option where the template reads reasoning_effort (gpt-oss's), "
           "else accepted and listed in ignored_fields; refused with strict_fields")
SUPPORTED = FieldRule("supported", "", check_served)


def no_effect_rule(note: str = NO_EFFECT_NOTE) -> FieldRule:
    return FieldRule("no effect", note, check_served, whole_hint)


def refused_rule(note: str, check: Check | None = None) -> FieldRule:
    return FieldRule("refused", note, check or _falsy(note))


_ENFORCED_FORMAT = "json_object / json_schema: enforced by the engine, else refused"
_ENFORCED_CHOICE = ("none / auto supported; required and a named function: enforced by the "
                    "engine, else refused")
_ENFORCED_PARALLEL = ("true / null supported; false (with tools): enforced by the engine, "
                      "else refused")
COMMON_FIELDS: dict[str, FieldRule] = {
    "model": FieldRule("supported", "any name: the proxy serves its one model, and its "
                       "replies name it"),
    "temperature": SUPPORTED, "top_p": SUPPORTED, "stream": SUPPORTED,
    "tools": SUPPORTED,
    "tool_choice": FieldRule("enforced", _ENFORCED_CHOICE, _tool_choice),
    "parallel_tool_calls": FieldRule("enforced", _ENFORCED_PARALLEL, _parallel),
    "stream_options": FieldRule("supported", "include_usage supported; include_obfuscation "
                                "has no effect (listed in ignored_fields)", _stream_options,
                                hint_parts("include_obfuscation")),
    "top_logprobs": refused_rule("top_logprobs > 0: the engine returns the sampled token's "
                             "logprob only"),
    "metadata": no_effect_rule(), "user": no_effect_rule(), "safety_identifier": no_effect_rule(),
    "service_tier": no_effect_rule(), "store": no_effect_rule(
        "accepted (every response of a session is kept for previous_response_id anyway) and "
        "listed in ignored_fields; refused with strict_fields"),
    "prompt_cache_key": no_effect_rule(), "prompt_cache_retention": no_effect_rule(),
    "prompt_cache_options": no_effect_rule(),
    "moderation": refused_rule("moderation: the proxy runs no moderation policy"),
}

CHAT_FIELDS: dict[str, FieldRule] = {
    **COMMON_FIELDS,
    "messages": SUPPORTED, "seed": SUPPORTED, "stop": SUPPORTED, "logprobs": SUPPORTED,
    "max_tokens": SUPPORTED, "max_completion_tokens": SUPPORTED,
    "n": refused_rule("n > 1: each choice would be one recorded turn", _only(1, why="n > 1: each "
                  "choice would be one recorded turn")),
    "response_format": FieldRule("enforced", _ENFORCED_FORMAT, _response_format),
    "functions": refused_rule("legacy functions: use tools (the reply's legacy function_call "
                          "form is not produced)"),
    "function_call": refused_rule("legacy function_call: use tools and tool_choice"),
    "frequency_penalty": refused_rule("frequency_penalty: the engine protocol has no penalties"),
    "presence_penalty": refused_rule("presence_penalty: the engine protocol has no penalties"),
    "logit_bias": refused_rule("logit_bias: the engine protocol has no logit bias"),
    "reasoning_effort": FieldRule("no effect", EFFORT_NOTE, one_of(EFFORTS), whole_hint),
    "verbosity": FieldRule("no effect", NO_EFFECT_NOTE, one_of(VERBOSITIES), whole_hint),
    "modalities": refused_rule("modalities other than text", _only(
        ["text"], why="only text output is served")),
    "audio": refused_rule("audio output"),
    "prediction": refused_rule("predicted outputs"),
    "web_search_options": refused_rule("web search: the proxy serves no hosted tools"),
    "chat_template_kwargs": FieldRule(
        "supported", "the chat template's own options (vLLM's extension: enable_thinking, "
        "...); a change starts a new segment (tools_changed)"),
}
"""Every field of ``POST /v1/chat/completions``, and :data:`EXTENSION_FIELDS`."""

EXTENSION_FIELDS = frozenset({"chat_template_kwargs"})
"""Fields of vLLM's OpenAI-compatible server, not of OpenAI's API, that the proxy serves (the
official SDK sends them through ``extra_body``)."""

RESPONSES_FIELDS: dict[str, FieldRule] = {
    **COMMON_FIELDS,
    "input": SUPPORTED, "instructions": SUPPORTED, "max_output_tokens": SUPPORTED,
    "previous_response_id": FieldRule("supported", "responses of the same session"),
    "include": FieldRule("supported", "message.output_text.logprobs supported; "
                         "reasoning.encrypted_content has no effect (no reasoning items; "
                         "listed in ignored_fields); others refused", _include,
                         _include_hints),
    "text": FieldRule("enforced", "format text supported; json_object / json_schema: enforced "
                      "by the engine, else refused; verbosity has no effect (listed in "
                      "ignored_fields)", _text, hint_parts("verbosity")),
    "max_tool_calls": no_effect_rule("accepted (it limits hosted tools, and none are served) and "
                                 "listed in ignored_fields; refused with strict_fields"),
    "truncation": refused_rule("truncation auto: a prompt over the context is an error instead",
                           _only("disabled", why="truncation auto is not served: a prompt "
                                 "over the context is an error")),
    "reasoning": FieldRule("no effect", "effort: " + EFFORT_NOTE + "; summary: no effect (no "
                           "reasoning items), listed likewise", _reasoning,
                           hint_parts(*_REASONING_KEYS)),
    "conversation": refused_rule("conversation objects: use previous_response_id"),
    "background": refused_rule("background responses"),
    "background_options": refused_rule("background responses"),
    "prompt": refused_rule("stored prompt templates"),
    "context_management": refused_rule("server-side context compaction"),
    "access_programs": refused_rule("hosted tool programs"),
    "image": refused_rule("image generation"),
}
"""Every field of ``POST /v1/responses``."""

def check_fields(body: Mapping[str, Any], rules: Mapping[str, FieldRule],
                 enforces: frozenset[str]) -> frozenset[str]:
    """Apply ``rules`` to a decoded request body; returns the constraints in force.

    Raises:
        FinalError: a refused field or value, an unknown field, or a constraint the engine
            does not enforce (404, ``unsupported_parameter``, ``param`` names the field).
    """
    needed: set[str] = set()
    for name, value in body.items():
        rule = rules.get(name)
        if rule is None:
            raise FinalError(f"unknown request field {name!r}: the proxy refuses what it "
                             "cannot honour", param=name, code="unsupported_parameter")
        check = rule.check or check_served
        try:
            need = check(value, body)
        except Refuse as exc:
            raise FinalError(f"{name}: {exc} (refused by the proxy)", param=name,
                             code="unsupported_parameter") from None
        except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong shape
            detail = f" ({exc})" if type(exc) is ValueError and exc.args else ""
            raise ProxyRequestError(f"{name}: invalid value{detail}", param=name,
                                    code="invalid_value") from None
        for one in (need,) if isinstance(need, str) else need or ():
            if one not in enforces:
                raise FinalError(f"{name}: {one} is a decoding constraint this engine does "
                                 "not enforce (refused, not ignored)", param=name,
                                 code="unsupported_parameter")
            needed.add(one)
    return frozenset(needed)
