"""A small MCP server for tests/test_mcp.py, written with the official SDK's MCPServer.

Run as a subprocess: ``python tests/mcp_server.py`` (stdio) or
``python tests/mcp_server.py --http PORT`` (streamable HTTP on 127.0.0.1).
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("test-tools")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def pid() -> int:
    """The server process's id (tells one server process from another)."""
    return os.getpid()


@app.tool()
def crash() -> str:
    """Kill the server process mid-call."""
    print("about to crash", file=sys.stderr, flush=True)
    os._exit(3)


@app.tool()
def hang(seconds: float = 60.0) -> str:
    """Block for a long time."""
    time.sleep(seconds)
    return "woke up"


@app.tool()
def noisy() -> str:
    """Write a line that is not JSON-RPC to stdout before answering."""
    sys.stdout.write("this is not json-rpc\n")
    sys.stdout.flush()
    return "answered anyway"


@app.tool()
def fails(reason: str) -> str:
    """Fail the call: the server answers with an isError result."""
    raise ToolError(f"refused: {reason}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
