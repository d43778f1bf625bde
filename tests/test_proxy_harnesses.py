"""More real agent programs through the proxy (issue 40, item 5): pydantic-ai (its chat
completions model, streamed, and its Responses model), a LangChain tool loop
(``langchain-openai``'s ``ChatOpenAI``, chat streamed and its Responses mode) and smolagents'
``CodeAgent`` (the model writes Python that calls the tools, the agent's local executor runs
it), each as the agent of ``RemoteAgent`` on the tiny model (TransformersEngine), in a
subprocess under the network audit (only 127.0.0.1 may be reached).

As in tests/test_proxy_clients.py: the replies are scripted (a random-weight model writes no
tool call by itself; where two replies branch the model really samples between them), every
answer the proxy gave was < 500, and each sample is token-exact against the engine's own
request log (``_proxy_fixtures.run_client``). Marked ``slow`` (each program imports its
library in a second or two), still in CI.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from _add_task import SYSTEM, TOOLS
from _proxy_fixtures import CLIENTS_DIR, RecordingEngine, Script, Served, run_client

from pipeline import artifacts
from pipeline.proxy import FINAL_ANSWER, SEGMENTS

pytest_plugins = ["_model_fixtures"]
pytestmark = pytest.mark.slow

QUESTION = "What is 12 plus 30, plus 8?"


def row() -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": QUESTION}], "tools": TOOLS}


def needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} (the dev extra) is not installed")


async def run_harness(make_engine: Any, tok: Any, script: Script, command: list[str],
                      tmp_path: Path) -> tuple[Any, Any]:
    """The agent program ``command`` against a proxy on the tiny model whose replies
    ``script`` forces; returns ``run_client``'s batch result and the engine's request log."""
    engine = RecordingEngine(make_engine(processor_factory=script))
    served = Served(engine, tok)
    async with served.proxy:
        return await run_client(served, engine, tok, command, row(), tmp_path)


class CodeScript(Script):
    """The shared script, plus smolagents' ``CodeAgent``: code that calls ``add``, then, after
    its output came back as an observation, code that calls ``final_answer``."""

    def texts(self, prompt_ids: list[int]) -> list[str]:
        text = self.tokenizer.decode(prompt_ids)
        if "End by calling final_answer(answer)." not in text:
            return super().texts(prompt_ids)
        logs = re.findall(r"Execution logs:\n(\d+)", text)
        if not logs:  # the agent closes the code block itself
            return ["Thought: add the first two.\n<code>\nprint(add(12, 30))\n",
                    "Thought: add them.\n<code>\nprint(add(a=12, b=30))\n"]
        return [f"Thought: now add 8.\n<code>\nfinal_answer(add({logs[-1]}, 8))\n"]


@needs("pydantic_ai")
@pytest.mark.parametrize(("api", "stream"), [("chat", True), ("responses", False)])
async def test_pydantic_ai_tool_loop(make_engine, tiny_tokenizer, tmp_path: Path, api: str,
                                     stream: bool):
    tok = tiny_tokenizer
    command = [sys.executable, str(CLIENTS_DIR / "pydantic_ai_agent.py"), "--api", api,
               *["--stream"] * stream]
    result, sent = await run_harness(make_engine, tok, Script(tok), command, tmp_path)
    (item,) = result.items
    (segment,) = item.artifacts[SEGMENTS]  # three turns, one token sequence
    assert segment.reason == "start" and len(segment.turns) == 3 == len(sent[0])
    assert segment.tool_turns == 2 == item.artifacts[artifacts.TOOL_TURNS]
    assert item.artifacts[FINAL_ANSWER] in ("Answer: 50", "Answer: 51")
    calls = [c.function.name for m in item.artifacts[artifacts.MESSAGES]
             for c in m.tool_calls or ()]
    assert calls == ["add", "add"]
    # its reasoning-effort and user settings: accepted, and listed on the sample
    effort = "reasoning_effort" if api == "chat" else "reasoning.effort"
    assert result.samples[0].extra_fields["ignored_fields"] == sorted([effort, "user"])


@needs("langchain_openai")
@pytest.mark.parametrize(("api", "stream"), [("chat", True), ("responses", False)])
async def test_langchain_tool_loop(make_engine, tiny_tokenizer, tmp_path: Path, api: str,
                                   stream: bool):
    tok = tiny_tokenizer
    command = [sys.executable, str(CLIENTS_DIR / "langchain_agent.py"),
               *["--responses"] * (api == "responses"), *["--stream"] * stream]
    result, sent = await run_harness(make_engine, tok, Script(tok), command, tmp_path)
    (item,) = result.items
    (segment,) = item.artifacts[SEGMENTS]
    assert segment.reason == "start" and len(segment.turns) == 3 == len(sent[0])
    assert segment.tool_turns == 2 == item.artifacts[artifacts.TOOL_TURNS]
    assert item.artifacts[FINAL_ANSWER] in ("Answer: 50", "Answer: 51")
    assert result.samples[0].extra_fields["ignored_fields"] == []


@needs("smolagents")
async def test_smolagents_code_agent_tool_loop(make_engine, tiny_tokenizer, tmp_path: Path):
    tok = tiny_tokenizer
    command = [sys.executable, str(CLIENTS_DIR / "smolagents_agent.py")]
    result, sent = await run_harness(make_engine, tok, CodeScript(tok), command, tmp_path)
    (item,) = result.items
    assert item.artifacts[FINAL_ANSWER] == "50"  # add really ran in its executor: 12+30, +8
    # CodeAgent sends its reply back rewritten (the code block closed, and its "Calling
    # tools: [...]" note merged into the same assistant message): each turn starts a segment,
    # with the reason recorded, each one token-exact (run_client)
    segments = item.artifacts[SEGMENTS]
    assert [(s.reason, s.turns) for s in segments] == [("start", [0]), ("edited", [1])]
    assert len(sent[0]) == 2 and result.samples[0].extra_fields["proxy_splits"] == 1
    history = segments[1].messages
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    texts = ["".join(p["text"] for p in m["content"]) for m in history[2:4]]  # its text parts
    assert "Calling tools:" in texts[0]
    assert re.search(r"Execution logs:\n42\n", texts[1])  # the executor's output, 12 + 30
