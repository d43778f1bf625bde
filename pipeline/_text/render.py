"""Chat-template rendering the agent loop builds on (used by stages, judgers and the proxy).

Token accounting across turns: the prompt is the template's rendering of the row's messages
(with tool schemas) plus the generation prompt. Later, each tool/observation turn is tokenized
as the *delta* between two small renderings: the last assistant turn alone (after the last user
message) and the same plus the new messages plus the generation prompt. Only that delta is
tokenized and appended; the model's own tokens are never re-tokenized. If the second rendering
does not extend the first (the template rewrites history: not prefix-stable, e.g. Qwen3 drops
an empty ``<think>`` block from an assistant turn that is no longer the last), the model's
sampled tokens are kept and the delta is what the template renders after that turn's stop
token; this, a missing stop token, or a delta that does not tokenize the same on its own as
after the model's last token, is template drift: recorded, never an error.
"""

from __future__ import annotations

import contextlib
import json
import sys
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline._data.models import AgentMessage
from pipeline._text.tokenizer import Tokenizer

DRIFT_PREFIX = "prefix"
"""Rendering the conversation plus new messages rewrote what was rendered before (the delta
is then taken after the assistant turn's stop token; the sampled tokens are kept)."""
DRIFT_CLOSING = "closing"
"""The template's assistant turn does not contain the token the model stopped on."""
DRIFT_BOUNDARY = "boundary"
"""The delta tokenizes differently on its own than after the model's last token."""


def render_prompt(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
                  tools: Sequence[dict[str, Any]] | None,
                  options: Mapping[str, Any] | None = None) -> tuple[str, list[int]]:
    """Render ``messages`` (with tool schemas) for generation and tokenize the text.

    Returns:
        ``(raw_prompt, prompt_ids)``.
    """
    text = render(tokenizer, messages, tools, add_generation_prompt=True, options=options)
    return text, encode_text(tokenizer, text)


def render(tokenizer: Tokenizer, messages: Sequence[dict[str, Any]],
           tools: Sequence[dict[str, Any]] | None, *, add_generation_prompt: bool,
           options: Mapping[str, Any] | None = None) -> str:
    """The chat template's text for ``messages`` (never token ids). ``options`` are the
    template's own variables (``enable_thinking``, ``reasoning_effort``, ...)."""
    kwargs: dict[str, Any] = {**options} if options else {}
    kwargs["tokenize"], kwargs["add_generation_prompt"] = False, add_generation_prompt
    if tools:
        kwargs["tools"] = list(tools)
    listed = list(messages)
    if any(_string_arguments(m) for m in listed) and _wants_object_arguments(tokenizer):
        listed = [_with_object_arguments(m) for m in listed]
    text = tokenizer.apply_chat_template(listed, **kwargs)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


# Tool-call arguments: OpenAI's messages carry them as a JSON string, and most chat templates
# want an object (transformers' convention): Qwen2.5's, Llama 3.1's and gpt-oss's pass a string
# through ``tojson`` and render the call double-encoded (``"{\"e\": ...}"``), which is not
# what the model was trained on. DeepSeek-V3's concatenates the string and fails on an object;
# Qwen3's and this project's tiny template take either. Which one a template wants is found
# once per template, by rendering a probe call both ways.
_PROBE_ARGUMENTS = '{"probe_key": "probe_value"}'
_OBJECT_ARGUMENTS: weakref.WeakKeyDictionary[Any, dict[Any, bool]] = weakref.WeakKeyDictionary()


def _wants_object_arguments(tokenizer: Tokenizer) -> bool:
    """Whether the chat template renders a call's arguments right only as an object: the
    string form does not show the arguments' JSON as written, the object form does."""
    template = getattr(tokenizer, "chat_template", None)
    key = template if isinstance(template, str) else repr(template)
    try:
        known = _OBJECT_ARGUMENTS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: probe every time
        known = {}
    if key not in known:
        known[key] = (not _shows_probe(tokenizer, _PROBE_ARGUMENTS)
                      and _shows_probe(tokenizer, json.loads(_PROBE_ARGUMENTS)))
    return known[key]


def _shows_probe(tokenizer: Tokenizer, arguments: Any) -> bool:
    call = {"id": "probe", "type": "function",
            "function": {"name": "probe", "arguments": arguments}}
    probe: list[dict[str, Any]] = [{"role": "user", "content": "probe"},
                                   {"role": "assistant", "content": "", "tool_calls": [call]},
                                   {"role": "tool", "content": "probe",
                                    "tool_call_id": "probe", "name": "probe"}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False,
                                             add_generation_prompt=False)
    except Exception:  # a template that cannot render this form of the call
        return False
    return isinstance(text, str) and _PROBE_ARGUMENTS in text


