"""A tiny random-weight causal LM and a matching tokenizer, built locally.

`build_tiny_model(path, ...)` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load (and that SGLang can load): a Llama or Qwen2 config with random weights
(seeded, so the same arguments give the same model), and a byte-level BPE
tokenizer trained on a handful of strings with a chat template. Nothing is
downloaded. With ``vlm=True`` it is a Qwen2-VL (``Qwen2VLForConditionalGeneration``, which
transformers and SGLang both serve) with a one-block vision tower, the vision special tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``) and the Qwen2-VL
image processor's config (``preprocessor_config.json``, small image sizes: 56x56 to 112x112 pixels
after resizing, 4 to 16 image tokens). The demo and the tests use it; so can ``rollpool make-tiny-model OUT``
(`rollpool.cli.make_tiny_model`).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

__all__ = ["build_tiny_model"]

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END, TOOL_CALL, TOOL_CALL_END)
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

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
    vlm: bool = False,
) -> pathlib.Path:
    """Write a random-weight model and its tokenizer to `path`; returns the path (`vlm`: a Qwen2-VL, see above)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    if vlm and arch != "qwen2":
        raise ValueError(f"a vlm is a Qwen2-VL: arch must be 'qwen2', got {arch!r}")
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
    if vlm:
        fast.add_tokens(list(VISION_TOKENS), special_tokens=True)
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
    if vlm:
        model: torch.nn.Module = _tiny_qwen2_vl(out, fast, common, hidden)
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    # random init is tiny; widen the logits a little so sampling is not uniform noise
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # type: ignore[operator]
    model.save_pretrained(out)  # type: ignore[operator]
    (out / "rollpool_tiny.json").write_text(
        json.dumps({"arch": "qwen2_vl" if vlm else arch, "vocab": real_vocab, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads, "seed": seed})
    )
    return out


def _tiny_qwen2_vl(out: pathlib.Path, tok: Any, common: dict[str, Any], hidden: int) -> Any:
    """A Qwen2-VL of the text sizes in `common` with a one-block vision tower; writes the image processor's config."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in VISION_TOKENS}
    heads = int(common["num_attention_heads"])
    head_dim = hidden // heads
    # mrope splits each head's rotary half-dimension over (t, h, w)
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]
    text = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    text.pop("torch_dtype", None)
    # `in_chans` beside transformers' own `in_channels`: released Qwen2-VL checkpoints carry it and SGLang's
    # vision tower reads it (without it SGLang's loader fails with an AttributeError)
    cfg = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(depth=1, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_chans=3),
        image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        bos_token_id=common["bos_token_id"], eos_token_id=common["eos_token_id"], pad_token_id=common["pad_token_id"],
        tie_word_embeddings=False,
    )
    model = Qwen2VLForConditionalGeneration(cfg)
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    processor.save_pretrained(out)
    # AutoProcessor (SGLang's loader) builds the full processor from the saved parts where torchvision is installed
    cfg_path = out / "preprocessor_config.json"
    pre = json.loads(cfg_path.read_text())
    pre["processor_class"] = "Qwen2VLProcessor"
    # the bounds under their older names too: transformers 5 saves them as ``size`` only, and on the H100 SGLang's
    # processor (transformers 5.8.1) expanded a 224 px image to 64 tokens where the worker's, reading ``size``, made 16
    pre["min_pixels"], pre["max_pixels"] = 56 * 56, 112 * 112
    cfg_path.write_text(json.dumps(pre, indent=2))
    return model
