"""``CallTools``: run the last assistant turn's tool calls and append their tokens (mask 0).

Nothing a model writes makes this stage raise: an unreadable call, an unknown tool, arguments
that do not fit the tool's schema, a tool that raises or times out, each becomes a tool message
``"Error: ..."`` the model sees in its next turn, and is counted in ``tool_errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from pipeline import artifacts as A
from pipeline._concurrency.cancel import cancel_requested, run_owned
from pipeline._concurrency.slots import FifoSlots
from pipeline._data.models import TOOL_CALL_ERRORS, AgentMessage, AgentRolloutItem, ToolCall
from pipeline._runner.context import Context
from pipeline._text import integrity
from pipeline._text.render import render_turn_delta
from pipeline.stages._generate import check_positive_int, end_on_length, length_limits
from pipeline.stages._prompt import template_options
from pipeline.tools import Tool, validate_arguments

TOOL_CALLS = A.TOOL_CALLS
TOOL_ERRORS = A.TOOL_ERRORS
TEMPLATE_DRIFT = A.TEMPLATE_DRIFT
COUNTERS = (TOOL_CALLS, TOOL_ERRORS, TEMPLATE_DRIFT)
"""Per-sample counters, mirrored into ``extra_fields`` so they reach the trainer view."""

ERROR_KINDS = ("parse", "unknown_tool", "invalid_arguments", "timeout", "tool_exception",
               "too_many_calls")
"""Values of a tool message's ``error`` extra field."""


