"""MCP interop peer: the official Python SDK (`mcp` 2.x) as a server, both protocol eras.

    python mcp_server.py PORT

Serves `get-sum(a, b)` and `echo(message)` on http://127.0.0.1:PORT/mcp (Streamable HTTP,
sessions on, SSE answers: the SDK's defaults). `GET_SUM_DESCRIPTION` in the environment
replaces get-sum's description: a server that changes a tool after it was reviewed.
With `WITH_CHANGE_TOOL` set it also serves `change`, which tells `subscriptions/listen`
subscribers (2026-07-28) that its tool list changed.
With `SLOW_TOOL_LOG` set to a file it also serves `slow`, which waits a minute, writing
`started` to that file when it begins and `cancelled` if it is cancelled (in 2026-07-28, by
its client closing the request's stream).
With `WITH_ASK_TOOL` set it also serves `ask-sum(a, b)`, which asks the client to confirm
(elicitation) before it adds: mid-call in a session-based revision, as an `input_required`
round in 2026-07-28 (the SDK picks by the revision the client speaks).
With `RESUMABLE` set it keeps its events (in memory) so a client can resume a stream after
the last event it got (2025-11-25), asks clients to wait 200 ms before they do, and serves
`interrupted`, which logs `before the break`, ends its answer's stream midway (SSE polling),
then logs `after the break` and answers `resumed`.
`ONLY_ERA=legacy` or `ONLY_ERA=2026-07-28` serves one revision only, as a server that
predates 2026-07-28 or one that dropped the handshake: the other revision's requests get the
error such a server gives them.
"""

import json
import os
import sys
from typing import Annotated

import anyio
import uvicorn
from pydantic import BaseModel

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.resolve import Elicit, Resolve
from mcp.server.streamable_http import EventMessage, EventStore

MODERN = "2026-07-28"

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


if os.environ.get("SLOW_TOOL_LOG"):

    def note(line: str) -> None:
        with open(os.environ["SLOW_TOOL_LOG"], "a") as log:
            log.write(line + "\n")

    @server.tool()
    async def slow() -> str:
        """Wait a minute."""
        note("started")
        try:
            await anyio.sleep(60)
        except anyio.get_cancelled_exc_class():
            note("cancelled")
            raise
        return "done"


if os.environ.get("WITH_ASK_TOOL"):

    class Confirmation(BaseModel):
        ok: bool

    def confirm(a: int, b: int) -> Elicit[Confirmation]:
        return Elicit(f"Add {a} and {b}?", Confirmation)

    @server.tool(name="ask-sum")
    def ask_sum(a: int, b: int, confirmation: Annotated[Confirmation, Resolve(confirm)]) -> int:
        """Add two integers once the user confirms."""
        if not confirmation.ok:
            raise ToolError("the user did not confirm")
        return a + b


class MemoryEventStore(EventStore):
    """Every event of every stream, in order; enough for a test server."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, object]] = []

    async def store_event(self, stream_id, message):
        event_id = str(len(self.events) + 1)
        self.events.append((event_id, stream_id, message))
        return event_id

    async def replay_events_after(self, last_event_id, send_callback):
        after = next((index for index, (event_id, _, _) in enumerate(self.events) if event_id == last_event_id), None)
        if after is None:
            return None
        stream_id = self.events[after][1]
        for event_id, stream, message in self.events[after + 1:]:
            if stream == stream_id and message is not None:
                await send_callback(EventMessage(message, event_id))
        return stream_id


if os.environ.get("RESUMABLE"):

    @server.tool()
    async def interrupted(ctx: Context) -> str:
        """End this answer's stream midway, as a server polling its clients does, then answer."""
        await ctx.info("before the break")
        await ctx.close_sse_stream()
        await anyio.sleep(0.5)
        await ctx.info("after the break")
        return "resumed"


def only(era: str, app):
    """An ASGI wrapper that refuses the other revision as a one-revision server would."""

    async def refuse(send, status: int, code: int, message: str, request_id) -> None:
        body = json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body.encode()})

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        chunks, more = [], True
        while more:
            event = await receive()
            chunks.append(event.get("body", b""))
            more = event.get("more_body", False)
        body = b"".join(chunks)
        try:
            message = json.loads(body)
        except ValueError:
            message = {}
        method = message.get("method") if isinstance(message, dict) else None
        request_id = message.get("id") if isinstance(message, dict) else None
        headers = dict(scope["headers"])
        modern = headers.get(b"mcp-protocol-version") == MODERN.encode() or method == "server/discover"
        if era == "legacy" and modern:
            # A pre-2026 server: no session, no service.
            return await refuse(send, 400, -32600, "Bad Request: Missing session ID", request_id)
        if era == MODERN and method == "initialize":
            return await refuse(send, 404, -32601, "Method not found: initialize", request_id)

        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await app(scope, replay, send)

    return wrapped


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    resumable = {"event_store": MemoryEventStore(), "retry_interval": 200} if os.environ.get("RESUMABLE") else {}
    app = server.streamable_http_app(**resumable)
    era = os.environ.get("ONLY_ERA")
    if era:
        app = only(era, app)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
