"""Model families and what each family's decoder blocks hold (`FAMILY_TRAITS`): the one place
the builder, the HF and PEFT key maps and the memory counts ask, instead of comparing names.

Example:
    >>> FAMILY_TRAITS["qwen3"].qk_norm, FAMILY_TRAITS["mistral"].interleaved_rope
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["llama3", "qwen2", "qwen3", "mistral"]
FAMILIES: tuple[Family, ...] = ("llama3", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class FamilyTraits:
    """What a family's decoder blocks hold beyond the shared Llama layout (pre-norm RMSNorm,
    grouped-query attention with RoPE, SwiGLU MLP), read by the code that depends on them
    (builder, HF and PEFT key maps, memory counts) instead of comparing family names.

    Attributes:
        qkv_bias: the q/k/v projections have biases (Qwen2).
        qk_norm: a per-head RMSNorm of q and k (scale `[head_dim]`) before RoPE (Qwen3).
        interleaved_rope: torchtune's RoPE pairs neighbouring coordinates where HF's rotates
            halves, so the HF q/k rows are permuted on load and save (Llama, Mistral); False:
            torchtune's Qwen2 RoPE is rotate-half already.
        rope_scaling: accepts Llama 3.1 RoPE frequency scaling (`ModelSpec.rope_scaling`).
        moe: may be a Mixture-of-Experts spec (`ModelSpec.num_experts` > 0): Qwen2-MoE and
            Qwen3-MoE (HF model_type qwen2_moe, qwen3_moe; `posttrain.models.hf_moe`).
        explicit_head_dim: the head width may differ from embed_dim / num_heads
            (`ModelSpec.attention_head_dim`).
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    interleaved_rope: bool = False
    rope_scaling: bool = False
    moe: bool = False
    explicit_head_dim: bool = False


FAMILY_TRAITS: dict[Family, FamilyTraits] = {
    "llama3": FamilyTraits(interleaved_rope=True, rope_scaling=True),
    "qwen2": FamilyTraits(qkv_bias=True, moe=True),
    "qwen3": FamilyTraits(qk_norm=True, explicit_head_dim=True, moe=True),
    # Mistral 7B v0.2+ / Nemo-style blocks are Llama's; sliding-window attention is refused
    # when reading config.json (posttrain.models.hf_config).
    "mistral": FamilyTraits(interleaved_rope=True),
}
MOE_FAMILIES = tuple(f for f in FAMILIES if FAMILY_TRAITS[f].moe)
