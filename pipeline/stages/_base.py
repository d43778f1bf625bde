"""``Loop``: repeat a sub-list of stages until a condition holds (the stage protocol and how
one stage runs live in the runner, :mod:`pipeline._runner.stage`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from pipeline import artifacts as A
from pipeline._concurrency.callables import call_either, check_callable
from pipeline._data.models import AgentMessage, AgentRolloutItem, ExitReason
from pipeline._exceptions import StageDefinitionError
from pipeline._runner.context import Context
from pipeline._runner.contracts import Available, check_chain
from pipeline._runner.stage import as_stages, run_stage


def last_assistant_has_no_tool_calls(item: AgentRolloutItem) -> bool:
    """Default ``Loop`` end condition: the model's last turn asked for no tool."""
    for message in reversed(item.artifacts.get(A.MESSAGES, ())):
        if isinstance(message, AgentMessage) and message.role == "assistant":
            return not message.tool_calls
    return True


class Loop:
    """Repeat a sub-list of stages until ``until(item)`` holds or a stage sets an exit reason.

    Running out of ``max_turns`` ends the loop normally with ``exit_reason="max_turns"``;
    ending through ``until`` records ``exit_reason="done"``; a stage inside may end the loop
    early by setting ``item.artifacts[artifacts.EXIT_REASON]`` (e.g. ``"length"``).

    Args:
        stages: the stages of one turn, e.g. ``[Generate(), CallTools()]``.
        until: ``until(item) -> bool``, checked after every turn; a plain function or an
            ``async def`` (awaited); default: the last assistant message has no tool calls.
            One that raises, or a plain one that returns an awaitable, fails the sample.
        max_turns: the most turns to run (>= 1).
        name: the loop's stage name.
    """

    def __init__(
        self,
        stages: Iterable[Any],
        *,
        max_turns: int,
        until: Callable[[AgentRolloutItem], bool | Awaitable[bool]] = (
            last_assistant_has_no_tool_calls),
        name: str = "loop",
    ) -> None:
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise StageDefinitionError(f"Loop: max_turns must be an int >= 1, got {max_turns!r}")
        self._until_is_async = check_callable(until, "until", "either", owner="Loop",
                                              shape="(item) -> bool",
                                              error=StageDefinitionError)
        if not isinstance(name, str) or not name:
            raise StageDefinitionError(f"Loop: name must be a non-empty string, got {name!r}")
        self.stages = as_stages(stages, where=f" of Loop {name!r}")
        self.until = until
        self.max_turns = max_turns
        self.name = name

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        outer_turn = ctx.turn
        item.artifacts.pop(A.EXIT_REASON, None)  # an earlier loop's verdict is not ours
        try:
            for turn in range(self.max_turns):
                ctx.turn = turn
                for stage in self.stages:
                    await run_stage(stage, item, ctx)
                    if A.EXIT_REASON in item.artifacts:
                        return
                if await call_either(self.until, self._until_is_async,
                                     f"Loop {self.name!r}: until", item):
                    item.artifacts[A.EXIT_REASON] = ExitReason.DONE.value
                    return
            item.artifacts[A.EXIT_REASON] = ExitReason.MAX_TURNS.value
        finally:
            ctx.turn = outer_turn

    def check_contract(self, available: Available) -> Available | None:
        """The body's contracts, checked for its first turn (later turns also see what the
        body wrote); what is available after the loop (None: anything may be)."""
        return check_chain(self.stages, available, where=f" in Loop {self.name!r}")

    def __repr__(self) -> str:
        return f"Loop({[s.name for s in self.stages]}, max_turns={self.max_turns})"
