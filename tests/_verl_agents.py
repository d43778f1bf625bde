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

from pipeline import BuildPrompt, Generate, Judge, Loop, Pipeline, artifacts
from pipeline.judgers import ExactMatchJudger
from pipeline.stages import CallTools, Route
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



# --- issue 33 item 2: rewards a stage list carries reach verl, whoever writes them ---------
# Prompts ``R<i>``; rollout ``k`` as in ``pick``. ``R0``'s first rollout fails before it
# generates anything (so it ends before any sample is scored); the others are scored
# ``0.0`` (k == 0: a zero reward is still a reward) or ``1.0``.


async def fail_first(item: Any, ctx: Any) -> None:
    if where(item) == ("R0", 0):
        raise RuntimeError("sandbox never started")


async def score_by_k(item: Any, ctx: Any) -> None:
    """A custom stage as in the guides: writes the reward and a payload, no ``Judge``."""
    score = 0.0 if where(item)[1] == 0 else 1.0
    item.artifacts[artifacts.REWARD] = score
    item.artifacts[artifacts.REWARD_PAYLOAD] = {"acc": bool(score),
                                                "n": len(item.artifacts[artifacts.RESPONSE_IDS])}


def custom_reward() -> list[Any]:
    """Bare async function stages, a plain list (no ``Pipeline``, no ``Judge``)."""
    return [pick, fail_first, BuildPrompt(), Generate(), score_by_k]


def nested_judge() -> Pipeline:
    """A ``Judge`` inside a ``Loop`` inside a ``Route`` (the forced tool call never equals 42:
    every judged sample scores 0.0)."""
    judged = [Loop([Generate(), Judge([ExactMatchJudger()])], max_turns=1)]
    return Pipeline([pick, fail_first, BuildPrompt(),
                     Route({"solver": judged}, default="solver")])


def plain_failing() -> list[Any]:
    """Scores nothing (verl's reward loop would); one sample fails first."""
    return [pick, fail_first, BuildPrompt(), Generate()]


def silent_sometimes() -> list[Any]:
    """Scores every sample but ``R1``'s second: an unmasked sample without a reward beside
    scored ones (a bug of the stage list)."""
    async def score(item: Any, ctx: Any) -> None:
        if where(item) != ("R1", 1):
            await score_by_k(item, ctx)
    return [pick, BuildPrompt(), Generate(), score]


# --- issue 33 item 9: a Route inside a verl entry ------------------------------------------


async def note_agent(item: Any, ctx: Any) -> None:
    item.artifacts[artifacts.REWARD] = 1.0 if item.artifacts.get("agent") == "tools" else 0.5


def routed() -> list[Any]:
    """Two agents; rows pick one by their ``agent`` column, else verl's ``agent_name`` when
    it names one of them, else ``short`` (the default)."""
    return [Route({"short": [BuildPrompt(), Generate()],
                   "tools": [BuildPrompt(), Loop([Generate(), CallTools()], max_turns=2)]},
                  default="short"), note_agent]


# --- issue 33 item 9: every way a factory can fail ------------------------------------------


def raising_factory() -> list[Any]:
    raise ValueError("no API key for the judge")


def returns_none() -> None:
    return None


def returns_stage() -> Any:
    return Generate()


async def async_factory() -> list[Any]:
    return [BuildPrompt(), Generate()]


def exits_factory() -> list[Any]:
    raise SystemExit(3)


def returns_mapping() -> dict[str, Any]:
    return {"solver": [Generate()]}


def misses_a_provider() -> list[Any]:
    return [Generate()]  # no BuildPrompt: nothing provides prompt_ids (issue 35 item 2)


async def constant_reward(item: Any, ctx: Any) -> None:
    item.artifacts[artifacts.REWARD] = 1.0


def score_only() -> list[Any]:
    """Scores without generating: an empty response and a score (verl's ``as_dict`` writes
    it at ``rm_scores[-1]``)."""
    return [BuildPrompt(), constant_reward]
