"""A pydantic-ai agent (its own run loop and tool calling) as a black-box agent.

Usage: ``python pydantic_ai_agent.py [--api chat|responses] [--stream]``; the task comes as
JSON on stdin, the endpoint from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL``.
``chat`` is its ``OpenAIChatModel`` (chat completions), ``responses`` its
``OpenAIResponsesModel``; both on an ``OpenAIProvider`` for the endpoint. The model settings
carry two hints the proxy accepts without acting on them (``openai_reasoning_effort``,
``openai_user``), as agents configured for OpenAI's reasoning models send. The final output is
printed as the last stdout line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from pydantic_ai import Agent
from pydantic_ai.models.openai import (
    OpenAIChatModel,
    OpenAIChatModelSettings,
    OpenAIResponsesModel,
    OpenAIResponsesModelSettings,
)
from pydantic_ai.providers.openai import OpenAIProvider


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("chat", "responses"), default="chat")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    provider = OpenAIProvider(base_url=os.environ["OPENAI_BASE_URL"],
                              api_key=os.environ["OPENAI_API_KEY"])
    name = os.environ["OPENAI_MODEL"]
    model: OpenAIChatModel | OpenAIResponsesModel
    if args.api == "chat":
        model = OpenAIChatModel(name, provider=provider)
        settings: OpenAIChatModelSettings | OpenAIResponsesModelSettings = (
            OpenAIChatModelSettings(temperature=0.7, max_tokens=64,
                                    openai_reasoning_effort="low", openai_user="trainer"))
    else:
        model = OpenAIResponsesModel(name, provider=provider)
        settings = OpenAIResponsesModelSettings(temperature=0.7, max_tokens=64,
                                                openai_reasoning_effort="low",
                                                openai_user="trainer")
    system = next(m["content"] for m in task["messages"] if m["role"] == "system")
    question = next(m["content"] for m in task["messages"] if m["role"] == "user")
    agent = Agent(model, instructions=system, tools=[add], model_settings=settings)
    if args.stream:
        async with agent.run_stream(question) as run:
            output = await run.get_output()
    else:
        output = (await agent.run(question)).output
    print("pydantic-ai run finished")  # libraries print: the answer is the last line
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
