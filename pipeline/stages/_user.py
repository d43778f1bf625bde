"""``SimulatedUser``: a second model (or a scripted policy) plays the user, tau-bench style, so
agent <-> user <-> tool conversations run as one trajectory.

After every agent turn that calls no tool, the user answers: the conversation is shown to the
user model with the roles swapped (the agent's turns are what the user reads, the user's own
earlier messages are its turns; the agent's system prompt, tool calls and tool results are not
shown), with the user's instructions as its system prompt. Its reply joins the agent's
conversation as a ``user`` message whose template tokens are appended with
``response_mask = 0``: the user's tokens are never trained on. What the user model sampled
(token ids, logprobs, its own prompt length) is recorded separately, in
``artifacts[USER_TURNS]``. The conversation ends when the user writes the stop marker (the
stopping message is recorded, not appended) or the loop runs out of turns.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from pipeline import artifacts as A
from pipeline._data.config import SamplingParams
from pipeline._data.models import AgentMessage, AgentRolloutItem, ExitReason, FinishReason
from pipeline._exceptions import ConfigError, SampleAborted
from pipeline._runner.context import Context
from pipeline._text.render import decode_text, render_prompt
from pipeline.stages._base import Loop
from pipeline.stages._observe import append_observation

USER_TURNS = "user_turns"
"""Artifact: one dict per simulated-user turn: ``text``, ``token_ids``, ``logprobs``,
``prompt_len`` (empty ids for a scripted policy), ``stopped`` (the turn that ended it)."""
USER_STOPPED = "user_stopped"
"""Artifact: True once the simulated user wrote the stop marker."""

UserPolicy = Callable[[list[dict[str, Any]], AgentRolloutItem], str | Awaitable[str]]
"""A scripted user: ``(the user's view of the conversation, item) -> reply text``."""


class SimulatedUser:
    """Answer the agent as the user, with a second engine or a scripted policy.

    Args:
        engine: the user model's engine (token in, token out), with ``tokenizer``.
        tokenizer: the user model's tokenizer (its chat template renders the user's view).
        policy: instead of an engine, ``(messages, item) -> text`` (plain or ``async``).
        instructions: the user's system prompt; a row's ``extra["user_instructions"]``
            overrides it (each task gives its user a goal).
        stop_marker: text the user writes to end the conversation (tau-bench's
            ``###STOP###``).
        sampling: the user model's sampling parameters (a dict or ``SamplingParams``).
        name: the stage's name.

    Raises:
        ConfigError: neither or both of ``engine`` and ``policy``, an engine without a
            tokenizer, or bad sampling parameters, naming the field.
    """

    requires: ClassVar[Mapping[str, str]] = MappingProxyType({A.MESSAGES: "BuildPrompt"})
    provides = frozenset({A.MESSAGES, A.RESPONSE_IDS, A.RESPONSE_MASK, A.LOGPROBS,
                          A.EXIT_REASON, A.TEMPLATE_DRIFT, A.EXTRA_FIELDS, USER_TURNS,
                          USER_STOPPED})

    def __init__(self, *, engine: Any = None, tokenizer: Any = None,
                 policy: UserPolicy | None = None, instructions: str = "",
                 stop_marker: str = "###STOP###",
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 name: str = "simulated_user") -> None:
        if (engine is None) == (policy is None):
            raise ConfigError("SimulatedUser: give engine (with tokenizer) or policy, exactly "
                              "one", field="engine")
        if engine is not None and tokenizer is None:
            raise ConfigError("SimulatedUser: an engine needs the user model's tokenizer",
                              field="tokenizer")
        if policy is not None and not callable(policy):
            raise ConfigError(f"SimulatedUser: policy must be callable (messages, item) -> "
                              f"text, got {policy!r}", field="policy")
        if not isinstance(stop_marker, str) or not stop_marker:
            raise ConfigError("SimulatedUser: stop_marker must be a non-empty string",
                              field="stop_marker")
        try:
            self.sampling = (sampling if isinstance(sampling, SamplingParams)
                             else SamplingParams(**dict(sampling or {"max_tokens": 128})))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"SimulatedUser: sampling: {exc}", field="sampling") from None
        self.engine, self.tokenizer, self.policy = engine, tokenizer, policy
        self.instructions, self.stop_marker, self.name = instructions, stop_marker, name

    def loop(self, stages: Iterable[Any], *, max_turns: int) -> Loop:
        """``Loop([*stages, self])`` that ends when the user stops (or after ``max_turns``)."""
        return Loop([*stages, self], until=self.stopped, max_turns=max_turns,
                    name=f"{self.name}_loop")

    @staticmethod
    def stopped(item: AgentRolloutItem) -> bool:
        """Whether the simulated user ended the conversation."""
        return bool(item.artifacts.get(USER_STOPPED))

    def view(self, item: AgentRolloutItem) -> list[dict[str, Any]]:
        """The conversation as the user model sees it (roles swapped, tools left out)."""
        instructions = item.data.extra.get("user_instructions", self.instructions)
        out = [{"role": "system", "content": instructions}] if instructions else []
        for message in item.artifacts.get(A.MESSAGES, ()):
            if message.role == "assistant" and not message.tool_calls and message.content:
                out.append({"role": "user", "content": message.content})
            elif message.role == "user":
                out.append({"role": "assistant", "content": message.content or ""})
        return out

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        art = item.artifacts
        messages: list[AgentMessage] = art.get(A.MESSAGES, [])
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant" or last.tool_calls:
            return  # the agent is mid tool loop (or did not answer): not the user's turn
        turns: list[dict[str, Any]] = art.setdefault(USER_TURNS, [])
        view = self.view(item)
        if self.policy is not None:
            reply = self.policy(view, item)
            text = str(await reply if inspect.isawaitable(reply) else reply)
            record: dict[str, Any] = {"text": text, "token_ids": [], "logprobs": [],
                                      "prompt_len": 0}
        else:
            record = await self._generate(view, item, ctx, len(turns))
            text = record["text"]
        stopped = self.stop_marker in text
        record["stopped"] = stopped
        turns.append(record)
        if stopped:
            art[USER_STOPPED] = True
            art[A.EXIT_REASON] = ExitReason.DONE.value
            return
        await append_observation(item, ctx, [AgentMessage(role="user", content=text)])

    async def _generate(self, view: list[dict[str, Any]], item: AgentRolloutItem,
                        ctx: Context, turn: int) -> dict[str, Any]:
        _, prompt_ids = render_prompt(self.tokenizer, view, None)
        request_id = f"{item.uid}-user-{turn}"
        try:
            gen = await self.engine.generate(prompt_ids, self.sampling, request_id)
        except asyncio.CancelledError:
            # The sample ends (timeout, abort): the user's request must not run on.
            await asyncio.shield(self._abort(request_id, ctx))
            raise
        if gen.finish_reason is FinishReason.ABORT:
            raise SampleAborted(f"the simulated user's engine aborted request {request_id}")
        text = decode_text(self.tokenizer, list(gen.token_ids), skip_special_tokens=True)
        return {"text": text.strip(), "token_ids": list(gen.token_ids),
                "logprobs": list(gen.logprobs), "prompt_len": len(prompt_ids)}

    async def _abort(self, request_id: str, ctx: Context) -> None:
        try:
            async with asyncio.timeout(ctx.config.cleanup_timeout_s):
                await self.engine.abort(request_id)
        except Exception as exc:  # logged: the sample's own outcome stands
            ctx.log.warning("user_abort_failed", request_id=request_id,
                            error=f"{type(exc).__name__}: {exc}")

