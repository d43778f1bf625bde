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
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

from pipeline import artifacts as A
from pipeline._data.models import (
    TOOL_CALL_ERRORS,
    AgentMessage,
    AgentRolloutItem,
    ExitReason,
    FinishReason,
)
from pipeline._exceptions import ConfigError, SampleAborted, StageDefinitionError
from pipeline._runner.context import Context
from pipeline._text import integrity
from pipeline._text.render import decode_text
from pipeline.tools import HermesToolParser, ToolParser

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

    Args:
        parser: finds tool calls in the decoded text (default :class:`HermesToolParser`).
        parse_tool_calls: False keeps the text as content and looks for no calls.
        max_model_len: context limit; default: the engine's ``max_model_len`` if it has one.
    """

    name = "generate"
    requires: ClassVar[Mapping[str, str]] = MappingProxyType({A.PROMPT_IDS: "BuildPrompt"})
    provides = frozenset({A.RESPONSE_IDS, A.RESPONSE_MASK, A.LOGPROBS, A.TURNS, A.MESSAGES,
                          A.EXIT_REASON, A.RAW_FINISH_REASON, A.POLICY_VERSION,
                          A.ROUTED_EXPERTS, A.TOKEN_INTEGRITY})

    def __init__(self, *, parser: ToolParser | None = None, parse_tool_calls: bool = True,
                 max_model_len: int | None = None) -> None:
        check_positive_int("Generate", max_model_len=max_model_len)
        if isinstance(parser, type) or (parser is not None
                                        and not callable(getattr(parser, "parse", None))):
            raise StageDefinitionError(f"Generate: parser must be a tool-call parser instance "
                                       f"(HermesToolParser()), got {parser!r}")
        self.parser: ToolParser | None = None
        if parse_tool_calls:
            self.parser = parser if parser is not None else HermesToolParser()
        self.max_model_len = max_model_len

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        art = item.artifacts
        response: list[int] = art.setdefault(A.RESPONSE_IDS, [])
        mask: list[int] = art.setdefault(A.RESPONSE_MASK, [])
        logprobs: list[float] = art.setdefault(A.LOGPROBS, [])
        max_model_len = self.max_model_len or getattr(ctx.engine, "max_model_len", None)
        limits = length_limits(item, max_model_len)
        limit = _binding(limits)
        max_tokens = limits[limit]
        if max_tokens <= 0:
            end_on_length(item, limit)
            return
        turn = art.get(A.TURNS, 0)
        check = ctx.config.token_integrity_checks
        if check:
            bad = integrity.loop_prefix_mismatch(art, art[A.PROMPT_IDS], response)
            if bad is not None:
                self._quarantine(item, integrity.PREFIX, turn, bad)
        request_id = f"{item.uid}-{turn}"
        sampling = item.sampling
        if max_tokens != sampling.max_tokens:
            sampling = sampling.model_copy(update={"max_tokens": max_tokens})
        try:
            gen = await ctx.engine.generate([*art[A.PROMPT_IDS], *response], sampling, request_id)
        except asyncio.CancelledError:
            await ctx.abort_engine_request(request_id)
            raise
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
        if gen.policy_version is not None:
            art[A.POLICY_VERSION] = gen.policy_version
        if gen.routed_experts is not None:
            art[A.ROUTED_EXPERTS] = gen.routed_experts
        text = self._decode(ctx, gen.token_ids)
        if check:
            if gen.text is not None and text is not None:
                bad = integrity.decode_mismatch(text, gen.text)
                if bad is not None:
                    self._quarantine(item, integrity.DECODE, turn, bad)
            integrity.mark_turn(art, art[A.PROMPT_IDS], response)
        art.setdefault(A.MESSAGES, []).append(self._message(item, text, gen.token_ids,
                                                             gen.logprobs, gen.finish_reason))
        if gen.finish_reason is FinishReason.LENGTH:
            end_on_length(item, "context" if gen.raw_finish_reason == "context" else limit)
        else:
            item.finish_reason, item.raw_finish_reason = gen.finish_reason, gen.raw_finish_reason

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

    def _message(self, item: AgentRolloutItem, text: str | None, token_ids: list[int],
                 logprobs: list[float], finish_reason: FinishReason) -> AgentMessage:
        if text is None or finish_reason is not FinishReason.STOP:
            return AgentMessage(role="assistant", content=text, token_ids=token_ids,
                                logprobs=logprobs, finish_reason=finish_reason)
        parsed = self.parser.parse(text) if self.parser is not None else None
        if parsed is None or not parsed.calls:
            return AgentMessage(role="assistant", content=text, token_ids=token_ids,
                                logprobs=logprobs, finish_reason=finish_reason)
        turn = item.artifacts[A.TURNS] - 1
        calls = [c.to_tool_call(f"call_{turn}_{i}") for i, c in enumerate(parsed.calls)]
        errors = {call.id: c.error for call, c in zip(calls, parsed.calls, strict=True)
                  if c.error is not None}
        extra = {TOOL_CALL_ERRORS: errors} if errors else {}
        return AgentMessage(role="assistant", content=parsed.content or None, tool_calls=calls,
                            token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason,
                            **extra)
