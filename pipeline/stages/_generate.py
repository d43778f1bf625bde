"""``Generate``: one assistant turn from the engine, appended token-exact.

Length budget: a turn may sample at most ``min(per-turn cap, response budget left, context
left)`` tokens, where the per-turn cap is ``sampling.max_tokens``, the response budget is
``sampling.max_response_tokens`` minus the response so far (model and tool tokens), and the
context is the engine's ``max_model_len`` minus prompt and response. When the turn ends on that
limit (or nothing is left), the sample ends with ``finish_reason=length``,
``exit_reason="length"`` and ``raw_finish_reason`` naming the limit: one of
:data:`LENGTH_LIMITS`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from pipeline import artifacts as A
from pipeline._data.messages import assistant_message
from pipeline._data.models import (
    NOT_SAMPLED,
    TOOL_CALL_ERRORS,
    AgentMessage,
    AgentRolloutItem,
    ExitReason,
    FinishReason,
)
from pipeline._exceptions import ConfigError, ContractError, SampleAborted, StageDefinitionError
from pipeline._runner.context import Context
from pipeline._text import integrity
from pipeline._text.render import decode_text
from pipeline._text.tokenizer import Tokenizer
from pipeline.multimodal import multi_modal_inputs
from pipeline.tools import (
    HermesToolParser,
    ToolParser,
    load_vllm_parsers,
    make_tool_parser,
    needs_vllm,
    read_turn,
)

if TYPE_CHECKING:
    from pipeline.engines import Generation

_BUILDING = threading.Lock()
"""Held while a vLLM parser is built (module-wide: a stage instance stays picklable)."""

LENGTH_LIMITS = ("max_tokens", "response_budget", "context")
"""``raw_finish_reason`` values of a sample that ended on length, by the limit that hit."""


def check_positive_int(owner: str, **values: int | None) -> None:
    """Refuse a stage option that is not None or an int >= 1, naming it."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ConfigError(f"{owner}: {name} must be an int >= 1, got {value!r}",
                              field=name)


def length_limits(item: AgentRolloutItem, max_model_len: int | None) -> dict[str, int]:
    """Tokens the next turn may still sample under each limit (see the module doc)."""
    art = item.artifacts
    used = len(art.get(A.RESPONSE_IDS, ()))
    limits = {"max_tokens": item.sampling.max_tokens}
    if item.sampling.max_response_tokens is not None:
        limits["response_budget"] = item.sampling.max_response_tokens - used
    if max_model_len is not None:
        limits["context"] = max_model_len - len(art.get(A.PROMPT_IDS, ())) - used
    return limits


def end_on_length(item: AgentRolloutItem, limit: str) -> None:
    """End the agent loop because ``limit`` (one of :data:`LENGTH_LIMITS`) ran out."""
    item.finish_reason, item.raw_finish_reason = FinishReason.LENGTH, limit
    item.artifacts[A.EXIT_REASON] = ExitReason.LENGTH.value


def _binding(limits: dict[str, int]) -> str:
    """The limit that allows the fewest tokens; on ties the one that ends the sample anyway."""
    return min(("context", "response_budget", "max_tokens"),
               key=lambda name: limits.get(name, 1 << 62))


