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
from pipeline._data.messages import tool_message
from pipeline._data.models import TOOL_CALL_ERRORS, AgentMessage, AgentRolloutItem, ToolCall
from pipeline._runner.context import Context
from pipeline.multimodal import image_result_parts, is_image_result
from pipeline.stages._generate import check_positive_int
from pipeline.stages._observe import append_observation
from pipeline.tools import Tool, ToolResult, TrajectoryTool, validate_arguments

TOOL_CALLS = A.TOOL_CALLS
TOOL_ERRORS = A.TOOL_ERRORS
TEMPLATE_DRIFT = A.TEMPLATE_DRIFT
COUNTERS = (TOOL_CALLS, TOOL_ERRORS, TEMPLATE_DRIFT)
"""Per-sample counters, mirrored into ``extra_fields`` so they reach the trainer view."""

TOOL_REWARDS = "tool_rewards"
"""``extra_fields`` key: the rewards tool calls returned (:class:`~pipeline.tools.ToolResult`),
in call order; verl's ``tool_rewards`` column."""
TOOL_CREATE_WAIT_S = "tool_create_wait_s"
"""``extra_fields`` key: seconds the sample waited for its per-trajectory tool resources."""
TOOL_RESOURCES_WARM = "tool_resources_warm"
"""``extra_fields`` key: per-trajectory resources that came ready from a warm pool."""
TOOL_CREATE_FAILURES = "tool_create_failures"
"""``extra_fields`` key: per-trajectory resources whose creation failed (an error the model
saw)."""

Answer = tuple[str | list[dict[str, Any]], str | None, float | None]
"""One call's answer: content, error kind (None: no error), reward (None: none)."""

ERROR_KINDS = ("parse", "unknown_tool", "invalid_arguments", "timeout", "tool_exception",
               "too_many_calls")
"""Values of a tool message's ``error`` extra field."""


