"""A black-box agent for the proxy tests: it only speaks the OpenAI API, through the official
``openai`` SDK, and knows nothing about the pipeline.

Usage: ``python tests/proxy_agent.py [--stream 1,2] [--retry-turn N] [--rewrite-after N]``

It reads its task (``{"messages": [...], "tools": [...]}``) as JSON on stdin, and takes its
endpoint from ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` / ``OPENAI_MODEL`` like any SDK
client. Then it loops: ask the model (tools offered), run the ``add`` calls it asks for, send
the results back, until the model answers without a tool call; it prints that answer.

- ``--stream 1,2``: the requests of these turns (0-based) use ``stream=True``; the reply is
  put together from the chunks. Other turns send the SDK's message object back as its
  ``model_dump()`` (with the SDK's extra ``None`` fields), streamed ones as a plain dict.
- ``--retry-turn N``: turn N's reply is thrown away and the same request is sent again.
- ``--timeout S --max-retries K``: the SDK's own timeout and retries (a request that times
  out is sent again by the SDK).
- ``--rewrite-after N``: after N tool rounds, the conversation is replaced by the system
  message and one user message with the question and the results so far (a summary).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from openai import OpenAI


def add(a: int, b: int) -> int:
    return a + b


def ask(client: OpenAI, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
        stream: bool) -> dict[str, Any]:
    """One chat completion; returns the assistant message as the agent keeps it."""
    model = os.environ.get("OPENAI_MODEL", "any")
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                               temperature=0.7, max_tokens=64, **extra)
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        return reply.choices[0].message.model_dump()
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(
            model=model, messages=messages, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, max_tokens=64, **extra):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["function"]["name"] += call.function.name or ""
                    entry["function"]["arguments"] += call.function.arguments or ""
    assert finish is not None and usage is not None and usage.completion_tokens > 0
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", default="")
    parser.add_argument("--retry-turn", type=int, default=-1)
    parser.add_argument("--rewrite-after", type=int, default=-1)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--max-retries", type=int, default=0)
    args = parser.parse_args()
    streamed = {int(t) for t in args.stream.split(",") if t}
    task = json.load(sys.stdin)
    messages: list[dict[str, Any]] = list(task["messages"])
    tools = task.get("tools")
    client = OpenAI(max_retries=args.max_retries, timeout=args.timeout)
    results: list[int] = []
    retried = False
    for turn in range(args.max_turns):
        message = ask(client, messages, tools, turn in streamed)
        if turn == args.retry_turn and not retried:
            retried = True
            message = ask(client, messages, tools, turn in streamed)
        messages.append(message)
        if not message.get("tool_calls"):
            print(message.get("content") or "")
            return 0
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            results.append(add(**arguments))
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": str(results[-1])})
        if len(results) == args.rewrite_after:
            question = next(m["content"] for m in task["messages"] if m["role"] == "user")
            summary = " ".join(f"add gave result: {r}." for r in results)
            messages = [m for m in task["messages"] if m["role"] == "system"]
            messages.append({"role": "user", "content": f"{question} So far: {summary}"})
    print("no answer within the turn limit", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