class Generate:
    """Ask the engine to continue the conversation's token ids; append what it sampled.

    Reads ``prompt_ids`` and the response so far; appends the sampled tokens to
    ``response_ids`` with ``response_mask = 1`` and their ``logprobs``, and an assistant
    :class:`AgentMessage` carrying the same ids, the decoded text and the tool calls the parser
    found (unreadable calls are kept, with their errors under the message's
    ``tool_call_errors``). Cancelling the stage (timeout, abort) aborts the engine request; an
    engine abort ends the sample as aborted.

    Token integrity (``PipelineConfig.token_integrity_checks``, on by default): before the
    turn, the prompt must still extend the previous turn's sequence; after it, one logprob per
    sampled token, and the ids must decode to the engine's own text when it reports one. A
    failed check raises :class:`~pipeline.TokenIntegrityError`: the sample is quarantined
    (``failed``, masked) with ``artifacts.TOKEN_INTEGRITY`` set to the reason.

    Model families (:mod:`pipeline.families`): ``family="qwen3"`` reads turns with the
    family's tool and reasoning parsers (its record's ``tool_parser``/``reasoning_parser``,
    vLLM's names) and stops on the family's stop ids (added to ``sampling.stop_token_ids``:
    gpt-oss's ``<|call|>``, Llama 3.1's ``<|eom_id|>``). Reasoning the parser takes out of the
    turn becomes the message's ``reasoning_content``; the trainer's tokens stay the sampled ones.

    Args:
        parser: finds tool calls in the decoded text (default :class:`HermesToolParser`, or
            the family's); an instance, used as given.
        parse_tool_calls: False keeps the text as content and looks for no calls.
        max_model_len: context limit; default: the engine's ``max_model_len`` if it has one.
        family: a name of :data:`pipeline.families.FAMILIES`: its parsers and stop ids.
        tool_parser: a vLLM tool parser name, instead of the family's (``"llama3_json"``).
        reasoning_parser: a vLLM reasoning parser name, instead of the family's (``"qwen3"``).
            vLLM parsers are built with the pipeline's tokenizer at the first turn; their
            names are checked here.

    Raises:
        ConfigError: an unknown family or parser name, or vLLM missing for a vLLM parser (the
            message names the field).
        StageDefinitionError: ``parser`` is not a parser instance, or is given beside names.
    """

    name = "generate"
    requires: ClassVar[Mapping[str, str]] = MappingProxyType({A.PROMPT_IDS: "BuildPrompt"})
    provides = frozenset({A.RESPONSE_IDS, A.RESPONSE_MASK, A.LOGPROBS, A.TURNS, A.MESSAGES,
                          A.EXIT_REASON, A.RAW_FINISH_REASON, A.POLICY_VERSION,
                          A.TOKEN_VERSIONS, A.ROUTED_EXPERTS, A.TOKEN_INTEGRITY})

    def __init__(self, *, parser: ToolParser | None = None, parse_tool_calls: bool = True,
                 max_model_len: int | None = None, family: str | None = None,
                 tool_parser: str | None = None, reasoning_parser: str | None = None) -> None:
        check_positive_int("Generate", max_model_len=max_model_len)
        if isinstance(parser, type) or (parser is not None
                                        and not callable(getattr(parser, "parse", None))):
            raise StageDefinitionError(f"Generate: parser must be a tool-call parser instance "
                                       f"(HermesToolParser()), got {parser!r}")
        if parser is not None and (tool_parser or reasoning_parser):
            raise StageDefinitionError("Generate: give parser (an instance) or tool_parser/"
                                       "reasoning_parser (vLLM names), not both")
        self.stop_token_ids: tuple[int, ...] = ()
        self._stop_tokens: tuple[str, ...] = ()
        if family is not None:
            from pipeline.families import get_family  # plain records, cheap

            try:
                record = get_family(family)
            except KeyError as exc:
                raise ConfigError(f"Generate: family: {exc.args[0]}", field="family") from None
            self.stop_token_ids = record.stop_token_ids
            self._stop_tokens = record.stop_tokens
            if parser is None:
                tool_parser = tool_parser or record.tool_parser
                reasoning_parser = reasoning_parser or record.reasoning_parser
        self.parser_names = (tool_parser, reasoning_parser)
        if needs_vllm(tool_parser, reasoning_parser):
            load_vllm_parsers(tool_parser, reasoning_parser)  # a bad name fails here
        self.parser: ToolParser | None = None
        self._built_for: object = None
        self._stops_checked_for: object = None
        if parse_tool_calls:
            if parser is not None:
                self.parser = parser
            elif not needs_vllm(tool_parser, reasoning_parser):
                self.parser = HermesToolParser()
        self.parse_tool_calls = parse_tool_calls
        self.max_model_len = max_model_len

    def _check_stops(self, tokenizer: Tokenizer | None) -> None:
        """Refuse a family whose stop ids are other tokens in the pipeline's tokenizer (a
        Llama family on a Qwen tokenizer would stop on whatever those ids are there)."""
        if not self._stop_tokens or tokenizer is None or tokenizer is self._stops_checked_for:
            return
        for text, token_id in zip(self._stop_tokens, self.stop_token_ids, strict=True):
            found = decode_text(tokenizer, [token_id], skip_special_tokens=False)
            if found != text:
                raise ConfigError(f"Generate: family's stop token {text!r} is id {token_id}, "
                                  f"which is {found!r} in the pipeline's tokenizer: not this "
                                  "family's tokenizer", field="family")
        self._stops_checked_for = tokenizer

    async def _parser_for(self, tokenizer: object) -> ToolParser | None:
        """The parser; a vLLM one is built with the pipeline's tokenizer at its first turn
        (and again if this stage runs with another tokenizer), in a worker thread: building
        imports vLLM's parser modules and loads harmony's encoding (seconds)."""
        if (not self.parse_tool_calls or not needs_vllm(*self.parser_names) or tokenizer is None
                or self._built_for is tokenizer):
            return self.parser
        return await asyncio.to_thread(self._build_parser, tokenizer)

    def _build_parser(self, tokenizer: object) -> ToolParser | None:
        with _BUILDING:  # the first turns of many samples arrive together: build once
            if self._built_for is not tokenizer:
                self.parser = make_tool_parser(tokenizer, *self.parser_names)
                self._built_for = tokenizer
            return self.parser

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        art = item.artifacts
        # The response lists are made once the engine answered (or the turn ended before
        # it): a first turn waiting on the engine holds no empty lists, three objects per
        # sample in flight for the collector to walk.
        so_far = art.get(A.RESPONSE_IDS, ())
        try:
            max_model_len = self.max_model_len or getattr(ctx.engine, "max_model_len", None)
            limits = length_limits(item, max_model_len)
            limit = _binding(limits)
            max_tokens = limits[limit]
            if max_tokens <= 0:
                end_on_length(item, limit)
                return
            self._check_stops(ctx.resources.tokenizer)
            turn = art.get(A.TURNS, 0)
            check = ctx.config.token_integrity_checks
            if check:
                bad = integrity.loop_prefix_mismatch(art, art[A.PROMPT_IDS], so_far)
                if bad is not None:
                    self._quarantine(item, integrity.PREFIX, turn, bad)
            request_id = f"{item.uid}-{turn}"
            sampling = item.sampling
            update: dict[str, object] = {}
            if max_tokens != sampling.max_tokens:
                update["max_tokens"] = max_tokens
            if not set(self.stop_token_ids) <= set(sampling.stop_token_ids):
                update["stop_token_ids"] = tuple(dict.fromkeys([*sampling.stop_token_ids,
                                                                *self.stop_token_ids]))
            if update:
                sampling = sampling.model_copy(update=update)
            try:
                # A first turn sends the prompt's list itself (engines never change it): a copy
                # per sample would be held for the whole engine call.
                ids = [*art[A.PROMPT_IDS], *so_far] if so_far else art[A.PROMPT_IDS]
                images = multi_modal_inputs(art)  # only engines that take images get the keyword
                engine: Any = ctx.engine  # ``multi_modal`` is an optional keyword of engines
                gen = await (engine.generate(ids, sampling, request_id) if images is None else
                             engine.generate(ids, sampling, request_id, multi_modal=images))
            except asyncio.CancelledError:
                await ctx.abort_engine_request(request_id)
                raise
        finally:
            response: list[int] = art.setdefault(A.RESPONSE_IDS, [])
            mask: list[int] = art.setdefault(A.RESPONSE_MASK, [])
            logprobs: list[float] = art.setdefault(A.LOGPROBS, [])
        if gen.finish_reason is FinishReason.ABORT:
            raise SampleAborted(f"engine aborted request {request_id}")
        if check:
            bad = integrity.logprobs_mismatch(gen.token_ids, gen.logprobs)
            if bad is not None:
                self._quarantine(item, integrity.LOGPROBS, turn, bad)
        art[A.TURNS] = turn + 1
        response.extend(gen.token_ids)
        mask.extend([1] * len(gen.token_ids))
        logprobs.extend(gen.logprobs)
        self._record_versions(art, gen, len(response) - len(gen.token_ids))
        if gen.routed_experts is not None:
            art[A.ROUTED_EXPERTS] = gen.routed_experts
        text = self._decode(ctx, gen.token_ids)
        if check:
            if gen.text is not None and text is not None:
                bad = integrity.decode_mismatch(text, gen.text)
                if bad is not None:
                    self._quarantine(item, integrity.DECODE, turn, bad)
            integrity.mark_turn(art, art[A.PROMPT_IDS], response)
        parser = await self._parser_for(ctx.resources.tokenizer)
        art.setdefault(A.MESSAGES, []).append(self._message(item, ctx, parser, text, gen.token_ids,
                                                             gen.logprobs, gen.finish_reason))
        if gen.finish_reason is FinishReason.LENGTH:
            end_on_length(item, "context" if gen.raw_finish_reason == "context" else limit)
        else:
            item.finish_reason, item.raw_finish_reason = gen.finish_reason, gen.raw_finish_reason

    @staticmethod
    def _record_versions(art: dict[str, Any], gen: Generation, start: int) -> None:
        """Per-token policy versions: the engine's own where it tracks them per token, else
        the generation's version for each of its tokens; tokens before ``start`` that no turn
        stamped (tool output) get :data:`NOT_SAMPLED`. ``POLICY_VERSION`` stays the oldest."""
        per_token = gen.token_versions
        if per_token is None and gen.policy_version is not None:
            per_token = [gen.policy_version] * len(gen.token_ids)
        if per_token is None:
            return
        if len(per_token) != len(gen.token_ids):
            raise ContractError(f"the engine reported {len(per_token)} token versions for "
                                f"{len(gen.token_ids)} tokens")
        versions: list[int] = art.setdefault(A.TOKEN_VERSIONS, [])
        versions.extend([NOT_SAMPLED] * (start - len(versions)))
        versions.extend(per_token)
        oldest = min(per_token, default=gen.policy_version)
        if oldest is not None:
            earlier = art.get(A.POLICY_VERSION)
            art[A.POLICY_VERSION] = oldest if earlier is None else min(earlier, oldest)

    @staticmethod
    def _decode(ctx: Context, token_ids: list[int]) -> str | None:
        """The text the agent sees: the same decode the parser reads."""
        tokenizer = ctx.resources.tokenizer
        return decode_text(tokenizer, token_ids, skip_special_tokens=True) if tokenizer else None

    @staticmethod
    def _quarantine(item: AgentRolloutItem, reason: str, turn: int, detail: str) -> None:
        """Fail the sample (masked) with the check's reason; the batch goes on."""
        item.artifacts[A.TOKEN_INTEGRITY] = reason
        raise integrity.fail(reason, turn, detail)

    @staticmethod
    def _message(item: AgentRolloutItem, ctx: Context, parser: ToolParser | None,
                 text: str | None, token_ids: list[int], logprobs: list[float],
                 finish_reason: FinishReason) -> AgentMessage:
        tokenizer = ctx.resources.tokenizer
        if (text is None or tokenizer is None or finish_reason is not FinishReason.STOP
                or parser is None):
            return assistant_message(text, token_ids, logprobs, finish_reason)
        # finish_reason stop: the last token is the stop token that closed the turn
        parsed, content = read_turn(parser, tokenizer, text, token_ids, closed=True)
        extra: dict[str, object] = {}
        if parsed.reasoning is not None:
            extra["reasoning_content"] = parsed.reasoning
        if not parsed.calls:
            return assistant_message(content, token_ids, logprobs, finish_reason, extra=extra)
        turn = item.artifacts[A.TURNS] - 1
        calls = [c.to_tool_call(f"call_{turn}_{i}") for i, c in enumerate(parsed.calls)]
        errors = {call.id: c.error for call, c in zip(calls, parsed.calls, strict=True)
                  if c.error is not None}
        if errors:
            extra[TOOL_CALL_ERRORS] = errors
        return assistant_message(content, token_ids, logprobs, finish_reason,
                                 tool_calls=calls, extra=extra)
