"""What verl's trainer loads by name in the end-to-end GPU run (benchmarks/verl_gpu_e2e.py).

verl imports these in its own processes (the trainer's Ray actors, the agent-loop workers),
so the run puts this folder on ``PYTHONPATH`` and names:

- ``verl_e2e_agents.arith_tool_agent``: the stage list of our ``PipelineAgentLoop`` entry
  (agents.yaml): the arith calculator tool loop of ``scenarios/arith_tools.py``;
- this module in ``VERL_USE_EXTERNAL_MODULES``: verl imports it in every process that imports
  verl, so ``grpo_masked`` is registered in the trainer actor that computes advantages (the
  driver is another process);
- ``compute_score`` as ``reward.custom_reward_function``: one reward function for both agent
  loops, so the runs differ only in the loop;
- :func:`calculator_schema`: the calculator's schema as verl's ``ToolAgentLoop`` renders it
  (verl's schema model drops ``maxLength`` and ``additionalProperties``), given to our loop
  too, so both render the same prompt tokens;
- :func:`fine_replay_poll`: verl's V1 trainer times ``gen`` around ``ReplayBuffer.sample``,
  which sleeps ``poll_interval`` (2 s) between looks at the finished rollouts, so every
  ``timing_s/gen`` is a whole number of polls; with ``VERL_E2E_POLL_S`` set, each replay
  buffer this process builds polls that often instead (the same for both loops).
"""

from __future__ import annotations

import os
from typing import Any

from pipeline import BuildPrompt, Generate, Loop, Pipeline
from pipeline.integrations.verl import register_estimators
from pipeline.stages import CallTools
from pipeline.tools import calculator_tool, tool_schema
from scenarios.arith_tools import extract_number


def calculator_schema() -> dict[str, Any]:
    """Our calculator's OpenAI schema, normalised by verl's own schema model."""
    from verl.tools.schemas import OpenAIFunctionToolSchema

    schema = OpenAIFunctionToolSchema.model_validate(tool_schema(calculator_tool()))
    return schema.model_dump(exclude_unset=True, exclude_none=True)


async def add_tool_schema(item: Any, ctx: Any) -> None:
    """Give the row the calculator's schema (verl's rows carry no ``tools`` column for it:
    verl's ``ToolAgentLoop`` takes its schemas from its tool config)."""
    if not item.data.tools:
        item.data = item.data.model_copy(update={"tools": [calculator_schema()]})


def arith_tool_agent(max_turns: int = 4) -> Pipeline:
    """BuildPrompt -> Loop([Generate, CallTools]) with our calculator; verl's reward loop scores
    (the entry sets ``judges: false``)."""
    return Pipeline([add_tool_schema, BuildPrompt(),
                     Loop([Generate(), CallTools()], max_turns=max_turns)],
                    tools=[calculator_tool()])


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: Any = None, **kwargs: Any) -> float:
    """1.0 when the response's answer (``Answer: N``, else its last number) is the ground truth."""
    predicted, expected = extract_number(solution_str), extract_number(str(ground_truth))
    return float(predicted is not None and expected is not None
                 and abs(predicted - expected) < 1e-9)


def fine_replay_poll(poll_s: float) -> None:
    """Make every ``ReplayBuffer`` built from now on poll every ``poll_s`` seconds."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    built = ReplayBuffer.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        self.poll_interval = poll_s

    ReplayBuffer.__init__ = init  # type: ignore[method-assign]


register_estimators()
if os.environ.get("VERL_E2E_POLL_S"):
    fine_replay_poll(float(os.environ["VERL_E2E_POLL_S"]))
