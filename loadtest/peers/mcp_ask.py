"""MCP interop peer: the official Python SDK as a client that answers a server's questions.

    python mcp_ask.py URL MODE [PREFIX]

Calls `ask-sum(2, 3)` (see mcp_server.py, `WITH_ASK_TOOL`) twice: once confirming, which
must give 5, once declining, which must fail. The question reaches this client as a request
mid-call (session-based MODE `legacy`) or as an `input_required` round (MODE `2026-07-28`),
whichever revision the server itself speaks. Exits non-zero on any mismatch.
"""

import asyncio
import sys

import mcp_types as types
from mcp import Client


def fail(message: str) -> None:
    print(f"FAIL: {message}", file=sys.stderr)
    sys.exit(1)


async def main(url: str, mode: str, prefix: str) -> None:
    questions: list[str] = []
    answer = {"ok": True}

    async def elicit(context, params):
        questions.append(params.message)
        return types.ElicitResult(action="accept", content=dict(answer))

    async with Client(url, mode=mode, elicitation_callback=elicit) as client:
        result = await client.call_tool(f"{prefix}ask-sum", {"a": 2, "b": 3})
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        if result.is_error or texts != ["5"]:
            fail(f"ask-sum(2, 3) confirmed: {result}")
        if questions != ["Add 2 and 3?"]:
            fail(f"questions asked: {questions}")

        answer["ok"] = False
        result = await client.call_tool(f"{prefix}ask-sum", {"a": 2, "b": 3})
        texts = " ".join(block.text for block in result.content if getattr(block, "type", None) == "text")
        if not result.is_error or "did not confirm" not in texts:
            fail(f"ask-sum(2, 3) declined: {result}")
        print(f"OK {url} mode={mode} protocol={client.protocol_version} questions={len(questions)}")


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