def _string_arguments(message: Mapping[str, Any]) -> bool:
    return any(isinstance(call.get("function", {}).get("arguments"), str)
               for call in message.get("tool_calls") or ())


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with each call's JSON-object string arguments as the object; arguments
    that are not a JSON object (a model's broken call) stay the string it wrote."""
    if not _string_arguments(message):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function", {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def decode_text(tokenizer: Tokenizer, token_ids: list[int], *,
                skip_special_tokens: bool) -> str:
    """``tokenizer.decode(token_ids, ...)``, straight through the Rust tokenizer where that
    gives the same text: a Hugging Face fast tokenizer whose ``decode``/``_decode`` are the
    library's own and that does not clean up spaces. ``decode`` itself first converts the ids
    one by one (about 0.3 µs per token); a 256-token reply decodes in a third of the time.
    """
    backend = plain_fast_backend(tokenizer)
    if backend is None:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return str(backend.decode(token_ids, skip_special_tokens=skip_special_tokens))


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)``, straight through the Rust
    tokenizer where that is provably the same (:func:`plain_fast_backend`): the library's
    ``encode`` costs about 10 µs more per call, paid several times per proxy turn."""
    backend = plain_fast_backend(tokenizer, encoding=True)
    if backend is None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(backend.encode(text, add_special_tokens=False).ids)


def plain_fast_backend(tokenizer: Tokenizer, *, encoding: bool = False) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` if its ``decode`` (with
    ``encoding=True``: also its ``encode(text, add_special_tokens=False)``) adds nothing to
    the Rust tokenizer's: the library's own methods, not overridden on the class or the
    instance, no space clean-up, and for encoding no special-token splitting and no padding or
    truncation configured on the Rust side (``encode`` would switch those off first)."""
    fast = sys.modules.get("transformers.tokenization_utils_tokenizers")
    base = sys.modules.get("transformers.tokenization_utils_base")
    if fast is None or base is None:  # not a transformers tokenizer (or none loaded)
        return None
    cls, own = type(tokenizer), getattr(tokenizer, "__dict__", {})
    backend = getattr(tokenizer, "_tokenizer", None)
    methods = [("_decode", fast.TokenizersBackend), ("decode", base.PreTrainedTokenizerBase)]
    if encoding:
        methods += [("_encode_plus", fast.TokenizersBackend),
                    ("encode", base.PreTrainedTokenizerBase)]
    if backend is None or any(getattr(cls, name, None) is not getattr(where, name, 0)
                              or name in own for name, where in methods):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    if encoding and (getattr(tokenizer, "split_special_tokens", True) is not False
                     or getattr(backend, "truncation", 0) is not None
                     or getattr(backend, "padding", 0) is not None):
        return None
    return backend


