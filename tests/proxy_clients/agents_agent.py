"""An openai-agents program (the Agents SDK's own run loop) as a black-box agent.

Usage: ``python agents_agent.py [--stream] [--subagent]``; the task comes as JSON on stdin, the
endpoint from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL``. The model is the SDK's
chat-completions model class on an ``AsyncOpenAI`` client for that endpoint; tracing is off
(it exports to the internet by default). ``--subagent``: the main agent's only tool is a second
agent (agent-as-tool) that has the ``add`` tool; both talk through the same session.
The final output is printed as the last stdout line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--subagent", action="store_true")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    set_tracing_disabled(True)
    client = AsyncOpenAI(max_retries=2, timeout=60)
    model = OpenAIChatCompletionsModel(model=os.environ["OPENAI_MODEL"], openai_client=client)
    system = next(m["content"] for m in task["messages"] if m["role"] == "system")
    question = next(m["content"] for m in task["messages"] if m["role"] == "user")
    settings = ModelSettings(temperature=0.7, max_tokens=64)
    if args.subagent:
        adder = Agent(name="adder", instructions="You add numbers with the add tool.",
                      tools=[add], model=model, model_settings=settings)
        agent = Agent(name="main", instructions=system, model=model, model_settings=settings,
                      tools=[adder.as_tool("adder", "Adds the numbers in its input.")])
    else:
        agent = Agent(name="main", instructions=system, tools=[add], model=model,
                      model_settings=settings)
    if args.stream:
        streamed = Runner.run_streamed(agent, question, max_turns=6)
        async for _ in streamed.stream_events():
            pass
        output = streamed.final_output
    else:
        output = (await Runner.run(agent, question, max_turns=6)).final_output
    print("openai-agents run finished")  # libraries print: the answer is the last line
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
