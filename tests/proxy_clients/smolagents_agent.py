"""A smolagents ``CodeAgent`` (its own run loop: the model writes Python that calls the tools,
its local executor runs it, the output comes back as an observation) as a black-box agent.

Usage: ``python smolagents_agent.py [--stream]``; the task comes as JSON on stdin, the endpoint
from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL`` (its ``OpenAIServerModel``, chat
completions, with the stop strings the agent sets). The final answer is printed as the last
stdout line. Its default system prompt (about 5,000 tokens of examples) does not fit the tiny
test model's 4,096-token context: the program passes a short one of its own, rendered from
the agent's tools as the default is (``prompt_templates``, smolagents' own way to replace it);
the rest of the loop is the library's.

smolagents' other agent, ``ToolCallingAgent``, sends ``tool_choice: "required"`` on every
request: a decoding constraint the proxy serves only on an engine that enforces it.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import sys

import yaml
from smolagents import CodeAgent, OpenAIServerModel, tool

SYSTEM = """You solve the task in steps. Each step: one line 'Thought: ...', then Python code
between {{code_block_opening_tag}} and {{code_block_closing_tag}}; print what you need to see.
You may call these functions:
{%- for tool in tools.values() %}
{{ tool.to_code_prompt() }}
{%- endfor %}
End by calling final_answer(answer)."""


@tool
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    task = json.load(sys.stdin)
    model = OpenAIServerModel(os.environ["OPENAI_MODEL"], api_base=os.environ["OPENAI_BASE_URL"],
                              api_key=os.environ["OPENAI_API_KEY"], temperature=0.7,
                              max_tokens=64)
    question = next(m["content"] for m in task["messages"] if m["role"] == "user")
    templates = yaml.safe_load(importlib.resources.files("smolagents.prompts").joinpath(
        "code_agent.yaml").read_text())
    templates["system_prompt"] = SYSTEM
    agent = CodeAgent(tools=[add], model=model, max_steps=4, stream_outputs=args.stream,
                      verbosity_level=0, prompt_templates=templates)
    output = agent.run(question)
    print("smolagents run finished")  # libraries print: the answer is the last line
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
