"""A verifiers 0.4.0 environment as a ``RemoteAgent`` program (run by the verifiers
interpreter, ``.venv-verifiers/bin/python``): reads the sample's task on stdin, plays the
taskset row ``extra["verifiers_task"]`` as one verifiers episode with its model client
pointed at the proxy session (``OPENAI_BASE_URL``/``OPENAI_API_KEY``), and prints one JSON
line: the reward verifiers' scoring computed, each reward function's value, the reply.

Usage: run_episode.py TASKSET_ID
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import verifiers.v1 as vf


async def main(taskset_id: str) -> None:
    task_in = json.load(sys.stdin)
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset=vf.TasksetConfig(id=taskset_id),
        agent=vf.AgentConfig(runtime=vf.SubprocessConfig())))
    tasks, index = list(env.taskset), task_in["extra"].get("verifiers_task")
    if not isinstance(index, int) or not 0 <= index < len(tasks):
        sys.exit(f"extra.verifiers_task must be a task index of {taskset_id!r} "
                 f"(0..{len(tasks) - 1}), got {index!r}")
    task = tasks[index]
    ctx = vf.ModelContext(model=os.environ["OPENAI_MODEL"], client=vf.EvalClientConfig(
        base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY"))
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    if not episode.ok:
        sys.exit(f"the verifiers episode failed: {episode.errors}")
    (trace,) = episode.traces
    print(json.dumps({"reward": trace.reward,
                      "rewards": {k: r.value for k, r in trace.rewards.items() if r},
                      "reply": trace.last_reply}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
