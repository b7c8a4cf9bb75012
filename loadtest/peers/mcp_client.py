"""MCP interop peer: the official Python SDK (`mcp` 2.x) as a client of a Portcullis MCP URL.

    python mcp_client.py URL [MODE] [EXPECTED_TOOLS] [PREFIX]

MODE is `auto` (default: probe `server/discover`, fall back to `initialize`), `legacy`
(initialize handshake, sessions) or `2026-07-28` (stateless, no probe). Lists the tools,
checks `echo` and `get-sum` are there (and the count, if given), calls get-sum(2, 3) and
echo("hello"), and exits non-zero on any mismatch or error. PREFIX is put before the tool
names (`py__` for the tools of server `py` behind a multiplexing gateway).
"""

import asyncio
import sys

from mcp import Client

EXPECTED_ERA = {"legacy": "handshake", "2026-07-28": "modern", "auto": None}


def fail(message: str) -> None:
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


async def main(url: str, mode: str, expected_tools: int | None, prefix: str) -> None:
    async with Client(url, mode=mode) as client:
        version = client.protocol_version
        modern = version == "2026-07-28"
        if EXPECTED_ERA[mode] == "modern" and not modern:
            fail(f"mode {mode} negotiated {version}")
        if EXPECTED_ERA[mode] == "handshake" and modern:
            fail(f"mode {mode} negotiated {version}")

        tools = (await client.list_tools()).tools
        names = {tool.name for tool in tools}
        if not {f"{prefix}echo", f"{prefix}get-sum"} <= names:
            fail(f"echo/get-sum missing from {sorted(names)[:10]}")
        if expected_tools is not None and len(tools) != expected_tools:
            fail(f"expected {expected_tools} tools, got {len(tools)}")

        result = await client.call_tool(f"{prefix}get-sum", {"a": 2, "b": 3})
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        if result.is_error or texts != ["5"]:
            fail(f"get-sum(2, 3): {result}")
        if result.structured_content is not None and result.structured_content.get("result") != 5:
            fail(f"get-sum structured content: {result.structured_content}")

        result = await client.call_tool(f"{prefix}echo", {"message": "hello"})
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        if result.is_error or texts != ["hello"]:
            fail(f"echo: {result}")

        print(f"OK {url} mode={mode} protocol={version} tools={len(tools)}")


if __name__ == "__main__":
    if len(sys.argv) < 2 or (len(sys.argv) > 2 and sys.argv[2] not in EXPECTED_ERA):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "auto",
                         int(sys.argv[3]) if len(sys.argv) > 3 else None,
                         sys.argv[4] if len(sys.argv) > 4 else ""))
    except SystemExit:
        raise
    except BaseException as error:  # any SDK/transport error is a failed interop run
        fail(f"{type(error).__name__}: {error}")
