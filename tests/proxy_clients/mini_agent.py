"""mini-swe-agent's default agent loop, with its local environment, as a black-box agent.

Usage: ``python mini_agent.py WORKDIR [STEP_LIMIT]``; the task (its user message) comes as
JSON on stdin, the endpoint from ``OPENAI_BASE_URL``/``OPENAI_API_KEY``/``OPENAI_MODEL``
(through litellm, as ``openai/<model>``). The agent runs bash commands in WORKDIR until it
submits or hits the step limit; the submission goes to ``PIPELINE_ANSWER_FILE``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml
from minisweagent import package_dir
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel


def main() -> int:
    workdir, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
    task = json.load(sys.stdin)
    question = next(m["content"] for m in task["messages"] if m["role"] == "user")
    config = yaml.safe_load(Path(package_dir / "config" / "default.yaml").read_text())["agent"]
    config["step_limit"] = steps
    # the default loop and observation format, with short prompts (the tiny model's context
    # is 1024 tokens; the default prompts alone are longer)
    config["system_template"] = "You run one bash command per reply with the bash tool."
    config["instance_template"] = ("{{task}} When done, run: echo "
                                   "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat answer.txt")
    model = LitellmModel(
        model_name="openai/" + os.environ["OPENAI_MODEL"], cost_tracking="ignore_errors",
        model_kwargs={"api_base": os.environ["OPENAI_BASE_URL"],
                      "api_key": os.environ["OPENAI_API_KEY"], "max_tokens": 160})
    agent = DefaultAgent(model, LocalEnvironment(cwd=workdir, timeout=20), **config)
    result = agent.run(question)
    with open(os.environ["PIPELINE_ANSWER_FILE"], "w", encoding="utf-8") as fh:
        fh.write(result.get("submission", ""))
    print("exit status:", result.get("exit_status"))
    if result.get("exit_status") != "Submitted":
        print(json.dumps(agent.messages[-3:], default=str)[-3000:], file=sys.stderr)
    return 0 if result.get("exit_status") == "Submitted" else 4


if __name__ == "__main__":
    sys.exit(main())
