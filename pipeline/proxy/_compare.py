"""How the proxy compares an agent's messages with the ones it recorded: in a normalised form
(``developer`` = ``system``, ``None`` content = ``""``, assistant text stripped, tool-call
arguments compared as parsed JSON, call ids ignored, an image part by its URL's digest). Once a
message matched, the history keeps the agent's own dict for it, so the next request compares
with one dict equality.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pipeline._data.models import AgentMessage
from pipeline.proxy._wire import WireMessage


def message_key(message: WireMessage | AgentMessage) -> tuple[Any, ...]:
    """The normalised form two messages are compared in (see the module doc)."""
    role = "system" if message.role == "developer" else message.role
    text = content_text(message.content)
    # an image part by its place among the parts (text before or after it renders
    # differently) and its URL's digest
    images = tuple((j, _digest(p.url)) for j, p in message.image_parts()) if isinstance(
        message, WireMessage) else ()
    calls: tuple[tuple[str, str], ...] = ()
    if message.tool_calls:
        calls = tuple((c.function.name, _canonical_arguments(c.function.arguments))
                      for c in message.tool_calls)
    if role == "assistant":
        return (role, text.strip(), calls)
    return (role, text, calls, message.tool_call_id, message.name, images)


def _digest(url: str) -> str:
    """What an image part is compared by: the digest of its URL (the key never holds the
    image)."""
    return hashlib.sha256(url.encode()).hexdigest()


def content_text(content: Any) -> str:
    """The text of a message content: a string, ``None`` (``""``) or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "") if isinstance(p, dict) else getattr(p, "text", ""))
                   for p in content)


def _canonical_arguments(arguments: str | dict[str, Any]) -> str:
    value: Any = arguments
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):
            return arguments.strip()
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return repr(arguments)


def same_tools(recorded: list[dict[str, Any]] | None, sent: list[dict[str, Any]] | None) -> bool:
    """Whether a request sent the tools a segment was rendered with (key order aside)."""
    if recorded == sent:
        return True
    if not recorded or not sent:
        return not recorded and not sent
    return json.dumps(recorded, sort_keys=True) == json.dumps(sent, sort_keys=True)
