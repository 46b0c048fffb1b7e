"""``rollpool make-tiny-model OUT``: a random-weight causal LM and its tokenizer, saved locally.

For tests, the demo and GPU benchmarks: no download, any size (``--hidden 2048
--layers 16 --heads 32 --kv-heads 8 --vocab 32000`` is a ~0.85 B Llama).
"""

from __future__ import annotations

import argparse

HELP = "build a random-weight model + tokenizer locally (no download) for tests and benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output directory")
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen2"))
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vlm", action="store_true", help="a Qwen2-VL (tiny vision tower, image processor config); implies --arch qwen2")


def run(args: argparse.Namespace) -> int:
    from rollpool.workers.engines.tiny_model import build_tiny_model

    path = build_tiny_model(args.out, arch="qwen2" if args.vlm else args.arch, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                            heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate, seed=args.seed, vlm=args.vlm)
    print(path)
    return 0
