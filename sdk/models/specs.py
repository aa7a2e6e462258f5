"""Model sizes: a typed `ModelSpec`, the named presets, and the torchtune builder call.

What each family's blocks hold is `posttrain.models.families` (re-exported here); the presets'
numbers are `posttrain.models.spec_presets`. This module, the Qwen3 builder
`posttrain.models.qwen3` and `posttrain.models.hf` are the only places that import
`torchtune.models`, so the model backend can be replaced without touching the rest of posttrain.

Example:
    >>> from posttrain.models.specs import build_model, get_preset
    >>> spec = get_preset("tiny-1m")
    >>> model = build_model(spec)
    >>> spec.num_parameters() == sum(p.numel() for p in model.parameters())
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain.models.families import (
    FAMILIES,
    FAMILY_TRAITS,
    MOE_FAMILIES,
    Family,
    FamilyTraits,
)
from posttrain.models.moe import MoEFeedForward
from posttrain.models.spec_presets import PRESET_FIELDS

if TYPE_CHECKING:
    from torchtune.modules import TransformerDecoder

__all__ = [
    "FAMILIES",
    "FAMILY_TRAITS",
    "MOE_FAMILIES",
    "PRESETS",
    "Family",
    "FamilyTraits",
    "ModelSpec",
    "RopeScaling",
    "build_model",
    "get_preset",
]

# ModelSpec fields that only an MoE spec (num_experts > 0) may change from their defaults.
_MOE_FIELDS = (
    "experts_per_token",
    "moe_intermediate_dim",
    "shared_expert_dim",
    "norm_topk_prob",
    "router_aux_loss_coef",
)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(kw_only=True, frozen=True)
class RopeScaling:
    """Llama 3.1+ RoPE frequency scaling (HF `rope_scaling` with `rope_type: llama3`).

    See Meta's Llama 3.1 release (`apply_scaling` in llama-models) and HF
    `_compute_llama3_parameters`.
    """

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not _is_number(value) or not (value > 0 and math.isfinite(value)):
                raise ValueError(f"RopeScaling.{name}={value!r}; must be a positive number")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        value = self.original_max_position_embeddings
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"RopeScaling.original_max_position_embeddings={value!r}; must be a "
                "positive integer"
            )


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """Architecture numbers of a decoder-only transformer.

    Args:
        family: "llama3", "qwen2" (Qwen2 and Qwen2.5 share the architecture: q/k/v biases),
            "qwen3" (dense Qwen3: no biases, per-head q/k RMSNorm before RoPE, explicit head
            width) or "mistral" (Mistral 7B v0.2+: Llama blocks, full attention); what each holds
            is `FAMILY_TRAITS[family]`.
        vocab_size: number of token ids the embedding holds.
        num_layers: transformer blocks.
        num_heads: query heads; `embed_dim` must divide by it (torchtune's attention checks it).
        num_kv_heads: key/value heads (grouped-query attention); divides `num_heads`.
        embed_dim: hidden size.
        intermediate_dim: MLP hidden size (HF `intermediate_size`). In an MoE spec every layer is
            an MoE layer and this number only travels to config.json (HF Qwen2-MoE uses it for
            layers listed in `mlp_only_layers`, which posttrain does not support).
        max_seq_len: longest sequence (prompt + completion) the RoPE cache and KV cache hold.
        rope_base: RoPE theta (HF `rope_theta`).
        norm_eps: RMSNorm epsilon (HF `rms_norm_eps`).
        tie_word_embeddings: output projection shares the token embedding matrix.
        rope_scaling: Llama 3.1+ frequency scaling, or None for plain RoPE.
        num_experts: routed experts per MoE layer; 0 (the default) builds a dense model. An MoE
            spec (family "qwen2" or "qwen3") replaces every layer's MLP by
            `posttrain.models.moe.MoEFeedForward`, as HF Qwen2-MoE / Qwen3-MoE with
            `decoder_sparse_step` 1.
        experts_per_token: top-k experts each token is routed to, in 1..num_experts (HF
            `num_experts_per_tok`).
        moe_intermediate_dim: hidden size of each routed expert (HF `moe_intermediate_size`);
            required (> 0) for MoE.
        shared_expert_dim: hidden size of the always-on shared expert with a sigmoid gate (HF
            `shared_expert_intermediate_size`); 0 for none.
        norm_topk_prob: renormalise the top-k router probabilities to sum to 1.
        router_aux_loss_coef: weight of the load-balancing loss (summed over layers) that the SFT
            objective adds (HF `router_aux_loss_coef`); must be >= 0.
        The other five MoE fields must keep their defaults when num_experts is 0.
        attention_head_dim: width d of each q/k/v head when it is not embed_dim / num_heads
            (HF `head_dim`; Qwen3-0.6B: 128 with embed_dim 1024 and 16 heads), even; None (the
            default) means embed_dim / num_heads. Only family "qwen3". `head_dim` is d either way.

    Raises:
        ValueError: naming the field, its value and what is allowed.
    """

    family: Family
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    intermediate_dim: int
    max_seq_len: int
    rope_base: float
    norm_eps: float
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    num_experts: int = 0
    experts_per_token: int = 2
    moe_intermediate_dim: int = 0
    shared_expert_dim: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    attention_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"ModelSpec.family={self.family!r}; allowed: {', '.join(FAMILIES)}")
        for name in (
            "vocab_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "embed_dim",
            "intermediate_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec.{name}={value!r}; must be a positive integer")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"ModelSpec.embed_dim={self.embed_dim} must be divisible by "
                f"num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_heads={self.num_heads} must be divisible by "
                f"num_kv_heads={self.num_kv_heads}"
            )
        self._check_head_dim()
        if not (_is_number(self.rope_base) and 0 < self.rope_base < math.inf):
            raise ValueError(f"ModelSpec.rope_base={self.rope_base!r}; must be a positive number")
        if not (_is_number(self.norm_eps) and 0 < self.norm_eps < 1):
            raise ValueError(f"ModelSpec.norm_eps={self.norm_eps!r}; must be in (0, 1)")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                f"ModelSpec.tie_word_embeddings={self.tie_word_embeddings!r}; must be True or False"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"ModelSpec.rope_scaling={self.rope_scaling!r}; must be a RopeScaling or None"
            )
        if self.rope_scaling is not None and not self.traits.rope_scaling:
            allowed = [f for f in FAMILIES if FAMILY_TRAITS[f].rope_scaling]
            raise ValueError(
                f"ModelSpec.rope_scaling is only supported for family "
                f"{', '.join(map(repr, allowed))}, got family={self.family!r}"
            )
        self._check_moe_fields()

    def _check_head_dim(self) -> None:
        d = self.attention_head_dim
        if d is not None:
            if not isinstance(d, int) or isinstance(d, bool) or d < 1:
                raise ValueError(
                    f"ModelSpec.attention_head_dim={d!r}; must be a positive integer or None"
                )
            if not self.traits.explicit_head_dim:
                allowed = [f for f in FAMILIES if FAMILY_TRAITS[f].explicit_head_dim]
                raise ValueError(
                    f"ModelSpec.attention_head_dim={d} is only supported for family "
                    f"{', '.join(map(repr, allowed))} (family={self.family!r} has head_dim = "
                    f"embed_dim / num_heads = {self.embed_dim // self.num_heads}); leave it None"
                )
        if self.head_dim % 2:
            source = "attention_head_dim" if d is not None else "embed_dim / num_heads"
            raise ValueError(f"ModelSpec head_dim={self.head_dim} ({source}) must be even for RoPE")

    def _check_moe_fields(self) -> None:
        for name in ("num_experts", "moe_intermediate_dim", "shared_expert_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelSpec.{name}={value!r}; must be a non-negative integer")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(
                f"ModelSpec.norm_topk_prob={self.norm_topk_prob!r}; must be True or False"
            )
        coef = self.router_aux_loss_coef
        if not (_is_number(coef) and 0 <= coef < math.inf):
            raise ValueError(
                f"ModelSpec.router_aux_loss_coef={coef!r}; must be a finite number >= 0"
            )
        k = self.experts_per_token
        if not isinstance(k, int) or isinstance(k, bool):
            raise ValueError(f"ModelSpec.experts_per_token={k!r}; must be an integer")
        if self.num_experts == 0:
            defaults = {
                f.name: f.default for f in dataclasses.fields(self) if f.name in _MOE_FIELDS
            }
            changed = [
                f"{n}={getattr(self, n)!r}" for n in _MOE_FIELDS if getattr(self, n) != defaults[n]
            ]
            if changed:
                raise ValueError(
                    f"ModelSpec.{changed[0]} is set but num_experts=0 (a dense model); "
                    "set num_experts > 0 for an MoE model or leave "
                    f"{', '.join(_MOE_FIELDS)} at their defaults"
                )
            return
        if not self.traits.moe:
            raise ValueError(
                f"ModelSpec.num_experts={self.num_experts} (MoE) is only supported for "
                f"family {', '.join(map(repr, MOE_FAMILIES))}, got "
                f"family={self.family!r}"
            )
        if not 1 <= k <= self.num_experts:
            raise ValueError(
                f"ModelSpec.experts_per_token={k}; must be in 1..num_experts={self.num_experts}"
            )
        if self.moe_intermediate_dim < 1:
            raise ValueError(
                f"ModelSpec.moe_intermediate_dim={self.moe_intermediate_dim}; an MoE "
                f"spec (num_experts={self.num_experts}) needs a positive integer"
            )

    @property
    def head_dim(self) -> int:
        """Width of each q/k/v head: `attention_head_dim`, or embed_dim / num_heads."""
        if self.attention_head_dim is not None:
            return self.attention_head_dim
        return self.embed_dim // self.num_heads

    @property
    def traits(self) -> FamilyTraits:
        """What this family's blocks hold (`FAMILY_TRAITS[family]`)."""
        return FAMILY_TRAITS[self.family]

    @property
    def is_moe(self) -> bool:
        """True when the MLPs are Mixture-of-Experts layers (num_experts > 0)."""
        return self.num_experts > 0

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    def num_parameters(self) -> int:
        """Exact parameter count (tied embeddings counted once, every expert counted), built on
        the meta device."""
        with torch.device("meta"):
            model = build_model(self, device="meta")
        return sum(p.numel() for p in model.parameters())


PRESETS: dict[str, ModelSpec] = {
    name: ModelSpec.from_dict(fields) for name, fields in PRESET_FIELDS.items()
}


def get_preset(name: str) -> ModelSpec:
    """The `ModelSpec` registered under `name`. Raises ValueError listing the valid names."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[name]


def build_model(
    spec: ModelSpec,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
    init_std: float = 0.02,
) -> TransformerDecoder:
    """Build the torchtune `TransformerDecoder` for `spec`, initialised for training from scratch.

    torchtune's builders keep PyTorch's default initialisation (embeddings N(0, 1)), which gives
    a freshly built tiny model logits in the hundreds and a first loss far above log(vocab).
    One builder call per family: "qwen2" torchtune's `qwen2`; "llama3" and "mistral" torchtune's
    `llama3` (Mistral's blocks are Llama's: torchtune's own `mistral` builder makes the same
    modules), with Llama 3.1 RoPE scaling swapped in when the spec has it; "qwen3"
    `posttrain.models.qwen3.qwen3` (torchtune components, per-head q/k norms).
    posttrain re-initialises as HF transformers does for Qwen2/Qwen3/Llama/Mistral
    (`_init_weights` with `initializer_range`): every linear and embedding weight N(0, init_std),
    biases 0, norm scales (the per-head q/k norms of Qwen3 too) 1. Loading a checkpoint
    overwrites all of it.

    An MoE spec builds its family's model with a placeholder MLP and replaces each layer's `mlp` by
    a `posttrain.models.moe.MoEFeedForward` (router and every expert weight N(0, init_std), as HF
    `Qwen2MoePreTrainedModel._init_weights`), each holding `spec.router_aux_loss_coef`.

    Args:
        spec: architecture numbers.
        device: where parameters live ("meta" for size reports without memory).
        dtype: parameter dtype (fp32 on CPU: no bf16 instructions there).
        seed: if given, parameters are initialised from `torch.manual_seed(seed)` without touching
            the global RNG state.
        init_std: standard deviation of the weight initialisation (HF `initializer_range`).

    Returns:
        A module mapping token ids `[B, T]` (int64) to logits `[B, T, vocab_size]`.
    """
    from torchtune.models.llama3._component_builders import llama3
    from torchtune.models.qwen2._component_builders import qwen2
    from torchtune.modules import TiedLinear

    from posttrain.models.qwen3 import qwen3

    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        embed_dim=spec.embed_dim,
        # MoE: every MLP is replaced below, so the placeholder is 1 wide
        intermediate_dim=1 if spec.is_moe else spec.intermediate_dim,
        max_seq_len=spec.max_seq_len,
        rope_base=spec.rope_base,
        norm_eps=spec.norm_eps,
    )
    fork = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with fork, torch.device(device or "cpu"):
        if seed is not None:
            torch.manual_seed(seed)
        if spec.family == "qwen2":
            model = qwen2(**common, tie_word_embeddings=spec.tie_word_embeddings)
        elif spec.family == "qwen3":
            model = qwen3(
                **common, head_dim=spec.head_dim, tie_word_embeddings=spec.tie_word_embeddings
            )
        else:  # llama3, mistral
            model = llama3(**common)
            if spec.rope_scaling is not None:
                _use_scaled_rope(model, spec, spec.rope_scaling)
            if spec.tie_word_embeddings:
                del model.output  # an nn.Linear submodule; TiedLinear is a plain callable
                model.output = TiedLinear(model.tok_embeddings)
        if spec.is_moe:
            _use_moe(model, spec, init_std)
        if str(device) != "meta":
            _init_weights(model, init_std)
    return model.to(dtype=dtype)


@torch.no_grad()
def _init_weights(model: nn.Module, std: float) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.zero_()
        elif hasattr(module, "scale") and isinstance(module.scale, nn.Parameter):
            module.scale.fill_(1.0)  # torchtune RMSNorm
        elif isinstance(module, MoEFeedForward):  # its nn.Linear children are reached above
            for stacked in (module.gate_proj, module.up_proj, module.down_proj):
                stacked.normal_(0.0, std)


def _use_moe(model: TransformerDecoder, spec: ModelSpec, init_std: float) -> None:
    for layer in model.layers:
        del layer.mlp
        layer.mlp = MoEFeedForward(
            dim=spec.embed_dim,
            hidden_dim=spec.moe_intermediate_dim,
            num_experts=spec.num_experts,
            experts_per_token=spec.experts_per_token,
            norm_topk_prob=spec.norm_topk_prob,
            shared_expert_dim=spec.shared_expert_dim,
            router_aux_loss_coef=spec.router_aux_loss_coef,
            init_std=init_std,
        )


def _use_scaled_rope(model: TransformerDecoder, spec: ModelSpec, rs: RopeScaling) -> None:
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE

    rope = Llama3ScaledRoPE(
        dim=spec.head_dim,
        max_seq_len=spec.max_seq_len,
        base=spec.rope_base,
        scale_factor=rs.factor,
        low_freq_factor=rs.low_freq_factor,
        high_freq_factor=rs.high_freq_factor,
        old_context_len=rs.original_max_position_embeddings,
    )
    for layer in model.layers:
        layer.attn.pos_embeddings = rope
