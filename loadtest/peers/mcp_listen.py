"""MCP interop peer: the official Python SDK (`mcp` 2.x) hearing of list changes, either revision.

    python mcp_listen.py URL TOOL [MODE]

MODE `2026-07-28` (default): opens `subscriptions/listen` for tool list changes on URL,
checks the acknowledgment honors it, calls TOOL (a tool that says its server's tool list
changed), and waits for the change on the subscription.
MODE `legacy`: initializes a session, checks the server offers `tools.listChanged`, and
calls TOOL until the change arrives on the session's stream (the SDK opens that stream in
the background after `initialize`, so the first calls may come before it is there).
Exits 0 once the change arrives, non-zero on any mismatch, error or a 10 s wait.
"""

import asyncio
import sys

from mcp import Client, types
from mcp.shared.subscriptions import ToolsListChanged


def fail(message: str) -> None:
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


async def call(client: Client, tool: str) -> None:
    result = await client.call_tool(tool, {})
    if result.is_error:
        fail(f"{tool}: {result}")


async def listen_modern(url: str, tool: str) -> None:
    async with Client(url, mode="2026-07-28") as client:
        async with client.listen(tools_list_changed=True) as subscription:
            if not subscription.honored.tools_list_changed:
                fail(f"tool list changes not honored: {subscription.honored}")
            await call(client, tool)
            event = await asyncio.wait_for(subscription.__anext__(), 10)
            if not isinstance(event, ToolsListChanged):
                fail(f"expected a tool list change, got {event!r}")


async def listen_in_session(url: str, tool: str) -> None:
    changed = asyncio.Event()

    async def on_message(message) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    async with Client(url, mode="legacy", message_handler=on_message) as client:
        offered = client.server_capabilities.tools
        if offered is None or not offered.list_changed:
            fail(f"tools.listChanged not offered: {client.server_capabilities}")
        for _ in range(20):
            await call(client, tool)
            try:
                await asyncio.wait_for(changed.wait(), 0.5)
                return
            except TimeoutError:
                continue
        fail("no tool list change on the session's stream within 10 s")


async def main(url: str, tool: str, mode: str) -> None:
    if mode == "legacy":
        await listen_in_session(url, tool)
    else:
        await listen_modern(url, tool)
    print(f"OK {url} mode={mode} heard the tool list change")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or (len(sys.argv) == 4 and sys.argv[3] not in ("legacy", "2026-07-28")):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) == 4 else "2026-07-28"))
    except Exception as error:  # noqa: BLE001 - any failure is the peer's verdict
        fail(f"{type(error).__name__}: {error}")
