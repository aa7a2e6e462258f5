"""The numbers of the named `ModelSpec` presets: tiny byte-vocabulary models for tests and
tutorials, and the shapes of published models (their config.json) for size and memory reports
(build those on the meta device: no weights ship with posttrain).

Plain `ModelSpec.from_dict` fields, so this module imports nothing of posttrain: the validated
specs are `posttrain.models.specs.PRESETS` (also `posttrain.models.PRESETS`) and `get_preset`.

Example:
    >>> from posttrain.models import get_preset
    >>> get_preset("qwen3-0.6b").head_dim
    128
"""

from __future__ import annotations

from typing import Any

PRESET_FIELDS: dict[str, dict[str, Any]] = {
    # Byte-level vocabulary (256 bytes + specials, see posttrain.models.tokenizer.ByteTokenizer).
    "tiny-1m": dict(
        family="qwen2",
        vocab_size=272,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=128,
        intermediate_dim=512,
        max_seq_len=512,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny-2m": dict(
        family="qwen2",
        vocab_size=272,
        num_layers=4,
        num_heads=6,
        num_kv_heads=2,
        embed_dim=192,
        intermediate_dim=768,
        max_seq_len=512,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny-10m": dict(
        family="qwen2",
        vocab_size=272,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        embed_dim=320,
        intermediate_dim=1280,
        max_seq_len=1024,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny-llama-1m": dict(
        family="llama3",
        vocab_size=272,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=128,
        intermediate_dim=512,
        max_seq_len=512,
        rope_base=5e5,
        norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # Real sizes (HF config.json numbers); build on the meta device for size/memory reports.
    "qwen2.5-0.5b": dict(
        family="qwen2",
        vocab_size=151936,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        embed_dim=896,
        intermediate_dim=4864,
        max_seq_len=32768,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "llama3.2-1b": dict(
        family="llama3",
        vocab_size=128256,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=2048,
        intermediate_dim=8192,
        max_seq_len=131072,
        rope_base=5e5,
        norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_scaling={},  # RopeScaling's defaults: Llama 3.1+ scaling
    ),
    # Qwen3-0.6B: head_dim 128 is twice embed_dim / num_heads = 64.
    "qwen3-0.6b": dict(
        family="qwen3",
        vocab_size=151936,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        embed_dim=1024,
        intermediate_dim=3072,
        max_seq_len=40960,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_head_dim=128,
    ),
    "mistral-7b": dict(  # Mistral-7B-v0.3 (v0.2+: no sliding window)
        family="mistral",
        vocab_size=32768,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=4096,
        intermediate_dim=14336,
        max_seq_len=32768,
        rope_base=1e6,
        norm_eps=1e-5,
    ),
    # Tiny Qwen3 (head_dim 64 != 128 / 4, as Qwen3-0.6B's) and Mistral blocks (byte vocabulary).
    "tiny-qwen3-1m": dict(
        family="qwen3",
        vocab_size=272,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=128,
        intermediate_dim=384,
        max_seq_len=512,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_head_dim=64,
    ),
    "tiny-mistral-1m": dict(
        family="mistral",
        vocab_size=272,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=128,
        intermediate_dim=512,
        max_seq_len=512,
        rope_base=1e6,
        norm_eps=1e-5,
    ),
    # Qwen2-MoE blocks: 4 routed experts, top-2, plus a gated shared expert (byte vocabulary).
    "tiny-moe": dict(
        family="qwen2",
        vocab_size=272,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        intermediate_dim=128,
        max_seq_len=512,
        rope_base=1e6,
        norm_eps=1e-6,
        tie_word_embeddings=True,
        num_experts=4,
        experts_per_token=2,
        moe_intermediate_dim=64,
        shared_expert_dim=64,
    ),
}
