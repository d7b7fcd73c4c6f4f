"""A decoder-only transformer in the Llama layout (RMSNorm, RoPE, SwiGLU, grouped-query attention), with optional
per-family features: q/k/v biases, a per-head RMSNorm on q and k (Qwen3), a sparse mixture-of-experts MLP
(Qwen3-MoE, Mixtral; `moe.py`), and Gemma 3's: (1 + weight) norms, GeGLU, sandwich norms, scaled embeddings,
soft-capped logits (`variants.py`), an attention scale of its own, and sliding-window layers with their own RoPE
base (`window.py`). `families.py` lists the families it serves.

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
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec_core.kv_cache import KVCache
from specdec_core.models.moe import MoEArgs, SparseMoE
from specdec_core.models.variants import (
    GatedMLP,
    SandwichDecoderLayer,
    UnitOffsetRMSNorm,
    scaled_embedding,
    softcap,
)
from specdec_core.models.window import WindowTables, ring_and_new, window_tables


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
    output_bias: bool = False  # a bias on o_proj (Llama and Qwen3 with `attention_bias`)
    qk_norm: bool = False  # RMSNorm over head_dim on each head of q and k, before the rotary embedding (Qwen3)
    moe: MoEArgs | None = None  # sparse MLP layers (Qwen3-MoE, Mixtral); None: every MLP is dense
    # Gemma 3's features (`variants.py`, `window.py`); the defaults are the Llama layout's.
    norm_unit_offset: bool = False  # every RMSNorm scales by (1 + weight), in float32
    hidden_act: str = "silu"  # the dense MLP's gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too, and one before the MLP
    embed_scale: float | None = None  # embeddings multiplied by this (rounded to the model dtype first)
    attention_scale: float | None = None  # of the attention scores; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_linear_factor: float = 1.0  # linear RoPE scaling (positions divided by it), of the full layers only
    sliding_window: int | None = None  # W: a windowed layer's query at position i sees keys i-W+1 .. i
    windowed_layers: tuple[int, ...] = ()  # the layers with that window; the others see every earlier key
    window_rope_theta: float | None = None  # RoPE base of the windowed layers (never scaled); None: rope_theta

    @property
    def plain_attention(self) -> bool:
        """Every layer attends over its whole prefix with the usual scale and one rotary table: what the CPU
        attention kernel and the cacheless training forward compute."""
        return not self.windowed_layers and self.attention_scale is None


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


def make_norm(args: ModelArgs, dim: int) -> nn.Module:
    """One of the model's RMSNorms over `dim` features."""
    return UnitOffsetRMSNorm(dim, args.rms_norm_eps) if args.norm_unit_offset else RMSNorm(dim, args.rms_norm_eps)


def window_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies [hd/2] of the windowed layers (those of the others where they share them)."""
    if args.window_rope_theta is None:
        return rope_inv_freq(args)
    hd = args.head_dim
    return 1.0 / (args.window_rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse RoPE frequencies [hd/2], with linear or llama3 scaling when the config asks for it."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)) / args.rope_linear_factor
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
        self.o_proj = nn.Linear(args.num_heads * hd, args.hidden_size, bias=args.output_bias)
        self.q_norm = make_norm(args, hd) if args.qk_norm else None
        self.k_norm = make_norm(args, hd) if args.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext, layer: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)  # [B, T, H, hd]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, hd]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, hd]
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the backend rotates them
            q, k = self.q_norm(q), self.k_norm(k)
        out = ctx.attention(q, k, v, ctx, layer)  # [B, T, H, hd]; applies the rotary embedding
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class TorchAttention:
    """Attention with torch's SDPA: rotate q and k, write the new keys/values into the cache, attend over the
    valid prefix; a windowed layer over its ring and the new keys (`window.py`). `scale`: the model's
    `attention_scale` (None: SDPA's own, head_dim ** -0.5)."""

    needs_tables = True  # the forward context must carry the mask and the cos/sin tables

    def __init__(self, scale: float | None = None) -> None:
        self.scale = scale

    def __call__(
        self,
        q: torch.Tensor,  # [B, T, H, hd]
        k: torch.Tensor,  # [B, T, Hkv, hd]
        v: torch.Tensor,  # [B, T, Hkv, hd]
        ctx: ForwardContext,
        layer: int,
    ) -> torch.Tensor:  # [B, T, H, hd]
        window = ctx.window if ctx.window is not None and layer in ctx.window.layers else None
        cos, sin = (ctx.cos, ctx.sin) if window is None else (window.cos, window.sin)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if window is not None:
            keys, values = ring_and_new(ctx.cache, layer, ctx.slots, ctx.positions, k, v, ctx.single)
            mask = window.mask
        else:
            ctx.cache.write(layer, ctx.slots, ctx.positions, k, v, ctx.single)
            keys, values = ctx.cache.read(layer, ctx.slots, ctx.num_keys, ctx.single)  # [B, Hkv, S, hd] each
            mask = ctx.mask
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=q.shape[2] != k.shape[2]
        )  # [B, H, T, hd]
        return out.transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = args.intermediate_size if intermediate_size is None else intermediate_size  # an expert's: its own
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def feed_forward(args: ModelArgs, index: int) -> nn.Module:
    """Layer `index`'s MLP: sparse where the model's experts are (`args.moe.layers`), else dense."""
    moe = args.moe
    if moe is None or index not in moe.layers:
        if args.hidden_act != "silu":  # GeGLU: its own module, which the kernels' SwiGLU never replaces
            return GatedMLP(args.hidden_size, args.intermediate_size, args.hidden_act)
        return MLP(args)
    return SparseMoE(moe, args.hidden_size, [MLP(args, moe.intermediate_size) for _ in range(moe.num_experts)])


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.index = index
        self.self_attn = Attention(args)
        self.mlp = feed_forward(args, index)
        self.input_layernorm = make_norm(args, args.hidden_size)
        self.post_attention_layernorm = make_norm(args, args.hidden_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))


