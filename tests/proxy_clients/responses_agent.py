"""A black-box agent on the official SDK's Responses API: ``client.responses.create`` or
``client.responses.stream``, its own tool loop.

Usage: ``python responses_agent.py [--stream] [--chain]``; the task (``{"messages", "tools"}``
in chat form) comes as JSON on stdin, the endpoint from ``OPENAI_BASE_URL``/
``OPENAI_API_KEY``/``OPENAI_MODEL``. The system message becomes ``instructions``. Each turn
sends the whole item list so far (the SDK's output items dumped back as input), or with
``--chain`` only the new items and ``previous_response_id``. Runs the ``add`` calls it gets
until a reply has none, and prints that reply's text as its last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from openai import OpenAI


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--chain", action="store_true")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0, timeout=60)
    model = os.environ["OPENAI_MODEL"]
    instructions = next(m["content"] for m in task["messages"] if m["role"] == "system")
    items: list[Any] = [{"role": "user", "content": m["content"]}
                        for m in task["messages"] if m["role"] == "user"]
    tools = [{"type": "function", "name": t["function"]["name"],
              "description": t["function"]["description"],
              "parameters": t["function"]["parameters"], "strict": False}
             for t in task.get("tools", [])]
    previous, new = None, list(items)
    for _ in range(8):
        request: dict[str, Any] = {"model": model, "instructions": instructions,
                                   "tools": tools, "max_output_tokens": 64,
                                   "temperature": 0.7}
        if args.chain:
            request.update(input=new, previous_response_id=previous)
        else:
            request.update(input=items)
        if args.stream:
            deltas = []
            with client.responses.stream(**request) as stream:
                for event in stream:
                    if event.type == "response.output_text.delta":
                        deltas.append(event.delta)
                response = stream.get_final_response()
            assert "".join(deltas) == response.output_text
        else:
            response = client.responses.create(**request)
        assert response.status == "completed" and response.usage is not None
        assert response.usage.output_tokens > 0
        outputs = [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        results = [{"type": "function_call_output", "call_id": call.call_id,
                    "output": str(sum(json.loads(call.arguments).values()))} for call in calls]
        items += outputs + results
        previous, new = response.id, results
        if not calls:
            print(response.output_text)
            return 0
    print("no answer within 8 turns")
    return 1


if __name__ == "__main__":
    sys.exit(main())
