"""MCP interop peer: the official Python SDK (`mcp` 2.x) as a server, both protocol eras.

    python mcp_server.py PORT

Serves `get-sum(a, b)` and `echo(message)` on http://127.0.0.1:PORT/mcp (Streamable HTTP,
sessions on, SSE answers: the SDK's defaults). `GET_SUM_DESCRIPTION` in the environment
replaces get-sum's description: a server that changes a tool after it was reviewed.
With `WITH_CHANGE_TOOL` set it also serves `change`, which tells `subscriptions/listen`
subscribers (2026-07-28) that its tool list changed.
"""

import os
import sys

from mcp.server import MCPServer
from mcp.server.mcpserver import Context

server = MCPServer("PythonPeer")


@server.tool(name="get-sum", description=os.environ.get("GET_SUM_DESCRIPTION"))
def get_sum(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def echo(message: str) -> str:
    """Echo the message back."""
    return message


if os.environ.get("WITH_CHANGE_TOOL"):

    @server.tool()
    async def change(ctx: Context) -> str:
        """Tell listeners the tool list changed."""
        await ctx.notify_tools_changed()
        return "told"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
