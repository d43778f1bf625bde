"""The official SDK's structured output, ``client.chat.completions.parse(response_format=...)``
with a pydantic model, at its default retries: one call; exits non-zero with the error.

Usage: ``python parse_probe.py [--output-type]`` (the flag is accepted for symmetry with
``agents_default.py``); the endpoint comes from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/
``OPENAI_MODEL``; stdin is read and ignored.
"""

from __future__ import annotations

import os
import sys

from openai import OpenAI
from pydantic import BaseModel


class Total(BaseModel):
    total: int


def main() -> int:
    sys.stdin.read()
    client = OpenAI()
    parsed = client.chat.completions.parse(
        model=os.environ["OPENAI_MODEL"], response_format=Total,
        messages=[{"role": "user", "content": "What is 12 plus 30?"}])
    print(parsed.choices[0].message.parsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
