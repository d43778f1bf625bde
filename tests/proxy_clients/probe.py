"""How each supported client reacts to the proxy's final errors: one call per (client,
endpoint); prints one JSON line per call with the exception it raised.

Usage: ``python probe.py``; stdin: ``{"model": ..., "targets": [{"name", "base_url",
"api_key", "refused": {field: value} | null}, ...]}``. Retries are left at each client's
defaults, except mini-swe-agent's attempts, capped at 2 so a wrong answer costs seconds (the
test counts the requests the proxy received: one per call means the error was final).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "2")

import litellm
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    set_tracing_disabled,
)
from minisweagent.models.litellm_model import LitellmModel
from openai import AsyncOpenAI, OpenAI

MESSAGES = [{"role": "user", "content": "hi"}]


def sdk(target: dict[str, Any], model: str) -> None:
    client = OpenAI(base_url=target["base_url"], api_key=target["api_key"])
    client.chat.completions.create(model=model, messages=MESSAGES,  # type: ignore[arg-type]
                                   **(target["refused"] or {}))


def agents_sdk(target: dict[str, Any], model: str) -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=target["base_url"], api_key=target["api_key"])
    settings = ModelSettings(**(target["refused"] or {}))
    agent = Agent(name="probe", instructions="hi", model_settings=settings,
                  model=OpenAIChatCompletionsModel(model=model, openai_client=client))
    asyncio.run(Runner.run(agent, "hi", max_turns=1))


def litellm_call(target: dict[str, Any], model: str) -> None:
    litellm.completion(model="openai/" + model, api_base=target["base_url"],
                       api_key=target["api_key"], messages=MESSAGES,
                       **(target["refused"] or {}))


def mini(target: dict[str, Any], model: str) -> None:
    LitellmModel(model_name="openai/" + model, cost_tracking="ignore_errors",
                 model_kwargs={"api_base": target["base_url"], "api_key": target["api_key"],
                               **(target["refused"] or {})}).query(MESSAGES)


CLIENTS = {"openai": sdk, "openai-agents": agents_sdk, "litellm": litellm_call,
           "mini-swe-agent": mini}


def main() -> int:
    spec = json.load(sys.stdin)
    for target in spec["targets"]:
        try:
            CLIENTS[target["client"]](target, spec["model"])
            error = None
        except Exception as exc:
            error = type(exc).__name__
        print(json.dumps({"name": target["name"], "client": target["client"], "error": error}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