def decoder_layer(args: ModelArgs, index: int) -> nn.Module:
    """Layer `index`: the Llama layout, or with sandwich norms (`variants.SandwichDecoderLayer`)."""
    if not args.sandwich_norms:
        return DecoderLayer(args, index)
    norm = partial(make_norm, args, args.hidden_size)
    return SandwichDecoderLayer(index, Attention(args), feed_forward(args, index), norm)


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
    window: WindowTables | None = None  # the sliding-window layers' tables; None: the model has none


def run_in_turn(layers: nn.ModuleList, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [B, T, D]
    for layer in layers:
        x = layer(x, ctx)
    return x


class Transformer(nn.Module):
    """The decoder. Parameter names follow the Hub checkpoints' so they load without renaming (a few families'
    expert names aside: `loader.py`)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(args, i) for i in range(args.num_layers))
        self.norm = make_norm(args, args.hidden_size)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.register_buffer("window_inv_freq", window_inv_freq(args), persistent=False)
        # Swappable from outside (kernels.surgery): how a layer attends over the cache, and how the layers run (one
        # after the other, or all in one call where a kernel can: `kernels.layers_quant`).
        self.attention: Any = TorchAttention(args.attention_scale)
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
        x = self.embed_tokens(tokens)  # [B, T, D]
        if self.args.embed_scale is not None:
            x = scaled_embedding(x, self.args.embed_scale)
        x = self.run_layers(self.layers, x, ctx)  # [B, T, D]
        if logit_index is not None:
            x = x.gather(1, logit_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [B, N, D]
        x = self.norm(x)
        logits = self.lm_head(x) if extra_vocab is None else self.lm_head(x, extra_vocab)  # [B, N, V]
        if self.args.final_logit_softcap is not None:
            logits = softcap(logits, self.args.final_logit_softcap)
        return logits.float()

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
        cos = sin = mask = window = None
        if self.attention.needs_tables:
            dtype = self.embed_tokens.weight.dtype
            cos, sin = rotary_tables(positions, self.inv_freq, dtype)
            if T > 1 or B > 1 or single is None:
                # A new token at position i sees every cached key at j <= i: the prefix, and itself. Only one row's
                # one token with `single` reads exactly its keys (num_keys is its position + 1); a static-shape
                # forward (`cuda_graphs.py`) reads the whole capacity, so even its one token needs the mask.
                key_pos = torch.arange(num_keys, device=tokens.device)  # [S]
                mask = key_pos.view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)  # [B, 1, T, S]
            if self.args.windowed_layers and self.args.sliding_window is not None:
                layers = self.args.windowed_layers
                local_cos, local_sin = rotary_tables(positions, self.window_inv_freq, dtype)
                held = cache.held(layers[0])  # every windowed layer holds as many positions
                window = window_tables(
                    positions, self.args.sliding_window, held, frozenset(layers), local_cos, local_sin
                )
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
            window=window,
        )


def rotary_tables(
    positions: torch.Tensor,  # [B, T]
    inv_freq: torch.Tensor,  # [hd/2]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [B, T, 1, hd]: computed in float32, rounded to `dtype`
    freqs = positions.unsqueeze(-1).float() * inv_freq  # [B, T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [B, T, 1, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)
