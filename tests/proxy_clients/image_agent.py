"""A black-box agent that sends images through the official SDK (tests/test_proxy_images.py).

Usage: ``python image_agent.py``; the task comes as JSON on stdin, its ``extra`` holding
``first`` and ``second`` (data URLs), ``refused`` (``[name, chat content part]``), ``hostile``
and ``hostile_responses`` (``[name, raw message content]``); the endpoint comes from
``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL``. It asks with an ``input_image`` on
the Responses API, sends each refused and each hostile part, then holds a two-turn chat: an
image in the first user turn, another in the second, its history sent back as the SDK
returned it. What every request got (status, ``x-should-retry``, error body) goes to
``report.json`` in the working directory; the last reply's text is the last stdout line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import openai
from openai import OpenAI


def main() -> int:
    task = json.load(sys.stdin)["extra"]
    client = OpenAI(max_retries=0, timeout=60)
    model = os.environ["OPENAI_MODEL"]
    report: dict[str, Any] = {}

    response = client.responses.create(model=model, max_output_tokens=4, temperature=0.0,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": "Name the colour."},
                                           {"type": "input_image", "image_url": task["first"],
                                            "detail": "auto"}]}])
    report["responses"] = response.status

    def refused(name: str, messages: list[dict[str, Any]], responses: bool = False) -> None:
        try:
            if responses:
                client.responses.create(model=model, input=messages, max_output_tokens=4)
            else:
                client.chat.completions.create(model=model, messages=messages, max_tokens=4)
        except openai.APIStatusError as exc:
            report[name] = {"status": exc.status_code,
                            "retry": exc.response.headers.get("x-should-retry"),
                            "error": exc.body}
        else:
            report[name] = {"status": 200}

    for name, part in task["refused"]:
        refused(name, [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}])
    for name, content in task["hostile"]:
        refused(name, [{"role": "user", "content": content}])
    for name, content in task["hostile_responses"]:
        refused(name, [{"role": "user", "content": content}], responses=True)

    messages: list[Any] = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": task["first"]}},
        {"type": "text", "text": "What colour is this?"}]}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                           temperature=0.0)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": [
                     {"type": "text", "text": "And this one?"},
                     {"type": "image_url", "image_url": {"url": task["second"]}}]}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                            temperature=0.0)
    with open("report.json", "w", encoding="utf-8") as fh:
        json.dump(report, fh)
    print(second.choices[0].message.content or "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
