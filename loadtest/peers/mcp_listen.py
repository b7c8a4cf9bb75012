"""MCP interop peer: the official Python SDK (`mcp` 2.x) listening for list changes (2026-07-28).

    python mcp_listen.py URL TOOL

Opens `subscriptions/listen` for tool list changes on URL, checks the acknowledgment honors
it, calls TOOL (a tool that says its server's tool list changed), and exits 0 once the
change arrives on the subscription, non-zero on any mismatch, error or a 10 s wait.
"""

import asyncio
import sys

from mcp import Client
from mcp.shared.subscriptions import ToolsListChanged


def fail(message: str) -> None:
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


async def main(url: str, tool: str) -> None:
    async with Client(url, mode="2026-07-28") as client:
        async with client.listen(tools_list_changed=True) as subscription:
            if not subscription.honored.tools_list_changed:
                fail(f"tool list changes not honored: {subscription.honored}")
            result = await client.call_tool(tool, {})
            if result.is_error:
                fail(f"{tool}: {result}")
            event = await asyncio.wait_for(subscription.__anext__(), 10)
            if not isinstance(event, ToolsListChanged):
                fail(f"expected a tool list change, got {event!r}")
    print(f"OK {url} heard the tool list change")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(main(sys.argv[1], sys.argv[2]))
    except Exception as error:  # noqa: BLE001 - any failure is the peer's verdict
        fail(f"{type(error).__name__}: {error}")
