"""MCP interop peer: the official Python SDK as a client of a server that ends streams early.

    python mcp_resume.py URL MODE [PREFIX]

Calls `interrupted` (see mcp_server.py, `RESUMABLE`), whose server ends the answer's stream
midway and answers after: the call must still give `resumed`. In a session (MODE `legacy`)
both log messages of the call, the one sent after the break included, must arrive. Exits
non-zero on any mismatch.
"""

import asyncio
import sys

from mcp import Client


def fail(message: str) -> None:
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


async def main(url: str, mode: str, prefix: str) -> None:
    logged: list[str] = []

    async def log(params) -> None:
        logged.append(str(params.data))

    async with Client(url, mode=mode, logging_callback=log, read_timeout_seconds=20) as client:
        result = await client.call_tool(f"{prefix}interrupted", {})
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        if result.is_error or texts != ["resumed"]:
            fail(f"interrupted: {result}")
        if mode == "legacy" and logged != ["before the break", "after the break"]:
            fail(f"log messages of the call: {logged}")
        print(f"OK {url} mode={mode} protocol={client.protocol_version} logged={logged}")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[2] not in ("legacy", "2026-07-28"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""))
    except SystemExit:
        raise
    except BaseException as error:  # any SDK/transport error is a failed interop run
        fail(f"{type(error).__name__}: {error}")
