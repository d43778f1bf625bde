"""Our calculator as a verl function tool, for verl's own ``ToolAgentLoop`` in the comparison run
(``actor_rollout_ref.rollout.multi_turn.function_tool_path`` names this file).

The same evaluator and the same schema as the ``PipelineAgentLoop`` entry's calculator
(``verl_e2e_agents.calculator_schema``), so both loops see the same prompt and tool replies.
"""

from __future__ import annotations

from verl.tools.function_tool import function_tool
from verl_e2e_agents import calculator_schema

from pipeline.tools import CalculatorError, calculator_tool

_CALCULATOR = calculator_tool()


@function_tool("calculator", schema=calculator_schema())
async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression; an error is the reply text, as our CallTools does."""
    try:
        return str(await _CALCULATOR.fn(expression=expression))
    except CalculatorError as exc:
        return f"Error: {exc}"
