"""Stage-list factories the verl agent-loop tests name in their YAML entries.

``tool_agent``: a multi-turn calculator agent whose judge scores each prompt's second rollout 1
and the others 0. Two samples are scripted by prompt and rollout number ``k`` (verl's
``session_id`` on V1, else the order in which the group's samples start): prompt ``Q1``'s
first rollout fails after its tool loop, prompt ``Q2``'s first rollout asks the server for a
long generation (``SLOW``) and times out in it.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from pipeline import BuildPrompt, Generate, Loop, Pipeline, artifacts
from pipeline.stages import CallTools
from pipeline.tools import calculator_tool

STARTED: Counter[str] = Counter()


def where(item: Any) -> tuple[str, int]:
    return item.data.messages[-1]["content"].split(":")[0], item.artifacts["k"]


async def pick(item: Any, ctx: Any) -> None:
    session = item.data.extra.get("verl", {}).get("session_id")
    if session is None:
        session = STARTED[item.group_id]
        STARTED[item.group_id] += 1
    item.artifacts["k"] = int(session)
    if where(item) == ("Q2", 0):
        text = item.data.messages[-1]["content"]
        item.data = item.data.model_copy(update={"messages": [
            {"role": "user", "content": f"Q2: SLOW {text}"}]})


async def fail_after(item: Any, ctx: Any) -> None:
    if where(item) == ("Q1", 0):
        raise RuntimeError("judge service down")


async def judge(item: Any, ctx: Any) -> None:
    score = 1.0 if where(item)[1] == 1 else 0.0
    item.artifacts[artifacts.REWARD] = score
    item.artifacts[artifacts.REWARD_PAYLOAD] = {"score": score, "acc": bool(score)}


def tool_agent(max_turns: int = 2) -> Pipeline:
    return Pipeline([pick, BuildPrompt(), Loop([Generate(), CallTools()], max_turns=max_turns),
                     fail_after, judge], tools=[calculator_tool()])


def plain_agent() -> list[Any]:
    return [BuildPrompt(), Generate()]

