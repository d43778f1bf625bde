"""A tool loop on the official ``anthropic`` SDK (the Messages API) as a black-box agent.

Usage: ``python anthropic_agent.py [--stream]``; the task comes as JSON on stdin (chat
messages and OpenAI-shaped tools, turned into Anthropic's ``system``, messages and tools), the
endpoint from ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY`` (the SDK reads both itself) and the
model name from ``OPENAI_MODEL``. ``--stream`` uses ``messages.stream`` (its event
accumulator); otherwise ``messages.create``. Each request carries ``cache_control`` as Claude
Code sends it (accepted with no effect). The assistant's content blocks go back as the SDK
returned them; tool results as ``tool_result`` blocks. The final text is the last stdout line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import anthropic


def add(a: int, b: int) -> int:
    return a + b


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    client = anthropic.AsyncAnthropic(max_retries=0)
    system = [{"type": "text", "text": m["content"], "cache_control": {"type": "ephemeral"}}
              for m in task["messages"] if m["role"] == "system"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": m["content"]}
                                      for m in task["messages"] if m["role"] == "user"]
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in task["tools"]]
    for _ in range(6):
        request: dict[str, Any] = {"model": os.environ["OPENAI_MODEL"], "max_tokens": 64,
                                   "system": system, "messages": messages, "tools": tools}
        if args.stream:
            async with client.messages.stream(**request) as stream:
                reply = await stream.get_final_message()
        else:
            reply = await client.messages.create(**request)
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        calls = [b for b in reply.content if b.type == "tool_use"]
        if reply.stop_reason != "tool_use" or not calls:
            print("".join(b.text for b in reply.content if b.type == "text"))
            return 0
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": c.id, "content": str(add(**c.input))}
            for c in calls]})
    return 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
