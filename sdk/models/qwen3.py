"""Qwen3 dense decoder from torchtune components (torchtune 0.6.1 has no qwen3 module).

Qwen3 is Qwen2 without the q/k/v biases and with a per-head RMSNorm of the queries and keys
(`q_norm`, `k_norm`: one scale of `head_dim` shared by all heads) applied *before* RoPE, as HF
`Qwen3Attention` does:

    q = rope(q_norm(q_proj(x).view(B, T, H, d)))      k = rope(k_norm(k_proj(x).view(B, T, K, d)))

torchtune's `MultiHeadAttention` takes `q_norm` / `k_norm` modules but applies them *after* RoPE.
RoPE rotates pairs of coordinates, which keeps the RMS of a head but not the per-coordinate
scale, so the order matters once the scale is trained: `Qwen3Attention` below is torchtune's
attention with the norms moved before RoPE and nothing else changed (the KV cache, grouped-query
expansion and `_attention_call` hook are torchtune 0.6.1's, which `posttrain.policy.generation`
and sequence parallelism rely on). RoPE is torchtune's Qwen2 (rotate-half) embedding, as HF's,
so the HF weights need no q/k permutation. Qwen3 sets `head_dim` explicitly, and it may differ
from embed_dim / num_heads (Qwen3-0.6B: 1024 / 16 = 64, head_dim 128): the q projection is
`[H * d, D]` and the output projection `[D, H * d]`.

Shapes: B = batch, T = tokens, D = embed_dim, H = query heads, K = key/value heads, d = head_dim.

Example:
    >>> model = qwen3(vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32,
    ...               intermediate_dim=64, max_seq_len=16, head_dim=16)
    >>> attn = model.layers[0].attn
    >>> tuple(attn.q_proj.weight.shape), tuple(attn.q_norm.scale.shape)
    ((64, 32), (16,))
"""

from __future__ import annotations

import torch
from torch import nn
from torchtune.modules import (
    MultiHeadAttention,
    RMSNorm,
    TiedLinear,
    TransformerDecoder,
    TransformerSelfAttentionLayer,
)
from torchtune.modules.attention_utils import _MaskType

# HF key -> torchtune key of a Qwen3 checkpoint ("{}" is the layer index); the layout of
# torchtune's Qwen2 map without biases, plus the per-head norms.
FROM_HF: dict[str, str | None] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attn.q_proj.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attn.k_proj.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attn.v_proj.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attn.output_proj.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.scale",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.scale",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.mlp.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.mlp.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.mlp.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.sa_norm.scale",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm.scale",
    "model.norm.weight": "norm.scale",
    "lm_head.weight": "output.weight",
}


class Qwen3Attention(MultiHeadAttention):
    """torchtune's `MultiHeadAttention` with `q_norm` / `k_norm` applied per head before RoPE
    (HF `Qwen3Attention`), for self-attention with an optional KV cache.

    Called as torchtune's: `x [B, T, D]`, `y [B, T, D]` (the same tensor, or None when decoding
    from the cache), `mask` and `input_pos` as `MultiHeadAttention.forward`; returns `[B, T, D]`.
    """

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        mask: _MaskType | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, s_x, _ = x.shape
        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        q = self.q_norm(q)  # set by the builder
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)
        q = q.transpose(1, 2)  # [b, n_h, s_x, h_d]

        if y is None:
            if self.kv_cache is None or not self.cache_enabled:
                raise ValueError(
                    "Must provide y input or use kv_cache to enable streaming decoding"
                )
            k, v = self.kv_cache.k_cache, self.kv_cache.v_cache
        else:
            s_y = y.shape[1]
            # -1, not num_kv_heads: generation sets num_kv_heads = num_heads while decoding
            k = self.k_proj(y).view(b, s_y, -1, self.head_dim)
            v = self.v_proj(y).view(b, s_y, -1, self.head_dim)
            k = self.k_norm(k)
            if self.pos_embeddings is not None:
                k = self.pos_embeddings(k, input_pos=input_pos)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, n_kv, s_y, h_d]
            if self.kv_cache is not None and self.cache_enabled:
                k, v = self.kv_cache.update(k, v)

        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)

        output = self._attention_call(
            q,
            k,
            v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


def qwen3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    head_dim: int,
    rope_base: float = 1e6,
    norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
) -> TransformerDecoder:
    """A Qwen3 dense `TransformerDecoder` (PyTorch default initialisation; `build_model`
    re-initialises it).

    Args:
        vocab_size, num_layers, num_heads, num_kv_heads, embed_dim, intermediate_dim,
            max_seq_len, rope_base, norm_eps, tie_word_embeddings: as torchtune's `qwen2` builder.
        head_dim: d, the width of each query/key/value head (HF `head_dim`); need not be
            embed_dim / num_heads. Even (RoPE).

    Returns:
        A module mapping token ids `[B, T]` (int64) to logits `[B, T, vocab_size]`.
    """
    from torchtune.models.qwen2._component_builders import qwen2_mlp
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings

    rope = Qwen2RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = nn.ModuleList()
    for _ in range(num_layers):
        attn = Qwen3Attention(
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=nn.Linear(embed_dim, num_heads * head_dim, bias=False),
            k_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            v_proj=nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False),
            output_proj=nn.Linear(num_heads * head_dim, embed_dim, bias=False),
            pos_embeddings=rope,
            q_norm=RMSNorm(dim=head_dim, eps=norm_eps),
            k_norm=RMSNorm(dim=head_dim, eps=norm_eps),
            max_seq_len=max_seq_len,
        )
        layers.append(
            TransformerSelfAttentionLayer(
                attn=attn,
                mlp=qwen2_mlp(dim=embed_dim, hidden_dim=intermediate_dim),
                sa_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
                mlp_norm=RMSNorm(dim=embed_dim, eps=norm_eps),
            )
        )
    tok_embeddings = nn.Embedding(vocab_size, embed_dim)
    output: nn.Module | TiedLinear
    if tie_word_embeddings:
        output = TiedLinear(tok_embeddings)
    else:
        output = nn.Linear(embed_dim, vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=tok_embeddings,
        layers=layers,
        max_seq_len=max_seq_len,
        num_heads=num_heads,
        head_dim=head_dim,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output,
    )
