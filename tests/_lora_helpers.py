"""Shared by the LoRA tests (tests/models/test_lora.py, tests/models/test_lora_peft.py): two small
decoder specs (qwen2 with tied embeddings, llama3 without), random tokens and bases, random
adapters, and logits without gradients.

Shapes: B = batch, T = tokens, V = vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from posttrain.models import ModelSpec, build_model
from posttrain.models.lora import adapter_state_dict

SPECS = {  # small enough for a fast forward, wide enough for GQA (num_kv_heads < num_heads)
    "qwen2": ModelSpec(
        family="qwen2",
        vocab_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        intermediate_dim=128,
        max_seq_len=64,
        rope_base=3e4,
        norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    "llama3": ModelSpec(
        family="llama3",
        vocab_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=64,
        intermediate_dim=128,
        max_seq_len=64,
        rope_base=2e4,
        norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
HF_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The transformers names of the projections LoRA targets (attention, then MLP)."""


def random_tokens_BT(vocab: int, batch: int = 2, length: int = 24) -> torch.Tensor:
    """Token ids [batch, length] below `vocab`, the same on every call (seed 1)."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def logits_of(model, tokens_BT):
    """The model's logits [B, T, V] without gradients (a transformers output's `.logits`)."""
    with torch.no_grad():
        out = model(tokens_BT)
    return getattr(out, "logits", out)


def random_base(spec: ModelSpec) -> nn.Module:
    """A model with every parameter random (biases and norm scales too), std 0.1 / around 1."""
    model = build_model(spec, seed=0)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("scale") else 0.1 * noise)
    return model


def randomise_adapters(model: nn.Module, std: float = 0.1) -> None:
    """Every adapter weight of `model` drawn from N(0, std^2), the same on every call (seed 3)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in adapter_state_dict(model).values():
            p.copy_(std * torch.randn(p.shape, generator=gen))
