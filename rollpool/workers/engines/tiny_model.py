"""A tiny random-weight causal LM and a matching tokenizer, built locally.

`build_tiny_model(path, ...)` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load (and that SGLang can load): a Llama or Qwen2 config with random weights
(seeded, so the same arguments give the same model), and a byte-level BPE
tokenizer trained on a handful of strings with a chat template. Nothing is
downloaded. The demo and the tests use it; so can ``rollpool make-tiny-model OUT``
(`rollpool.cli.make_tiny_model`).
"""

from __future__ import annotations

import json
import pathlib

__all__ = ["build_tiny_model"]

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END, TOOL_CALL, TOOL_CALL_END)

# ChatML with tools: the tool list is rendered into the system turn, an assistant's tool calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call> (the call markers are special tokens, the
# format of the `hermes` tool-call parser), a tool result as a `tool` turn.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=0) -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{ messages[0]['content'] + '\\n' }}{%- set ns.first = 1 -%}{%- endif -%}"
    "{{ 'Tools:\\n' }}{%- for tool in tools -%}{{ tool | tojson + '\\n' }}{%- endfor -%}"
    "{{ 'Call a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages[ns.first:] -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{ '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "What is 12 plus 30? The answer is 42.",
    "one two three four five six seven eight nine ten",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) ? ! . ,",
    "Reinforcement learning of language models with asynchronous rollouts.",
    "user assistant system: please answer the question step by step",
)


def build_tiny_model(
    path: str | pathlib.Path,
    *,
    arch: str = "llama",
    vocab: int = 384,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 2048,
    seed: int = 0,
) -> pathlib.Path:
    """Write a random-weight model and its tokenizer to `path`; returns the path."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    if vocab < 256 + len(SPECIAL_TOKENS) + 8:
        raise ValueError(f"vocab must be >= {256 + len(SPECIAL_TOKENS) + 8} (byte-level BPE), got {vocab}")
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END, TOOL_CALL, TOOL_CALL_END],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    real_vocab = max(vocab, len(fast))

    common = dict(
        vocab_size=real_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    if arch == "llama":
        model: torch.nn.Module = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    # random init is tiny; widen the logits a little so sampling is not uniform noise
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # type: ignore[operator]
    model.save_pretrained(out)  # type: ignore[operator]
    (out / "rollpool_tiny.json").write_text(
        json.dumps({"arch": arch, "vocab": real_vocab, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "seed": seed})
    )
    return out
