"""A litellm tool loop as a black-box agent (``litellm.completion`` on an OpenAI-compatible
endpoint, ``openai/<model>``).

Usage: ``python litellm_agent.py [--stream]``; task on stdin as JSON, endpoint from
``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL``. It answers every ``add`` call of a
reply (parallel calls included) and writes its final answer to ``PIPELINE_ANSWER_FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import litellm


def ask(messages: list[dict[str, Any]], tools: list[dict[str, Any]], stream: bool) -> Any:
    options: dict[str, Any] = {
        "model": "openai/" + os.environ["OPENAI_MODEL"], "api_base": os.environ["OPENAI_BASE_URL"],
        "api_key": os.environ["OPENAI_API_KEY"], "messages": messages, "tools": tools,
        "max_tokens": 64, "temperature": 0.7}
    if not stream:
        return litellm.completion(**options).choices[0].message
    chunks = list(litellm.completion(**options, stream=True))
    return litellm.stream_chunk_builder(chunks, messages=messages).choices[0].message


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    messages: list[dict[str, Any]] = list(task["messages"])
    for _ in range(6):
        message = ask(messages, task["tools"], args.stream)
        messages.append(message.model_dump(exclude_none=True))
        print("litellm step:", message.content, flush=True)
        if not message.tool_calls:
            with open(os.environ["PIPELINE_ANSWER_FILE"], "w", encoding="utf-8") as fh:
                fh.write(message.content or "")
            return 0
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(arguments["a"] + arguments["b"])})
    return 3


if __name__ == "__main__":
    sys.exit(main())
