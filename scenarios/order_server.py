"""The order-lookup MCP server of ``scenarios/order_desk.py`` (stdio, the official ``mcp``
SDK's MCPServer): started as a subprocess by the scenario, one per rollout worker.

Run on its own: ``python -m scenarios.order_server`` (speaks MCP on stdin/stdout).
"""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

ORDERS = {"A-100": "shipped on Monday", "A-101": "waiting for payment",
          "A-102": "delivered yesterday", "A-103": "cancelled by the customer"}

app = MCPServer("orders")


@app.tool()
def order_status(order_id: str) -> str:
    """The status of an order, by its id (e.g. A-100)."""
    if order_id not in ORDERS:
        raise ToolError(f"no order {order_id!r}")
    return ORDERS[order_id]


if __name__ == "__main__":
    app.run()
