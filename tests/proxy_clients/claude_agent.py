"""Claude Code, through ``claude-agent-sdk``, as a black-box agent (the Messages API).

Usage: ``python claude_agent.py``; the task comes as JSON on stdin, the endpoint from
``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY`` (Claude Code reads both), the model name from
``OPENAI_MODEL``. The SDK runs the Claude Code CLI it bundles; the CLI's own network traffic is
audited by running it under ``strace`` (``claude_strace.sh``: every ``connect`` to the file
``$PROXY_NET_LOG.strace``), its non-essential traffic, telemetry, error reports and updates are
off, and an HTTP(S) proxy on a dead loopback port catches anything that would still go out.

The task's tool (``add``) is an in-process MCP tool of the SDK (Claude Code names it
``mcp__calc__add``), the only tool: Claude Code's built-in tools are off (``tools=[]``) and the
task's system prompt replaces Claude Code's default one, only to fit the tiny model's context
(both run to tens of thousands of tokens). The final result is the last stdout line.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from claude_agent_sdk import (
    ClaudeAgentOptions,
    ResultMessage,
    create_sdk_mcp_server,
    query,
    tool,
)

QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
         "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
         "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
         "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
         "NO_PROXY": "127.0.0.1,localhost"}


@tool("add", "Add two integers.", {"a": int, "b": int})
async def add(args: dict[str, Any]) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": str(args["a"] + args["b"])}]}


async def main() -> int:
    task = json.load(sys.stdin)
    system = next(m["content"] for m in task["messages"] if m["role"] == "system")
    question = next(m["content"] for m in task["messages"] if m["role"] == "user")
    options = ClaudeAgentOptions(
        model=os.environ["OPENAI_MODEL"], system_prompt=system, tools=[],
        mcp_servers={"calc": create_sdk_mcp_server("calc", tools=[add])},
        allowed_tools=["mcp__calc__add"], max_turns=6, setting_sources=[],
        cli_path=str(Path(__file__).with_name("claude_strace.sh")),
        env={**QUIET, "CLAUDE_CLI": _bundled_cli()})
    result = None
    async for message in query(prompt=question, options=options):
        if isinstance(message, ResultMessage):
            result = message
    _audit_cli()
    if result is None or result.is_error:
        print(f"claude failed: {result}", file=sys.stderr)
        return 1
    print(result.result)
    return 0


def _audit_cli() -> None:
    """Append the CLI's internet-family connects (strace's record) to the network audit's log,
    in its format (``sitecustomize.py``), so the test checks them with the Python ones."""
    log = os.environ["PROXY_NET_LOG"]
    trace = Path(log + ".strace")
    lines = trace.read_text().splitlines() if trace.exists() else []
    with open(log, "a", encoding="utf-8") as out:
        for line in lines:
            found = re.search(r'htons\((\d+)\).*?(?:inet_addr\("([^"]+)"\)|'
                              r'inet_pton\(AF_INET6, "([^"]+)")', line)
            if "connect(" not in line or "AF_UNIX" in line or found is None:
                continue
            host, port = found.group(2) or found.group(3), int(found.group(1))
            out.write(json.dumps({"pid": "claude", "event": "connect",
                                  "target": repr((host, port)), "host": host,
                                  "allowed": ipaddress.ip_address(host).is_loopback}) + "\n")


def _bundled_cli() -> str:
    import claude_agent_sdk

    return str(Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
