"""Tool-call parsers: find the calls in an assistant turn's text.

A parser never raises on model output: a call it cannot read comes back with ``error`` set,
so the agent loop can answer it with an error message the model sees, and count it.
``HermesToolParser`` reads ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
(Hermes / Qwen style). Other formats plug in through the :class:`ToolParser` protocol;
:class:`~pipeline.tools.VLLMToolParser` brings vLLM's parsers for them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline._data.messages import tool_call
from pipeline._data.models import ToolCall
from pipeline._text.render import decode_text


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call found in the text.

    Attributes:
        name: the tool name, when it could be read.
        arguments: the decoded argument object, when it could be read.
        raw: the call's text as the model wrote it (inside the markers).
        error: why the call is unusable (malformed JSON, no name, ...), or None.
    """

    name: str | None
    arguments: dict[str, Any] | None
    raw: str
    error: str | None = None

    def to_tool_call(self, call_id: str) -> ToolCall:
        """The OpenAI wire form; an unreadable call keeps its raw text as ``arguments``
        (built without validation: no field set of its own per call)."""
        arguments = (self.raw if self.arguments is None
                     else json.dumps(self.arguments, ensure_ascii=False))
        return tool_call(call_id, self.name or "", arguments)


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    """An assistant turn split into its text, its tool calls and its reasoning.

    ``reasoning`` is the thinking a reasoning parser took out of the text (``<think>`` blocks,
    harmony's analysis channel), or None when the turn has none or the parser reads none.
    """

    content: str
    calls: list[ParsedToolCall] = field(default_factory=list)
    reasoning: str | None = None


@runtime_checkable
class ToolParser(Protocol):
    """Finds tool calls in the decoded text of one assistant turn. Must never raise.

    A parser whose format uses special tokens (Llama 3.1's ``<|python_tag|>``, harmony's
    channels) sets ``needs_special_tokens = True``: :class:`~pipeline.Generate` then passes the
    turn decoded with special tokens kept, without its final stop token. Without the
    attribute it gets the text the agent sees (special tokens skipped).
    """

    name: str

    def parse(self, text: str) -> ParsedMessage:
        """Split ``text`` into content and calls."""
        ...


def read_turn(parser: ToolParser, tokenizer: Any, text: str, token_ids: Sequence[int], *,
              closed: bool) -> tuple[ParsedMessage, str | None]:
    """Parse one assistant turn: what ``parser`` found, and the message's content.

    Args:
        parser: the turn's parser.
        tokenizer: the tokenizer the ids decode with.
        text: the turn as the agent sees it (decoded without special tokens).
        token_ids: the turn's sampled ids.
        closed: the last id is the token that closed the turn (a stop token).

    A parser that sets ``needs_special_tokens`` reads the turn decoded with them kept (Llama
    3.1's ``<|python_tag|>``, harmony's channels), without the closing token, which is not
    part of the message (it would read Llama's ``<|eot_id|>`` or harmony's ``<|call|>`` as
    text). The content is the parser's when it split off calls or reasoning or read markup
    (with special tokens dropped, harmony's ``<|channel|>final<|message|>`` decodes to
    ``finalAnswer``), else ``text``; None when empty.
    """
    special = bool(getattr(parser, "needs_special_tokens", False))
    if special:
        ids = list(token_ids[:-1] if closed else token_ids)
        parsed = parser.parse(decode_text(tokenizer, ids, skip_special_tokens=False))
    else:
        parsed = parser.parse(text)
    split = bool(parsed.calls) or special or parsed.reasoning is not None
    return parsed, (parsed.content or None) if split else text


class HermesToolParser:
    """Hermes-style calls: ``<tool_call>`` + a JSON object with ``name`` and ``arguments`` +
    ``</tool_call>``; everything outside the blocks is the message content.

    ``arguments`` may be an object or a JSON string that holds an object (some models quote
    it). An unterminated last block (generation cut short) is a call with an error.

    Args:
        start: the opening marker.
        end: the closing marker.
    """

    name = "hermes"

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.start = start
        self.end = end
        self._block = re.compile(re.escape(start) + "(.*?)" + re.escape(end), re.DOTALL)

    def parse(self, text: str) -> ParsedMessage:
        """Split ``text`` into content (stripped) and calls, in order."""
        calls: list[ParsedToolCall] = []
        pieces: list[str] = []
        position = 0
        for match in self._block.finditer(text):
            pieces.append(text[position:match.start()])
            calls.append(_read_call(match.group(1)))
            position = match.end()
        rest = text[position:]
        cut = rest.find(self.start)
        if cut >= 0:
            raw = rest[cut + len(self.start):]
            calls.append(ParsedToolCall(None, None, raw, f"unterminated tool call: no {self.end}"))
            rest = rest[:cut]
        pieces.append(rest)
        return ParsedMessage("".join(pieces).strip(), calls)


def _read_call(raw: str) -> ParsedToolCall:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return ParsedToolCall(None, None, raw, f"tool call is not valid JSON: {_short(exc)}")
    if not isinstance(data, dict):
        return ParsedToolCall(None, None, raw, "tool call must be a JSON object with "
                                               "'name' and 'arguments'")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ParsedToolCall(None, None, raw, "tool call has no 'name' string")
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            return ParsedToolCall(name, None, raw,
                                  f"'arguments' is not a JSON object: {_short(exc)}")
    if not isinstance(arguments, dict):
        return ParsedToolCall(name, None, raw, "'arguments' must be a JSON object")
    return ParsedToolCall(name, arguments, raw)


def _short(exc: BaseException) -> str:
    return str(exc)[:120] or type(exc).__name__
