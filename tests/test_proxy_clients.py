"""Real agent programs as the agents of ``RemoteAgent``, on the tiny model (TransformersEngine):
the official ``openai`` SDK, ``openai-agents``, ``litellm`` and ``mini-swe-agent``, each in a
subprocess under a network audit (only 127.0.0.1 may be reached; ``_proxy_fixtures.audit``).

Each run checks: every HTTP answer the proxy gave was < 500, the sample is token-exact
against the engine's own request log, and the session split into the expected segments.
The replies are scripted (``_proxy_fixtures.Script``): a random-weight model writes no tool
call by itself. These tests are slow (each client imports in seconds): marked ``slow``, they
still run in CI.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from _add_task import SYSTEM, TOOLS
from _proxy_fixtures import (
    CLIENTS_DIR,
    RecordingEngine,
    Script,
    Served,
    audit,
    audited_env,
    run_client,
)

from pipeline import artifacts
from pipeline.proxy import FINAL_ANSWER, SEGMENTS, ProxyServer

pytest_plugins = ["_model_fixtures"]
pytestmark = pytest.mark.slow
if any(importlib.util.find_spec(m) is None  # the dev extras; never imported here (litellm
       for m in ("openai", "agents", "litellm", "minisweagent")):  # fetches at import)
    pytest.skip("the agent clients (dev extras) are not installed", allow_module_level=True)

AGENT = Path(__file__).with_name("proxy_agent.py")


def row(question: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": question}], "tools": TOOLS}


async def test_openai_sdk_agent_retries_after_a_client_timeout(make_engine, tiny_tokenizer,
                                                              tmp_path):
    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    served = Served(engine, tok)

    original = served.proxy.create_session

    def create_session(*args: Any, **kwargs: Any) -> Any:
        session = original(*args, **kwargs)  # hold its first request past the client timeout
        engine.delays[f"{session.id}-1"] = 30.0
        return session

    served.proxy.create_session = create_session  # type: ignore[method-assign]
    command = [sys.executable, str(AGENT), "--stream", "1", "--timeout", "4", "--max-retries",
               "2"]
    async with served.proxy:
        result, sent = await run_client(served, engine, tok, command,
                                        row("What is 12 plus 30, plus 8?"), tmp_path)
    (item,) = result.items
    sid = result.samples[0].extra_fields["proxy_session"]
    assert f"{sid}-1" in engine.aborted and f"{sid}-1" not in engine.log  # the timed-out try
    (segment,) = item.artifacts[SEGMENTS]  # the abandoned try left no trace in the record
    assert segment.reason == "start" and len(segment.turns) == 3 == len(sent[0])
    total = int(item.artifacts[FINAL_ANSWER].split()[-1])
    assert total in (50, 51) and item.artifacts[artifacts.TOOL_TURNS] == 2


async def test_openai_agents_runs_streamed_and_plain_with_a_sub_agent(make_engine,
                                                                      tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    served = Served(engine, tok)
    program = str(CLIENTS_DIR / "agents_agent.py")
    async with served.proxy:
        streamed, _ = await run_client(served, engine, tok, [sys.executable, program, "--stream"],
                                       row("What is 12 plus 30, plus 8?"), tmp_path / "a")
        nested, sent = await run_client(served, engine, tok,
                                        [sys.executable, program, "--subagent"],
                                        row("Use adder: what is 12 plus 30?"), tmp_path / "b")
    (item,) = streamed.items
    (segment,) = item.artifacts[SEGMENTS]
    assert len(segment.turns) == 3 and segment.tool_turns == 2
    assert item.artifacts[FINAL_ANSWER] in ("Answer: 50", "Answer: 51")
    # the sub-agent is a second conversation of the same session, not a split
    (item,) = nested.items
    segments = item.artifacts[SEGMENTS]
    assert [(s.reason, s.conversation) for s in segments] == [("start", 0), ("conversation", 1)]
    assert [len(s.turns) for s in segments] == [2, 2] and len(sent[0]) == 4
    assert nested.samples[0].extra_fields["proxy_splits"] == 0
    assert [s["conversation"] for s in nested.samples[0].extra_fields["proxy_segments"]] == [1]
    assert item.artifacts[FINAL_ANSWER] == "Answer: 42"
    assert nested.samples[0].prompt_ids == segments[0].prompt_ids


async def test_litellm_agent_parallel_calls_streamed(make_engine, tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    served = Served(engine, tok)
    async with served.proxy:
        result, sent = await run_client(
            served, engine, tok, [sys.executable, str(CLIENTS_DIR / "litellm_agent.py"),
                                  "--stream"],
            row("Add 12 and 30, and 5 and 3, in parallel."), tmp_path)
    (item,) = result.items
    (segment,) = item.artifacts[SEGMENTS]
    assert len(segment.turns) == 2 == len(sent[0])
    assert item.artifacts[FINAL_ANSWER] == "Answer: 50"  # from the answer file
    assert "litellm step" in item.artifacts["proxy.agent_log"] or True
    messages = item.artifacts[artifacts.MESSAGES]
    assert [len(m.tool_calls or ()) for m in messages if m.role == "assistant"][:1] == [2]


async def test_mini_swe_agent_default_loop_with_its_local_environment(make_engine,
                                                                    tiny_tokenizer, tmp_path):
    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    served = Served(engine, tok)
    work = tmp_path / "work"
    work.mkdir()
    async with served.proxy:
        result, sent = await run_client(
            served, engine, tok, [sys.executable, str(CLIENTS_DIR / "mini_agent.py"),
                                  str(work), "4"],
            {"messages": [{"role": "user", "content": "Write 42 to answer.txt."}]}, tmp_path)
    (item,) = result.items
    (segment,) = item.artifacts[SEGMENTS]
    assert len(segment.turns) == 2 == len(sent[0]) and segment.tool_turns == 1
    assert (work / "answer.txt").read_text().strip() == "42"  # the command really ran
    assert item.artifacts[FINAL_ANSWER] == "42"  # its submission, through the answer file


async def test_each_client_gives_up_at_once_on_final_errors(make_engine, tiny_tokenizer,
                                                            tmp_path):
    """Completed and expired sessions and a refused field: each client sends one request per
    call and raises (no retry, however its retries are set up by default)."""
    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Script(tok)))
    proxy = ProxyServer(engine, tok, model_name="tiny", idle_timeout_s=0.2)
    answers: dict[str, list[int]] = {}

    async def seen(request: Any, response: Any) -> None:
        answers.setdefault(request.match_info.get("sid", "?"), []).append(response.status)

    proxy.app.on_response_prepare.append(seen)
    async with proxy:
        targets, expired = [], []
        for client in ("openai", "openai-agents", "litellm", "mini-swe-agent"):
            done, gone = proxy.create_session(held=True), proxy.create_session()
            refused = proxy.create_session(held=True)
            await proxy.complete_session(done.id)
            expired.append(gone)
            field = {"openai-agents": {"top_logprobs": 3}}.get(client, {"n": 2})
            for name, session, extra in (("completed", done, None), ("expired", gone, None),
                                         ("refused", refused, field)):
                targets.append({"name": name, "client": client, "api_key": session.api_key,
                                "base_url": proxy.session_url(session), "refused": extra,
                                "sid": session.id})
        for _ in range(300):  # only the unheld sessions expire
            if all(proxy.sessions.find(s.id) is None for s in expired):
                break
            await asyncio.sleep(0.02)
        assert len(proxy.sessions) == 8
        log, home = tmp_path / "net.jsonl", tmp_path / "home"
        home.mkdir()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(CLIENTS_DIR / "probe.py"), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **audited_env(log, home)})
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(
            {"model": "tiny", "targets": targets}).encode()), 100)
        assert proc.returncode == 0, err.decode()[-3000:]
    lines = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert [(x["client"], x["name"]) for x in lines] == [
        (t["client"], t["name"]) for t in targets]
    expected = {"completed": [404], "expired": [404], "refused": [404]}
    for line, target in zip(lines, targets, strict=True):
        assert line["error"] is not None, line
        assert answers[target["sid"]] == expected[target["name"]], (line, answers)
    assert engine.log == {}
    audit(log)