def chat_form(message: AgentMessage) -> dict[str, Any]:
    """A message as the chat template wants it: OpenAI fields only, no engine facts.

    A None content (an assistant turn that only calls tools) is passed as ``""``: gpt-oss's
    template tests ``'x' in message.content`` (fails on None), DeepSeek-V3's reads the field
    (fails when it is left out), and the others render None and ``""`` alike (checked on the
    five families' templates).
    """
    data: dict[str, Any] = {"role": message.role,
                            "content": "" if message.content is None else message.content}
    if message.tool_calls:
        data["tool_calls"] = [call.model_dump(mode="json") for call in message.tool_calls]
    if message.tool_call_id is not None:
        data["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        data["name"] = message.name
    return data


@dataclass(frozen=True, slots=True)
class TurnDelta:
    """The template tokens between the model's last token and its next turn.

    Attributes:
        text: the rendered text: the rest of the assistant turn after its stop token (e.g.
            ``"\\n"``), the new messages, and the generation prompt.
        ids: ``text`` tokenized; appended with ``response_mask = 0``.
        drift: the kinds of template drift noticed (empty when the template behaved).
    """

    text: str
    ids: list[int]
    drift: tuple[str, ...]


def render_turn_delta(tokenizer: Tokenizer, conversation: Sequence[AgentMessage],
                      new_messages: Sequence[AgentMessage],
                      tools: Sequence[dict[str, Any]] | None, last_token: int,
                      options: Mapping[str, Any] | None = None) -> TurnDelta:
    """Tokenize what follows the last assistant turn of ``conversation`` once
    ``new_messages`` (tool results) are added, up to the next generation prompt.

    Renders only the last user message (if any) and the last assistant turn as context, so
    the cost does not grow with the conversation.

    Args:
        tokenizer: the tokenizer with the chat template.
        conversation: the messages so far; the last one is the assistant turn that called.
        new_messages: the messages to append.
        tools: the tool schemas the prompt was rendered with.
        last_token: the last token the model sampled (its stop token).
        options: the chat template's own variables, as the prompt was rendered with.
    """
    assistant = conversation[-1]
    anchor = next((m for m in reversed(conversation[:-1]) if m.role == "user"), None)
    context = [chat_form(m) for m in ([anchor] if anchor else []) + [assistant]]
    before = render(tokenizer, context, tools, add_generation_prompt=False, options=options)
    after = render(tokenizer, context + [chat_form(m) for m in new_messages], tools,
                   add_generation_prompt=True, options=options)
    drift: list[str] = []
    stable = after.startswith(before)
    if not stable:
        drift.append(DRIFT_PREFIX)
    stop_text = decode_text(tokenizer, [last_token], skip_special_tokens=False)
    at = before.rfind(stop_text) if stop_text else -1
    if at < 0:  # the model stopped on a token the template does not end turns with
        drift.append(DRIFT_CLOSING)
        text = after[len(before) if stable else _end_of_shared_tail(before, after):]
    elif stable:
        text = before[at + len(stop_text):] + after[len(before):]
    else:
        # The template renders the assistant turn differently once messages follow it (Qwen3
        # drops an empty <think> block from a turn that is no longer the last). The sampled
        # tokens stay as the model produced them; the delta is what the template renders
        # after that turn's stop token: the same-numbered stop token in ``after``, since every
        # message before it ends with one. Never a cut inside the turn, which would append a
        # garbled copy of the model's own text starting mid-token.
        end = _nth_occurrence(after, stop_text, before.count(stop_text, 0, at))
        if end >= 0:
            text = after[end + len(stop_text):]
        else:
            # The template closes the turn with another token once messages follow it
            # (gpt-oss: a final answer sampled to ``<|return|>`` shows as ``<|end|>`` in
            # history). The sampled token stays; the delta starts after the token the
            # template closes the turn's text with.
            text = after[_end_of_rewritten_closing(tokenizer, before[:at], after):]
    ids = encode_text(tokenizer, text)
    if at >= 0 and not _splits_cleanly_after(tokenizer, last_token) and (
            encode_text(tokenizer, stop_text + text) != [last_token, *ids]):
        drift.append(DRIFT_BOUNDARY)
    return TurnDelta(text, ids, tuple(drift))


_CLEAN_SPLITS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _splits_cleanly_after(tokenizer: Tokenizer, token: int) -> bool:
    """Whether ``token`` is an added token that strips no neighbouring whitespace: the
    tokenizer cuts the text at it before anything else, so what follows tokenizes the same
    with or without it, and the boundary needs no second encode (half of a turn's tokenizing).
    """
    try:
        clean = _CLEAN_SPLITS.get(tokenizer)
    except TypeError:  # not weak-referenceable: check every time
        clean = None
    if clean is None:
        decoder: Any = getattr(tokenizer, "added_tokens_decoder", None) or {}
        clean = frozenset(i for i, added in decoder.items()
                          if not getattr(added, "lstrip", True)
                          and not getattr(added, "rstrip", True))
        with contextlib.suppress(TypeError):
            _CLEAN_SPLITS[tokenizer] = clean
    return token in clean


def _end_of_shared_tail(before: str, after: str) -> int:
    """Where the last assistant turn ends in ``after`` when ``after`` rewrote it and its stop
    token is unknown: the end of the longest tail of ``before`` (past the point where the two
    differ) that ``after`` renders too. Qwen3: ``before`` ends ``<think>\\n\\n</think>\\n\\n
    <tool_call>...<|im_end|>\\n``, ``after`` has the same turn without the think block."""
    split = common_prefix_length(before, after)
    tail = before[split:]
    for start in range(len(tail)):  # longest first: a short tail (a newline) matches anywhere
        found = after.find(tail[start:], split)
        if found >= 0:
            return found + len(tail) - start
    return split


def _end_of_rewritten_closing(tokenizer: Tokenizer, turn: str, after: str) -> int:
    """Where the last assistant turn ends in ``after`` when the template closes it with
    another token than the one it was sampled with: past the end of the turn's text
    (``turn``: ``before`` up to the sampled stop token) as ``after`` renders it, and past
    the added token that follows it there, if one does."""
    end = _end_of_shared_tail(turn, after)
    closing = max((token for token in _added_token_texts(tokenizer)
                   if after.startswith(token, end)), key=len, default="")
    return end + len(closing)


def _added_token_texts(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The text of every added (special) token, e.g. ``<|end|>``."""
    decoder: Any = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(getattr(added, "content", str(added)) for added in decoder.values())


def _nth_occurrence(text: str, part: str, n: int) -> int:
    """Where the ``n``-th (from 0) occurrence of ``part`` starts in ``text``, or -1."""
    at = -1
    for _ in range(n + 1):
        at = text.find(part, at + 1)
        if at < 0:
            return -1
    return at


def common_prefix_length(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
