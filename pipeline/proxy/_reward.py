"""``AgentReward``: the reward an agent program computed itself becomes the sample's reward.

Some agent programs score their own rollout: an environment framework that drives the model
and runs its own verifier (a verifiers environment's reward functions, a benchmark harness
running its tests). Such a program reports its result as its final answer (``RemoteAgent``'s
answer file or its last stdout line): one JSON object with a numeric ``reward``. Put this
stage after ``RemoteAgent``: it writes that number to ``artifacts.REWARD`` and the whole
object, with ``score`` set to the reward, to ``REWARD_PAYLOAD`` (what a ``Judge`` writes),
so trainers see the environment's own reward. An answer that is not such an object fails
the sample with a :class:`RemoteAgentError` naming what was wrong and the answer's start.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from pipeline import artifacts as A
from pipeline._data.models import AgentRolloutItem
from pipeline._runner.context import Context
from pipeline.proxy._agent import FINAL_ANSWER
from pipeline.proxy._errors import RemoteAgentError


class AgentReward:
    """Reads the reward an agent program reported (see the module doc).

    Contract: needs ``proxy.final_answer`` (``RemoteAgent``); writes ``reward`` and
    ``reward_payload``.

    Args:
        key: the field of the answer's JSON object that holds the reward.
        name: the stage name.
    """

    requires: ClassVar[Mapping[str, str]] = MappingProxyType({FINAL_ANSWER: "RemoteAgent"})
    provides = frozenset({A.REWARD, A.REWARD_PAYLOAD})

    def __init__(self, *, key: str = "reward", name: str = "agent_reward") -> None:
        self.key = key
        self.name = name

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        answer = item.artifacts.get(FINAL_ANSWER)
        try:
            report: Any = json.loads(answer) if answer is not None else None
        except ValueError:
            report = None
        value = report.get(self.key) if isinstance(report, dict) else None
        # bool is an int to Python, and a reward of True is a program's bug, not a score.
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not math.isfinite(value)):
            got = "nothing" if answer is None else repr(answer[:200])
            raise RemoteAgentError(
                f"the agent reported no reward: its final answer must be a JSON object with a "
                f"finite number {self.key!r}, got {got}")
        item.artifacts[A.REWARD] = float(value)
        item.artifacts[A.REWARD_PAYLOAD] = {**report, "score": float(value)}
