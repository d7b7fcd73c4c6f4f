"""A decoder-only transformer for the Llama family (Llama, Qwen2, SmolLM2, Mistral without sliding window).

The model owns no cache: every forward receives the `KVCache` and the cache slot of each row, and writes the
new keys and values *by position*. Rolling back rejected draft tokens is therefore just moving a length in the
cache; the model never needs to know that speculation exists. The model knows nothing of tensor parallelism
either: sharding is applied to a built model from outside (`num_heads` / `num_kv_heads` of each attention module
are the *local* counts, which is all the forward uses).

Notation: B batch rows, T new tokens per row (rows shorter than T are padded at the end), S key positions read
from the cache, D hidden size, H query heads, Hkv key/value heads, hd head dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec_core.kv_cache import KVCache


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of one model; built from a Hugging Face config by `families.args_from_hf_config`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool = False  # Qwen2 has biases on q/k/v
    tie_word_embeddings: bool = False
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # llama3-style frequency scaling, as items


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as the reference implementations do; this
        # keeps our logits bit-compatible enough that greedy outputs match theirs.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies [hd/2], with llama3 scaling when the config asks for it."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    if not args.rope_scaling:
        return inv_freq
    s = dict(args.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        hd = args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * hd, bias=args.attention_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * hd, bias=args.attention_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * hd, bias=args.attention_bias)
        self.o_proj = nn.Linear(args.num_heads * hd, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, H, hd]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, hd]
        out = ctx.attention(q, k, v, ctx, layer)  # [B, T, H, hd]; applies the rotary embedding
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class TorchAttention:
    """Attention with torch's SDPA: rotate q and k, write the new keys/values into the cache, attend over the
    valid prefix."""

    needs_tables = True  # the forward context must carry the mask and the cos/sin tables

    def __call__(
        self,
        q: torch.Tensor,  # [B, T, H, hd]
        k: torch.Tensor,  # [B, T, Hkv, hd]
        v: torch.Tensor,  # [B, T, Hkv, hd]
        ctx: ForwardContext,
        layer: int,
    ) -> torch.Tensor:  # [B, T, H, hd]
        q = q * ctx.cos + rotate_half(q) * ctx.sin
        k = k * ctx.cos + rotate_half(k) * ctx.sin
        ctx.cache.write(layer, ctx.slots, ctx.positions, k, v, ctx.single)
        keys, values = ctx.cache.read(layer, ctx.slots, ctx.num_keys, ctx.single)  # [B, Hkv, S, hd] each
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=ctx.mask, enable_gqa=q.shape[2] != k.shape[2]
        )  # [B, H, T, hd]
        return out.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class ForwardContext:
    """What every layer of one forward shares: where to write, what to attend to."""

    cache: KVCache
    slots: torch.Tensor  # [B] cache slot of each row
    positions: torch.Tensor  # [B, T] absolute position of each new token
    cos: torch.Tensor | None  # [B, T, 1, hd]
    sin: torch.Tensor | None  # [B, T, 1, hd]
    mask: torch.Tensor | None  # [B, 1, T, S] True where a query may attend a key; None when all may
    num_keys: int  # S
    single: tuple[int, int] | None  # (slot, first position) when B == 1
    attention: Any  # the attention backend: (q, k, v, ctx, layer) -> output; writes the cache


def run_in_turn(layers: nn.ModuleList, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [B, T, D]
    for layer in layers:
        x = layer(x, ctx)
    return x


class Transformer(nn.Module):
    """Llama-family decoder. Parameter names follow Hugging Face's so checkpoints load without renaming."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        # Swappable from outside (kernels.surgery): how a layer attends over the cache, and how the layers run (one
        # after the other, or all in one call where a kernel can: `kernels.layers_quant`).
        self.attention: Any = TorchAttention()
        self.run_layers: Any = run_in_turn

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.num_embeddings

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: KVCache,
        slots: torch.Tensor,  # [B]
        num_keys: int,  # S: key positions to read, max over rows of (position of last new token + 1)
        single: tuple[int, int] | None = None,  # (slot, first position) when B == 1: lets the cache use views
        logit_index: torch.Tensor | None = None,  # [B, N] which of the T positions need logits; None = all
        extra_vocab: torch.Tensor | None = None,  # [E] ids a cut head (`vocab_head.VocabHead`) scores besides its own
    ) -> torch.Tensor:  # [B, N, V] float32
        ctx = self._context(tokens, positions, cache, slots, num_keys, single)
        x = self.run_layers(self.layers, self.embed_tokens(tokens), ctx)  # [B, T, D]
        if logit_index is not None:
            x = x.gather(1, logit_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [B, N, D]
        x = self.norm(x)
        return (self.lm_head(x) if extra_vocab is None else self.lm_head(x, extra_vocab)).float()  # [B, N, V]

    def _context(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        slots: torch.Tensor,
        num_keys: int,
        single: tuple[int, int] | None,
    ) -> ForwardContext:
        B, T = tokens.shape
        cos = sin = mask = None
        if self.attention.needs_tables:
            freqs = positions.unsqueeze(-1).float() * self.inv_freq  # [B, T, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [B, T, 1, hd]
            dtype = self.embed_tokens.weight.dtype
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            if T > 1 or B > 1:
                # A new token at position i sees every cached key at j <= i: the prefix, and itself.
                key_pos = torch.arange(num_keys, device=tokens.device)  # [S]
                mask = key_pos.view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)  # [B, 1, T, S]
        return ForwardContext(
            cache=cache,
            slots=slots,
            positions=positions,
            cos=cos,
            sin=sin,
            mask=mask,
            num_keys=num_keys,
            single=single,
            attention=self.attention,
        )