class CallTools:
    """Answers every tool call of the last assistant message, then tokenizes the new turn.

    Calls of one turn run concurrently, each under its tool's ``timeout_s``. Tool messages are
    appended to ``messages``; their template tokens (see
    :func:`~pipeline.stages._prompt.render_turn_delta`) are appended to ``response_ids`` with
    ``response_mask = 0`` and logprob 0.0. If those tokens would leave no room for another
    model token in the response budget or the context, they are not appended and the sample
    ends with ``finish_reason=length`` (``raw_finish_reason`` ``response_budget``/``context``).

    Args:
        max_calls_per_turn: calls beyond this are answered with an error, not run.
        max_result_chars: longer tool results are cut to this many characters.
        max_model_len: context limit; default: the engine's ``max_model_len`` if it has one.
        offload: render and tokenize turns larger than ``offload_chars`` (their new messages
            and the last assistant turn) in a worker thread, keeping the event loop free;
            smaller ones inline, where a thread hop costs more than the work.
        offload_chars: the size above which a turn goes to a worker thread.
    """

    name = "call_tools"
    requires: ClassVar[Mapping[str, str]] = MappingProxyType(
        {A.MESSAGES: "BuildPrompt", A.RESPONSE_IDS: "Generate"})
    provides = frozenset({A.MESSAGES, A.RESPONSE_IDS, A.RESPONSE_MASK, A.LOGPROBS,
                          A.TOOL_TURNS, A.TOOL_CALLS, A.TOOL_ERRORS, A.TEMPLATE_DRIFT,
                          A.LIMITER_WAIT_S, A.EXTRA_FIELDS})

    def __init__(self, *, max_calls_per_turn: int = 8, max_result_chars: int = 4096,
                 max_model_len: int | None = None, offload: bool = True,
                 offload_chars: int = 32768) -> None:
        check_positive_int("CallTools", max_calls_per_turn=max_calls_per_turn,
                           max_result_chars=max_result_chars, max_model_len=max_model_len,
                           offload_chars=offload_chars)
        self.max_calls_per_turn = max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.max_model_len = max_model_len
        self.offload = offload
        self.offload_chars = offload_chars
        # Concurrency slots per event loop and tool (weak: a finished loop takes its slots).
        self._slots: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, dict[str, FifoSlots]
        ] = weakref.WeakKeyDictionary()

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        art = item.artifacts
        messages: list[AgentMessage] = art.setdefault(A.MESSAGES, [])
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or not last.tool_calls:
            return
        parse_errors: dict[str, str] = (last.model_extra or {}).get(TOOL_CALL_ERRORS) or {}
        answers = await self._answer_all(last.tool_calls, parse_errors, item, ctx)
        replies = [AgentMessage(role="tool", tool_call_id=call.id, name=call.function.name,
                                content=content, **({"error": kind} if kind else {}))
                   for call, (content, kind) in zip(last.tool_calls, answers, strict=True)]
        errors = sum(1 for _, kind in answers if kind)
        self._count(art, TOOL_CALLS, len(replies))
        self._count(art, TOOL_ERRORS, errors)
        if errors:
            ctx.log.info("tool_errors", errors=errors,
                         kinds=sorted({kind for _, kind in answers if kind}))
        art[A.TOOL_TURNS] = art.get(A.TOOL_TURNS, 0) + 1
        history = list(messages)
        messages.extend(replies)
        await self._append_tokens(item, ctx, history, replies)

    async def _append_tokens(self, item: AgentRolloutItem, ctx: Context,
                             history: list[AgentMessage], replies: list[AgentMessage]) -> None:
        art = item.artifacts
        response: list[int] = art.setdefault(A.RESPONSE_IDS, [])
        last_token = response[-1] if response else (history[-1].token_ids or [-1])[-1]
        args = (ctx.tokenizer, history, replies, item.data.tools, last_token,
                template_options(item, ctx))
        size = sum(len(str(m.content or "")) for m in (history[-1], *replies))
        delta = (await asyncio.to_thread(render_turn_delta, *args)
                 if self.offload and size > self.offload_chars else render_turn_delta(*args))
        if delta.drift:
            self._count(art, TEMPLATE_DRIFT, 1)
            ctx.log.warning("template_drift", kinds=list(delta.drift))
        else:
            self._count(art, TEMPLATE_DRIFT, 0)
        max_model_len = self.max_model_len or getattr(ctx.resources.engine, "max_model_len",
                                                      None)
        limits = length_limits(item, max_model_len)
        for limit in ("context", "response_budget"):
            if limit in limits and limits[limit] - len(delta.ids) <= 0:
                end_on_length(item, limit)
                return
        response.extend(delta.ids)
        art.setdefault(A.RESPONSE_MASK, []).extend([0] * len(delta.ids))
        art.setdefault(A.LOGPROBS, []).extend([0.0] * len(delta.ids))
        if ctx.config.token_integrity_checks and A.PROMPT_IDS in art:
            integrity.mark_turn(art, art[A.PROMPT_IDS], response)  # the delta's end

    async def _answer_all(self, calls: list[ToolCall], parse_errors: dict[str, str],
                          item: AgentRolloutItem, ctx: Context) -> list[tuple[str, str | None]]:
        """Answer the calls concurrently, in owned tasks: if one raises (a broken
        limiter), its siblings are cancelled and awaited, never left running."""
        if len(calls) == 1:
            return [await self._answer(calls[0], parse_errors.get(calls[0].id), 0, item, ctx)]
        return await run_owned([self._answer(call, parse_errors.get(call.id), i, item, ctx)
                                for i, call in enumerate(calls)])

    async def _answer(self, call: ToolCall, parse_error: str | None, index: int,
                      item: AgentRolloutItem, ctx: Context) -> tuple[str, str | None]:
        """``(content, error kind or None)`` for one call; raises only on cancellation."""
        if parse_error is not None:
            return f"Error: {parse_error}", "parse"
        if index >= self.max_calls_per_turn:
            return (f"Error: at most {self.max_calls_per_turn} tool calls per turn; "
                    "this one was not run", "too_many_calls")
        registry: Mapping[str, Tool] = ctx.resources.tools
        tool = registry.get(call.function.name)
        if tool is None:
            known = ", ".join(sorted(registry)) or "none"
            return (f"Error: unknown tool {call.function.name!r} (available: {known})",
                    "unknown_tool")
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except (ValueError, RecursionError):
            return "Error: arguments are not valid JSON", "parse"
        problems = validate_arguments(tool.parameters, arguments)
        if problems:
            return "Error: invalid arguments: " + "; ".join(problems[:5]), "invalid_arguments"
        async with self._acquire(tool, item, ctx):
            try:
                async with asyncio.timeout(tool.timeout_s):
                    result = await tool(arguments)
            except TimeoutError:
                return f"Error: tool {tool.name!r} timed out after {tool.timeout_s}s", "timeout"
            except asyncio.CancelledError:
                if cancel_requested():
                    raise
                # A future inside the tool was cancelled by someone else: the tool failed.
                return "Error: CancelledError: the tool's work was cancelled", "tool_exception"
            except Exception as exc:  # the tool's own failure is the model's observation
                return f"Error: {type(exc).__name__}: {exc}", "tool_exception"
        return self._as_text(result), None

    @contextlib.asynccontextmanager
    async def _acquire(self, tool: Tool, item: AgentRolloutItem,
                       ctx: Context) -> AsyncIterator[None]:
        """Wait for the tool's rate limit, then for one of its concurrency slots.

        The token comes first, so waiting for a token never holds a slot others could use.
        The bucket (``tool.rate`` per second, ``tool.burst`` at once) lives in the pipeline's
        limiter registry under ``tool:<name>``, shared fairly across ``tool.fairness_key``
        (``group_id`` by default: one prompt's rollouts cannot starve another's). Time spent
        waiting is added to ``artifacts.LIMITER_WAIT_S``.
        """
        rate = getattr(tool, "rate", None)
        max_concurrency = getattr(tool, "max_concurrency", None)
        started = time.monotonic()
        if rate is not None:
            bucket = ctx.resources.limiters.get(f"tool:{tool.name}", rate,
                                                getattr(tool, "burst", None))
            await bucket.acquire(key=_fairness_key(item, getattr(tool, "fairness_key", None)))
        slots = None
        if max_concurrency is not None:
            per_tool = self._slots.setdefault(asyncio.get_running_loop(), {})
            slots = per_tool.get(tool.name)
            if slots is None:
                slots = per_tool[tool.name] = FifoSlots(max_concurrency)
            await slots.__aenter__()
        waited = time.monotonic() - started
        if rate is not None or slots is not None:
            item.artifacts[A.LIMITER_WAIT_S] = item.artifacts.get(A.LIMITER_WAIT_S, 0.0) + waited
        try:
            yield
        finally:
            if slots is not None:
                await slots.__aexit__(None, None, None)

    def _as_text(self, result: Any) -> str:
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False,
                                                                 default=str)
        return text[: self.max_result_chars]

    @staticmethod
    def _count(art: dict[str, Any], key: str, amount: int) -> None:
        art[key] = art.get(key, 0) + amount
        extra: dict[str, Any] = art.setdefault(A.EXTRA_FIELDS, {})
        extra[key] = art[key]



def _fairness_key(item: AgentRolloutItem, attribute: str | None) -> Any:
    """The value limits are shared fairly across: a sample attribute or the row's data source."""
    name = attribute or "group_id"
    if name == "data_source":
        return item.data.data_source
    return getattr(item, name, None)
