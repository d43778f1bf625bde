"""A LangChain tool loop as a black-box agent: ``langchain-openai``'s ``ChatOpenAI`` with the
tool bound (``bind_tools``), LangChain's message types, its tool's own ``invoke``.

Usage: ``python langchain_agent.py [--responses] [--stream]``; the task comes as JSON on stdin,
the endpoint from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL``. ``--responses``:
the model's Responses API mode (``use_responses_api=True``), else chat completions. It answers
every call of a reply and writes its final answer to ``PIPELINE_ANSWER_FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--responses", action="store_true")
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    llm = ChatOpenAI(model=os.environ["OPENAI_MODEL"], base_url=os.environ["OPENAI_BASE_URL"],
                     api_key=os.environ["OPENAI_API_KEY"], temperature=0.7, max_tokens=64,
                     max_retries=2, streaming=args.stream, use_responses_api=args.responses)
    model = llm.bind_tools([add])
    messages: list[BaseMessage] = [SystemMessage(m["content"]) if m["role"] == "system"
                                   else HumanMessage(m["content"]) for m in task["messages"]]
    for _ in range(6):
        reply = model.invoke(messages)
        messages.append(reply)
        print("langchain step:", reply.content, flush=True)
        if not reply.tool_calls:
            with open(os.environ["PIPELINE_ANSWER_FILE"], "w", encoding="utf-8") as fh:
                fh.write(reply.text)
            return 0
        for call in reply.tool_calls:
            messages.append(ToolMessage(str(add.invoke(call["args"])),
                                        tool_call_id=call["id"]))
    return 3


if __name__ == "__main__":
    sys.exit(main())
