"""An openai-agents program on the SDK's defaults: the model is named by a string, so the SDK
builds its default model class (``OpenAIResponsesModel``, the Responses API) on a client it
makes from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``. Only tracing is off (it exports to the
internet by default; ``OPENAI_AGENTS_DISABLE_TRACING=1`` in the test environment).

Usage: ``python agents_default.py [--stream] [--chain] [--subagent] [--output-type]``; the task
comes as JSON on stdin. ``--chain``: ``auto_previous_response_id`` (each request sends only
new items and the previous response's id). ``--subagent``: the main agent's only tool is a
second agent with the ``add`` tool. ``--output-type``: a structured ``output_type`` (JSON
schema output), which the proxy refuses on an engine that cannot enforce it.
The final output is printed as the last stdout line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from agents import Agent, ModelSettings, Runner, function_tool
from pydantic import BaseModel


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Total(BaseModel):
    total: int


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--chain", action="store_true")
    parser.add_argument("--subagent", action="store_true")
    parser.add_argument("--output-type", action="store_true")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    model = os.environ["OPENAI_MODEL"]
    system = next(m["content"] for m in task["messages"] if m["role"] == "system")
    question = next(m["content"] for m in task["messages"] if m["role"] == "user")
    settings = ModelSettings(temperature=0.7, max_tokens=64)
    extra = {"output_type": Total} if args.output_type else {}
    if args.subagent:
        adder = Agent(name="adder", instructions="You add numbers with the add tool.",
                      tools=[add], model=model, model_settings=settings)
        agent = Agent(name="main", instructions=system, model=model, model_settings=settings,
                      tools=[adder.as_tool("adder", "Adds the numbers in its input.")], **extra)
    else:
        agent = Agent(name="main", instructions=system, tools=[add], model=model,
                      model_settings=settings, **extra)
    if args.stream:
        streamed = Runner.run_streamed(agent, question, max_turns=6,
                                       auto_previous_response_id=args.chain)
        async for _ in streamed.stream_events():
            pass
        output = streamed.final_output
    else:
        output = (await Runner.run(agent, question, max_turns=6,
                                   auto_previous_response_id=args.chain)).final_output
    print("openai-agents run finished")  # libraries print: the answer is the last line
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
