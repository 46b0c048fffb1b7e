"""The demo's verifiable task: name the largest of four digits.

A prompt is ``<s> d1 d2 d3 d4 <sep>`` with four random digits; the answer is
one token, the largest digit. The answer depends on every digit of the prompt
(it is not a constant or a fixed lookup), a random policy over the 15-token
vocabulary is right about 1 time in 15, and a small transformer can learn it
by RL from scratch in a few dozen GRPO steps on a CPU.

The reward is computed on the workers through the ``--reward`` path:
``rollpool.demo.task:reward(metadata, trajectory)`` returns 1.0 when the first
output token is the answer in the prompt's metadata, else 0.0. A fixed,
seeded set of held-out prompts is never used in training.
"""

from __future__ import annotations

import math
import pathlib
import random
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "VOCAB",
    "BOS_ID",
    "EOS_ID",
    "SEP_ID",
    "PAD_ID",
    "NUM_DIGITS",
    "reward",
    "make_example",
    "held_out_set",
    "build_demo_model",
    "build_word_model",
    "expected_reward",
    "tail_length",
]

SPECIALS = ["<pad>", "<s>", "</s>", "<sep>", "<unk>"]
VOCAB = SPECIALS + [str(d) for d in range(10)]
PAD_ID, BOS_ID, EOS_ID, SEP_ID, UNK_ID = range(5)
DIGIT0_ID = len(SPECIALS)
NUM_DIGITS = 4


def digit_id(d: int) -> int:
    return DIGIT0_ID + d


def make_example(rng: random.Random) -> tuple[list[int], int]:
    """(prompt token ids, answer token id)."""
    digits = [rng.randrange(10) for _ in range(NUM_DIGITS)]
    return [BOS_ID, *map(digit_id, digits), SEP_ID], digit_id(max(digits))


def held_out_set(n: int = 200, seed: int = 12345) -> list[tuple[list[int], int]]:
    """A fixed set of prompts never used for training (see `is_held_out`)."""
    rng = random.Random(seed)
    seen: dict[tuple[int, ...], int] = {}
    while len(seen) < n:
        ids, ans = make_example(rng)
        seen[tuple(ids)] = ans
    return [(list(k), v) for k, v in seen.items()]


_HELD_OUT = {tuple(ids) for ids, _ in held_out_set()}


def training_example(rng: random.Random) -> tuple[list[int], int]:
    """Like `make_example`, skipping held-out prompts."""
    while True:
        ids, ans = make_example(rng)
        if tuple(ids) not in _HELD_OUT:
            return ids, ans


def reward(metadata: Mapping[str, Any], trajectory: Any) -> float:
    """1.0 when the first generated token is the answer, else 0.0 (runs on the workers)."""
    answer = metadata.get("answer_id")
    out = trajectory.output_ids
    if answer is None or len(out) == 0:
        return 0.0
    return 1.0 if int(out[0]) == int(answer) else 0.0


SLOW_ENV = "ROLLPOOL_DEMO_SLOW_S"
"""Seconds `slow_reward` waits (set by the demo on its slowed worker only, ``--slow-worker-s``)."""


async def slow_reward(metadata: Mapping[str, Any], trajectory: Any) -> float:
    """`reward` after a wait of ``$ROLLPOOL_DEMO_SLOW_S`` seconds: the demo's stand-in for a slow worker
    (the samples of a group are scored side by side, so the whole group arrives that much later)."""
    import asyncio
    import os

    await asyncio.sleep(float(os.environ.get(SLOW_ENV, "0") or 0))
    return reward(metadata, trajectory)


def build_demo_model(path: str | pathlib.Path, *, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0,
                     max_positions: int = 64, head_std: float | None = None) -> pathlib.Path:
    """A random-weight Llama over the task's 15-token word-level vocabulary, with its tokenizer.

    `head_std`: the output layer's weights drawn with this standard deviation instead of the config's 0.02. The
    LoRA demo's frozen base uses 1/sqrt(hidden): with 0.02 the logits of a normalised hidden state stay within
    about +-1.3, so no adapter on the layers below can make the policy confident (its entropy stays near uniform);
    at 1/sqrt(hidden) a hidden state the adapter writes can reach logits of several units."""
    return build_word_model(path, VOCAB, hidden=hidden, layers=layers, heads=heads, seed=seed, max_positions=max_positions,
                            head_std=head_std)


def tail_length(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    """The long-tail setup's output length of one prompt (the answer token included): lognormal around `median`
    with `sigma`, at least 1, at most `cap`."""
    return max(1, min(cap, round(math.exp(math.log(median) + sigma * rng.gauss(0.0, 1.0)))))


def expected_reward(model: Any, examples: Sequence[tuple[list[int], int]], *, autocast: bool = False) -> float:
    """The mean probability the model gives each example's answer as its first output token: the expected reward
    of sampling at temperature 1 (no sampling noise), from one forward pass on the model's device."""
    import torch

    device = next(iter(model.parameters())).device
    ids = torch.tensor([e[0] for e in examples], device=device)
    answers = torch.tensor([e[1] for e in examples], device=device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and device.type == "cuda"):
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1, :].float()
    return float(torch.softmax(logits, dim=-1)[torch.arange(len(examples), device=device), answers].mean().item())


def build_word_model(path: str | pathlib.Path, vocab: Sequence[str], *, special_tokens: Sequence[str] = (),
                     chat_template: str | None = None, hidden: int = 64, layers: int = 2, heads: int = 4,
                     tie_embeddings: bool = False, seed: int = 0, max_positions: int = 64, head_std: float | None = None) -> pathlib.Path:
    """A random-weight Llama over a word-level `vocab` (which starts with `SPECIALS`), with its tokenizer.

    `special_tokens` are more special tokens of `vocab` (never split, dropped by
    ``decode(skip_special_tokens=True)``); `chat_template` is saved with the tokenizer;
    `tie_embeddings` shares the input embedding with the output layer.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if list(vocab[: len(SPECIALS)]) != SPECIALS:
        raise ValueError(f"the vocabulary must start with {SPECIALS}")
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", sep_token="<sep>",
                                   **({"additional_special_tokens": list(special_tokens)} if special_tokens else {}))
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=tie_embeddings,
    )
    model = LlamaForCausalLM(config)
    if head_std is not None:
        if tie_embeddings:
            raise ValueError("head_std with tie_embeddings would rescale the input embedding too")
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, head_std)
    model.save_pretrained(out, safe_serialization=True)
    return out
