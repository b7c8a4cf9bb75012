"""Checks a simulated vLLM pod with the official `openai` client.

Usage: python openai_stream.py http://127.0.0.1:8000 [MODEL]

Streams one chat completion with `stream_options={"include_usage": True}` and exits non-zero
unless the content arrived in several chunks, spread over time (incremental, not one buffered
burst), and a final usage chunk reported the exact completion length.
"""

import sys
import time

from openai import OpenAI

MAX_TOKENS = 24


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    base = sys.argv[1].rstrip("/")
    model = sys.argv[2] if len(sys.argv) > 2 else "Qwen/Qwen3-32B"
    client = OpenAI(base_url=f"{base}/v1", api_key="sim", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about routers."}],
        max_completion_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    arrivals = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    problems = []
    if len(arrivals) < 2:
        problems.append(f"only {len(arrivals)} content chunks")
    elif arrivals[-1] - arrivals[0] <= 0:
        problems.append("all content chunks arrived at once")
    if usage is None:
        problems.append("no usage chunk")
    elif usage.completion_tokens != MAX_TOKENS:
        problems.append(f"usage.completion_tokens = {usage.completion_tokens}")
    if problems:
        print("FAIL: " + "; ".join(problems), file=sys.stderr)
        return 1
    spread_ms = (arrivals[-1] - arrivals[0]) * 1000
    print(
        f"OK: {len(arrivals)} content chunks over {spread_ms:.1f} ms, "
        f"usage prompt={usage.prompt_tokens} completion={usage.completion_tokens} "
        f"cached={getattr(usage.prompt_tokens_details, 'cached_tokens', None)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
