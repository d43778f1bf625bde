"""A verifiers 0.4.0 environment written for tests/test_env_verifiers.py: a taskset of three
arithmetic rows (local data, no hub), a reward function that checks the model's reply, and
a harness that asks the model once.

It runs in the verifiers interpreter (``.venv-verifiers``, see scripts/setup.sh), never in
the project's: verifiers 0.4.0 pins ``mcp==2.0.0`` and ``openai<3``. verifiers finds it by
its taskset id ``arith_taskset`` (this directory on ``PYTHONPATH``); the module exports its
``Taskset`` and its ``Harness`` (the taskset's bundled harness) through ``__all__``.
"""

from __future__ import annotations

import verifiers.v1 as vf
from openai import AsyncOpenAI

ROWS = [("What is 2 + 3? Reply with the number only.", "5"),
        ("What is 7 + 8? Reply with the number only.", "15"),
        ("What is 10 + 32? Reply with the number only.", "42")]


class ArithData(vf.TaskData):
    """One row: the prompt (``TaskData.prompt``) and its answer."""

    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the reply is the answer, else 0.0."""
        return 1.0 if trace.last_reply == self.data.answer else 0.0


class ArithConfig(vf.TasksetConfig):
    pass


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        return [ArithTask(ArithData(prompt=prompt, answer=answer), self.config.task)
                for prompt, answer in ROWS]


class OneShotHarnessConfig(vf.HarnessConfig):
    pass


class OneShotHarness(vf.Harness[OneShotHarnessConfig]):
    """Asks the model once, in this process: verifiers' built-in harnesses run a program
    that ``uv`` installs from the network first, which a test here may not do."""

    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime,
                     endpoint: str, secret: str, mcp_urls: dict[str, str],
                     data: vf.TaskData) -> vf.ProgramResult:
        client = AsyncOpenAI(base_url=endpoint, api_key=secret)
        try:
            reply = await client.chat.completions.create(
                model=ctx.model, messages=[{"role": "user", "content": data.prompt_text}])
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "",
                                stderr="")


__all__ = ["ArithTaskset", "OneShotHarness"]
