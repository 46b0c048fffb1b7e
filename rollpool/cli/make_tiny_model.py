"""``rollpool make-tiny-model OUT``: a random-weight causal LM and its tokenizer, saved locally.

For tests, the demo and GPU benchmarks: no download, any size (``--hidden 2048
--layers 16 --heads 32 --kv-heads 8 --vocab 32000`` is a ~0.85 B Llama).
"""

from __future__ import annotations

import argparse

HELP = "build a random-weight model + tokenizer locally (no download) for tests and benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output directory (created; the model's config, weights and tokenizer go there)")
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen2"), help="model architecture (default llama)")
    parser.add_argument("--vocab", type=int, default=384, help="vocabulary size (default 384)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads, dividing --heads (default 2)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP size (default: the architecture's rule from --hidden)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--vlm", action="store_true", help="a Qwen2-VL (tiny vision tower, image processor config); implies --arch qwen2")


def run(args: argparse.Namespace) -> int:
    from rollpool.workers.engines.tiny_model import build_tiny_model

    path = build_tiny_model(args.out, arch="qwen2" if args.vlm else args.arch, vocab=args.vocab, hidden=args.hidden, layers=args.layers,
                            heads=args.heads, kv_heads=args.kv_heads, intermediate=args.intermediate, seed=args.seed, vlm=args.vlm)
    print(path)
    return 0