class CallTools:
    """Answers every tool call of the last assistant message, then tokenizes the new turn.

    Calls of one turn run concurrently, each under its tool's ``timeout_s``. Tool messages are
    appended to ``messages``; their template tokens (see
    :func:`~pipeline.stages.append_observation`) are appended to ``response_ids`` with
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
        # Per-trajectory resources of TrajectoryTools, by (sample uid, tool name).
        self._resources: dict[tuple[str, str], Any] = {}
        self._creating: dict[tuple[str, str], asyncio.Lock] = {}
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
        rewards = [reward for _, _, reward in answers if reward is not None]
        if rewards:  # verl's tool_rewards column
            extra: dict[str, Any] = art.setdefault(A.EXTRA_FIELDS, {})
            extra[TOOL_REWARDS] = [*(extra.get(TOOL_REWARDS) or ()), *rewards]
        replies = [tool_message(content, call.id, call.function.name, kind or None)
                   for call, (content, kind, _) in zip(last.tool_calls, answers, strict=True)]
        errors = sum(1 for _, kind, _ in answers if kind)
        self._count(art, TOOL_CALLS, len(replies))
        self._count(art, TOOL_ERRORS, errors)
        if errors:
            ctx.log.info("tool_errors", errors=errors,
                         kinds=sorted({kind for _, kind, _ in answers if kind}))
        art[A.TOOL_TURNS] = art.get(A.TOOL_TURNS, 0) + 1
        await append_observation(item, ctx, replies, max_model_len=self.max_model_len,
                                 offload=self.offload, offload_chars=self.offload_chars)

    async def _answer_all(self, calls: list[ToolCall], parse_errors: dict[str, str],
                          item: AgentRolloutItem, ctx: Context) -> list[Answer]:
        """Answer the calls concurrently, in owned tasks: if one raises (a broken
        limiter), its siblings are cancelled and awaited, never left running."""
        if len(calls) == 1:
            return [await self._answer(calls[0], parse_errors.get(calls[0].id), 0, item, ctx)]
        return await run_owned([self._answer(call, parse_errors.get(call.id), i, item, ctx)
                                for i, call in enumerate(calls)])

    async def _answer(self, call: ToolCall, parse_error: str | None, index: int,
                      item: AgentRolloutItem, ctx: Context) -> Answer:
        """``(content, error kind or None, reward or None)`` for one call; raises only on
        cancellation."""
        if parse_error is not None:
            return f"Error: {parse_error}", "parse", None
        if index >= self.max_calls_per_turn:
            return (f"Error: at most {self.max_calls_per_turn} tool calls per turn; "
                    "this one was not run", "too_many_calls", None)
        registry: Mapping[str, Tool] = ctx.resources.tools
        tool = registry.get(call.function.name)
        if tool is None:
            known = ", ".join(sorted(registry)) or "none"
            return (f"Error: unknown tool {call.function.name!r} (available: {known})",
                    "unknown_tool", None)
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except (ValueError, RecursionError):
            return "Error: arguments are not valid JSON", "parse", None
        problems = validate_arguments(tool.parameters, arguments)
        if problems:
            return ("Error: invalid arguments: " + "; ".join(problems[:5]), "invalid_arguments",
                    None)
        async with self._acquire(tool, item, ctx):
            try:
                async with asyncio.timeout(tool.timeout_s):
                    if isinstance(tool, TrajectoryTool):
                        resource = await self._resource(tool, item, ctx)
                        result = await tool.call_with(resource, arguments)
                    else:
                        result = await tool(arguments)
            except TimeoutError:
                return (f"Error: tool {tool.name!r} timed out after {tool.timeout_s}s",
                        "timeout", None)
            except asyncio.CancelledError:
                if cancel_requested():
                    raise
                # A future inside the tool was cancelled by someone else: the tool failed.
                return ("Error: CancelledError: the tool's work was cancelled",
                        "tool_exception", None)
            except Exception as exc:  # the tool's own failure is the model's observation
                return f"Error: {type(exc).__name__}: {exc}", "tool_exception", None
        if isinstance(result, ToolResult):
            return self._as_text(result.content), None, result.reward
        return self._as_text(result), None, None

    async def _resource(self, tool: TrajectoryTool, item: AgentRolloutItem,
                        ctx: Context) -> Any:
        """The sample's resource for ``tool``: created at its first call (calls of one turn
        wait for the same creation), released once through the sample's exit stack."""
        # Tools that share one resource (an MCP server's) name it by ``resource_key``.
        key = (item.uid, getattr(tool, "resource_key", tool.name))
        lock = self._creating.setdefault(key, asyncio.Lock())
        async with lock:
            if key in self._resources:
                return self._resources[key]
            extra: dict[str, Any] = item.artifacts.setdefault(A.EXTRA_FIELDS, {})
            started = time.monotonic()
            try:
                resource, warm = await tool.create_for(item)
            except Exception:
                extra[TOOL_CREATE_FAILURES] = extra.get(TOOL_CREATE_FAILURES, 0) + 1
                raise
            finally:
                extra[TOOL_CREATE_WAIT_S] = (extra.get(TOOL_CREATE_WAIT_S, 0.0)
                                             + time.monotonic() - started)
            self._resources[key] = resource
            # Registered before anything else awaits: the release runs on every outcome.
            ctx.exit_stack.push_async_callback(self._release, tool, key, resource)
            extra[TOOL_RESOURCES_WARM] = extra.get(TOOL_RESOURCES_WARM, 0) + int(warm)
            return resource

    async def _release(self, tool: TrajectoryTool, key: tuple[str, str], resource: Any) -> None:
        self._resources.pop(key, None)
        self._creating.pop(key, None)
        await tool.release_resource(resource)

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
        fairness = _fairness_key(item, getattr(tool, "fairness_key", None))
        # Limits shared with other tools first (an MCP server's), then the tool's own.
        shared: tuple[tuple[str, float, int | None], ...] = getattr(tool, "shared_limits", ())
        for key, shared_rate, shared_burst in shared:
            await ctx.resources.limiters.get(key, shared_rate, shared_burst).acquire(
                key=fairness)
        if rate is not None:
            bucket = ctx.resources.limiters.get(f"tool:{tool.name}", rate,
                                                getattr(tool, "burst", None))
            await bucket.acquire(key=fairness)
        slots = None
        if max_concurrency is not None:
            per_tool = self._slots.setdefault(asyncio.get_running_loop(), {})
            slots = per_tool.get(tool.name)
            if slots is None:
                slots = per_tool[tool.name] = FifoSlots(max_concurrency)
            await slots.__aenter__()
        waited = time.monotonic() - started
        if rate is not None or slots is not None or shared:
            item.artifacts[A.LIMITER_WAIT_S] = item.artifacts.get(A.LIMITER_WAIT_S, 0.0) + waited
        try:
            yield
        finally:
            if slots is not None:
                await slots.__aexit__(None, None, None)

    def _as_text(self, result: Any) -> str | list[dict[str, Any]]:
        if is_image_result(result):  # image parts stay parts: the processor renders them
            return image_result_parts(result, self.max_result_chars)
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
