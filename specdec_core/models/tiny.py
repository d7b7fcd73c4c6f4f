"""Tiny random-weight models, built in well under a second, so that no test downloads anything.

The tokenizer is real (a byte-level BPE trained on a small built-in corpus), so text round-trips
and chat templates apply just as they do for a downloaded model. The weights are random but drawn
wide enough (`initializer_range` 0.2) that the greedy next token changes with the context: with the
usual 0.02 every context would predict the same token, and speculative decoding tests would pass
for the wrong reason.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)
# ChatML, with tools laid out as Qwen2.5's template lays them out (a system turn listing them in <tools>, calls as
# `<tool_call>` JSON `</tool_call>`, results as `<tool_response>` in a user turn) but with shorter instructions and
# no default system prompt, for a model of 512 positions: without tools, each turn is
# `<|im_start|>role\ncontent<|im_end|>\n`.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall one as <tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- call['function']['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# 256 byte tokens + 3 special tokens + merges learned from the corpus below.
TOKENIZER_VOCAB_SIZE = 384

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model predicts the next token from the ones before it.
Speculative decoding lets a cheap draft model propose tokens that the large target model then verifies.
When the draft is right, several tokens are accepted for the price of one forward pass of the target.
Write a function that returns the sum of a list. Explain what the code does and why it is correct.
def add(a, b):
    return a + b

def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)

class Counter:
    def __init__(self) -> None:
        self.count = 0

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count

for index, value in enumerate(range(10)):
    print(index, value * 2)

import os
import sys
from pathlib import Path

with open(path, "r") as handle:
    for line in handle:
        print(line.strip())
"""


def build_tiny_tokenizer(path: Path | str | None = None) -> Any:
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML special tokens; saved to `path` if given.

    Byte-level means every string encodes (no unknown token) and decodes back to itself.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE
    )
    if path is not None:
        tokenizer.save_pretrained(path)
    return tokenizer


def _family_config(family: str, head_dim: int, intermediate_size: int) -> tuple[type, dict[str, Any]]:
    """The transformers config class per family, and what its config needs besides the common fields (an explicit
    head dim, tiny experts: 4 of 8 with an MLP half the dense one's, or 2 of 4 full ones for Mixtral; Gemma 3's
    sliding window of 8 positions, its layer kinds by its default pattern unless overridden); the only
    family-specific lines in this module."""
    from transformers import Gemma3TextConfig, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    experts = dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=intermediate_size // 2)
    families: dict[str, tuple[type, dict[str, Any]]] = {
        "llama": (LlamaConfig, {}),
        "qwen2": (Qwen2Config, {}),
        "qwen3": (Qwen3Config, dict(head_dim=head_dim)),
        "qwen3_moe": (Qwen3MoeConfig, dict(head_dim=head_dim, norm_topk_prob=True, **experts)),
        "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
        "gemma3_text": (Gemma3TextConfig, dict(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=8)),
    }
    if family not in families:
        raise ValueError(f"family must be one of {sorted(families)}, got {family!r}")
    return families[family]


def build_tiny_model(
    path: Path | str,
    *,
    family: str = "llama",
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    tokenizer_dir: Path | str | None = None,
    dtype: torch.dtype = torch.float32,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Save a random-weight causal LM plus its tokenizer to `path` (a Hugging Face directory).

    `vocab_size` defaults to the tokenizer's size; a larger one pads the embedding, as real models
    do (Qwen's 151,936 rows exceed its tokenizer). `tokenizer_dir` reuses a saved tokenizer, so a
    draft and a target built with different seeds still share one vocabulary. Same seed, same weights.
    `config_overrides`: fields of the family's transformers config to set besides these (e.g. `num_experts`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else build_tiny_tokenizer()
    vocab = vocab_size if vocab_size is not None else len(tokenizer)
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size {vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config_class, family_fields = _family_config(family, hidden_size // num_heads, intermediate_size)
    config = config_class(
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=0.2,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **(family_fields | (config_overrides or {})),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    logger.debug("built tiny %s model at %s (vocab %d, seed %d)", family, path, vocab, seed)
    return path


def build_tiny_pair(root: Path | str) -> Path:
    """The tiny target/draft pair of `specdec models tiny DIR` (and `specdec soak`): `root`/tokenizer, /target
    (qwen2, seed 1, embedding padded past the tokenizer as real models are) and /draft (smaller, seed 2)."""
    root = Path(root)
    build_tiny_tokenizer(root / "tokenizer")
    build_tiny_model(root / "target", family="qwen2", seed=1, tokenizer_dir=root / "tokenizer", vocab_size=400)
    build_tiny_model(
        root / "draft",
        family="qwen2",
        seed=2,
        tokenizer_dir=root / "tokenizer",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        vocab_size=384,
    )
    return root


def build_tiny_gguf(
    path: Path | str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Write a tiny llama-architecture GGUF (float32 tensors, the tiny tokenizer) to the file `path`.

    It exercises the same transformers GGUF loading path as the downloaded models, in milliseconds.
    """
    import gguf

    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    tokens, merges = _vocab_and_merges(tokenizer)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("specdec tiny llama")
    writer.add_context_length(max_position_embeddings)
    writer.add_embedding_length(hidden_size)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(hidden_size // num_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])  # 3: CONTROL, 1: NORMAL
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    shapes = _llama_tensor_shapes(len(tokens), hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size)
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        # norms are scales around 1; everything else random like the HF tiny model
        values = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0.0, 0.2, shape)
        writer.add_tensor(name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _vocab_and_merges(tokenizer: Any) -> tuple[list[str], list[str]]:
    """Tokens ordered by id, and merges as "left right" strings, read from the tokenizer's JSON."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    if [vocab[token] for token in tokens] != list(range(len(tokens))):
        raise AssertionError("tiny tokenizer ids are not contiguous")
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in state["model"]["merges"]]
    return tokens, merges


def _llama_tensor_shapes(
    vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int
) -> dict[str, tuple[int, ...]]:
    """GGUF tensor names with PyTorch-order shapes [out, in]; the writer reverses them on disk."""
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    return shapes
