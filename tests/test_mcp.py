"""MCP tools through CallTools, against a real MCP server (tests/mcp_server.py, the official
SDK's MCPServer) started as a subprocess over stdio and over streamable HTTP on 127.0.0.1:
schemas in the registry, limiter keys per server and per tool, a server that crashes (a tool
error, then a restart), hangs (a timeout), answers with noise or an error result, and a
server per trajectory (started per sample, stopped on every outcome)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ports import free_port

from pipeline import AgentMessage, Pipeline, ToolCall, ToolFunction, artifacts
from pipeline.stages import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import MCPServer, MCPServerError

pytest.importorskip("mcp")

SERVER = str(Path(__file__).with_name("mcp_server.py"))


def calling(*calls: tuple[str, dict]):
    """A stand-in for the model's turn: one assistant message with these tool calls (a row's
    ``extra["calls"]`` replaces them, so rows of one batch can call different tools)."""

    async def assistant_turn(item, ctx):
        wanted = item.data.extra.get("calls") or calls
        tool_calls = [ToolCall(id=f"c{i}", function=ToolFunction(name=n, arguments=json.dumps(a)))
                      for i, (n, a) in enumerate(wanted)]
        item.artifacts[artifacts.PROMPT_IDS] = [1, 2, 3]
        item.artifacts[artifacts.MESSAGES] = [
            AgentMessage(role="user", content="use the tools"),
            AgentMessage(role="assistant", content="", tool_calls=tool_calls, token_ids=[2])]
        item.artifacts[artifacts.RESPONSE_IDS] = [2]
        item.artifacts[artifacts.RESPONSE_MASK] = [1]
        item.artifacts[artifacts.LOGPROBS] = [-0.5]

    return assistant_turn


def replies(item) -> list[AgentMessage]:
    return [m for m in item.artifacts[artifacts.MESSAGES] if m.role == "tool"]


def stdio_server(**options) -> MCPServer:
    return MCPServer("calc", command=sys.executable, args=[SERVER], **options)


async def run_calls(server: MCPServer, *calls, rows=None, n=1, **options):
    rollout = Pipeline([calling(*calls), CallTools(offload=False)], tokenizer=ByteTokenizer(),
                       tools=server.tools, **options)
    return rollout, await rollout.run_batch(rows or [{"prompt": "go"}], n=n)


async def test_stdio_server_tools_limits_and_failures():
    """One server process for the worker-scope checks (starting one costs seconds: the SDK's
    import): registry and schemas, both limiter keys, noise on stdout, an error result, a hung
    call, then a crash and the restart."""
    async with stdio_server(call_timeout_s=1.0, rate=1000.0, burst=5, tool_rate=1000.0,
                            tool_burst=5) as server:
        tools = {t.name: t for t in server.tools}
        assert {"add", "pid", "crash", "hang", "noisy", "fails"} <= set(tools)
        assert tools["add"].parameters["properties"]["a"]["type"] == "integer"
        assert tools["add"].parameters["required"] == ["a", "b"]
        assert tools["add"].description == "Add two integers."

        rollout, result = await run_calls(server, ("add", {"a": 2, "b": 40}),
                                          ("add", {"a": "x", "b": 1}), n=4)
        assert [s.status for s in result.samples] == ["completed"] * 4
        for item in result.items:
            good, bad = replies(item)
            assert good.content == "42" and bad.model_extra["error"] == "invalid_arguments"
        limiters = rollout.resources.limiters
        assert limiters.get("mcp:calc", 1000.0, 5).stats().grants == 4  # valid calls only
        assert limiters.get("tool:add", 1000.0, 5).stats().grants == 4

        # malformed output and an error result are answers the model can read
        _, result = await run_calls(server, ("noisy", {}), ("fails", {"reason": "no quota"}),
                                    ("hang", {"seconds": 2.5}), ("add", {"a": 1, "b": 2}))
        noisy, failed, hung, added = replies(result.items[0])
        assert noisy.content == "answered anyway"
        assert failed.model_extra["error"] == "tool_exception"
        assert "refused: no quota" in failed.content
        # a hung call times out alone; the server keeps serving the others
        assert hung.model_extra["error"] == "timeout" and "timed out after 1.0s" in hung.content
        assert added.content == "3" and server.restarts == 0

        # a crash mid-call is a tool error with the server's stderr; the next call restarts it
        _, result = await run_calls(server, ("crash", {}))
        (reply,) = replies(result.items[0])
        assert result.samples[0].status == "completed"
        assert reply.model_extra["error"] == "tool_exception"
        assert "died during the call" in reply.content and "about to crash" in reply.content
        for _ in range(200):  # bounded: the restart runs in the background (seconds here)
            if server.restarts:
                break
            await asyncio.sleep(0.05)
        _, result = await run_calls(server, ("add", {"a": 1, "b": 1}))
        assert replies(result.items[0])[0].content == "2" and server.restarts == 1


@pytest.fixture
def http_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # bounded: up to 10 s for the server to listen
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                pytest.fail("the MCP HTTP test server exited")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_streamable_http_server(http_server):
    async with MCPServer("calc-http", url=http_server, prefix="remote_") as server:
        assert "remote_add" in {t.name for t in server.tools}
        rollout = Pipeline([calling(("remote_add", {"a": 5, "b": 6})), CallTools(offload=False)],
                           tokenizer=ByteTokenizer(), tools=server.tools)
        result = await rollout.run_batch([{"prompt": "go"}], n=3)
        assert [replies(it)[0].content for it in result.items] == ["11"] * 3


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def fail_if_asked(item, ctx):
    if item.data.extra.get("fail"):
        raise RuntimeError("the judge broke")


async def test_a_server_per_trajectory_is_started_per_sample_and_stopped_on_every_outcome():
    """A failing sample's server stops like a completed one's (the exit stack that stops it
    also runs on timeouts: tests/test_tool_lifecycle.py)."""
    async with stdio_server(scope="trajectory") as server:
        stages = [calling(("pid", {}), ("add", {"a": 1, "b": 2})), CallTools(offload=False),
                  fail_if_asked]
        rollout = Pipeline(stages, tokenizer=ByteTokenizer(), tools=server.tools,
                           sample_timeout_s=60)
        rows = [{"prompt": "finish"}, {"prompt": "fail", "extra": {"fail": True}}]
        result = await rollout.run_batch(rows, n=1)
        assert [s.status for s in result.samples] == ["completed", "failed"]
        pids = [int(replies(it)[0].content) for it in result.items]
        assert len(set(pids)) == 2 and os.getpid() not in pids  # a process per sample
        assert [replies(it)[1].content for it in result.items] == ["3"] * 2
        assert not any(alive(p) for p in pids)  # each stopped when its sample ended


async def test_config_errors_name_the_field():
    from pipeline import ConfigError

    with pytest.raises(ConfigError) as exc:
        MCPServer("x")
    assert exc.value.field == "command"
    with pytest.raises(ConfigError) as exc:
        MCPServer("x", command="y", scope="process")
    assert exc.value.field == "scope"
    with pytest.raises(MCPServerError, match="failed to start"):
        async with MCPServer("missing", command=sys.executable, args=["-c", "import sys; "
                                                                      "sys.exit(5)"],
                             start_timeout_s=10):
            pass
