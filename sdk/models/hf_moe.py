"""Hugging Face Qwen2-MoE (`model_type: qwen2_moe`, `Qwen2MoeForCausalLM`) and Qwen3-MoE
(`model_type: qwen3_moe`, `Qwen3MoeForCausalLM`) <-> MoE `ModelSpec`: the MoE keys of config.json
and the expert weights of the safetensors.

`posttrain.models.hf_config` and `posttrain.models.hf` call these for an MoE spec; attention,
norms and embeddings go through the dense family's key map (an MoE spec of family "qwen2" is
Qwen2-MoE: Qwen2 attention with q/k/v biases; of family "qwen3" Qwen3-MoE: Qwen3 attention with
per-head q/k norms and `head_dim`). The MoE layers are the same in both (Qwen3-MoE's block is
Qwen2-MoE's without the shared expert).

Weights on disk, per layer i and expert e (what transformers 5.10 `save_pretrained` writes, and
what the Qwen1.5-MoE checkpoints hold; transformers fuses them into `experts.gate_up_proj` in
memory only):

    model.layers.i.mlp.gate.weight                     [E, D]  <-> layers.i.mlp.router.weight
    model.layers.i.mlp.experts.e.gate_proj.weight      [H, D]  <-> layers.i.mlp.gate_proj[e]
    model.layers.i.mlp.experts.e.up_proj.weight        [H, D]  <-> layers.i.mlp.up_proj[e]
    model.layers.i.mlp.experts.e.down_proj.weight      [D, H]  <-> layers.i.mlp.down_proj[e]
    model.layers.i.mlp.shared_expert.{gate,up,down}_proj.weight <-> layers.i.mlp.shared_expert.*
    model.layers.i.mlp.shared_expert_gate.weight       [1, D]  <-> layers.i.mlp.shared_expert_gate

Qwen3-MoE has no shared expert (a "qwen3" MoE spec with `shared_expert_dim` > 0 is refused on
save). Qwen2-MoE's block always has a shared expert; a spec without one (`shared_expert_dim` 0)
is written with `shared_expert_intermediate_size: 0`, zero-size shared-expert tensors and a zero
gate, as transformers itself saves such a config (its output is then exactly 0). Reading such a
folder drops those tensors.

Traps handled (transformers 5.10 Qwen2MoeConfig):
  * Absent keys take Qwen2MoeConfig's defaults: num_experts 60, num_experts_per_tok 4,
    moe_intermediate_size 1408, shared_expert_intermediate_size 5632, norm_topk_prob false,
    router_aux_loss_coef 0.001, num_key_value_heads 16, hidden_size 2048.
  * `decoder_sparse_step` != 1 or a non-empty `mlp_only_layers` mix dense and MoE layers, and
    `qkv_bias: false` drops the q/k/v biases: none is expressible, so each raises.

Traps handled (transformers 5.10 Qwen3MoeConfig):
  * Absent keys take Qwen3MoeConfig's defaults: num_experts 128, num_experts_per_tok 8,
    moe_intermediate_size 768, norm_topk_prob false (the released Qwen3-MoE configs write
    true), num_key_value_heads 4, hidden_size 2048, intermediate_size 6144.
  * transformers 5.10 writes the expert count as `num_local_experts` (Qwen3MoeConfig's
    attribute_map); the released checkpoints write `num_experts`. Either is read (both, when
    they differ, raise); `num_experts` is written.
  * Qwen3MoeConfig has no `head_dim` field: an absent key means hidden_size /
    num_attention_heads (`Qwen3MoeAttention` reads it with that fallback), not Qwen3Config's 128.
  * `decoder_sparse_step` != 1 or a non-empty `mlp_only_layers` (dense layers) raise, as above.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from posttrain.models.specs import ModelSpec

MODEL_TYPE = "qwen2_moe"
ARCHITECTURE = "Qwen2MoeForCausalLM"
QWEN3_MODEL_TYPE = "qwen3_moe"
QWEN3_ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPES = (MODEL_TYPE, QWEN3_MODEL_TYPE)
# ModelSpec.family of an MoE spec -> (config.json model_type, HF architecture class).
HF_NAMES = {"qwen2": (MODEL_TYPE, ARCHITECTURE), "qwen3": (QWEN3_MODEL_TYPE, QWEN3_ARCHITECTURE)}

# Qwen2MoeConfig (transformers 5.10) defaults of the keys shared with Qwen2Config.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# Qwen3MoeConfig (transformers 5.10) defaults of the keys shared with Qwen3Config; head_dim
# None: hidden_size / num_attention_heads.
QWEN3_HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=None,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# config.json key -> (ModelSpec field, Qwen2MoeConfig default).
_MOE_KEYS: dict[str, tuple[str, Any]] = {
    "num_experts": ("num_experts", 60),
    "num_experts_per_tok": ("experts_per_token", 4),
    "moe_intermediate_size": ("moe_intermediate_dim", 1408),
    "shared_expert_intermediate_size": ("shared_expert_dim", 5632),
    "norm_topk_prob": ("norm_topk_prob", False),
    "router_aux_loss_coef": ("router_aux_loss_coef", 0.001),
}
# The same for Qwen3MoeConfig (no shared expert).
_QWEN3_MOE_KEYS: dict[str, tuple[str, Any]] = {
    "num_experts": ("num_experts", 128),
    "num_experts_per_tok": ("experts_per_token", 8),
    "moe_intermediate_size": ("moe_intermediate_dim", 768),
    "norm_topk_prob": ("norm_topk_prob", False),
    "router_aux_loss_coef": ("router_aux_loss_coef", 0.001),
}

_TUNE_MLP = re.compile(r"^layers\.(\d+)\.mlp\.(.+)$")
_HF_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")
_HF_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED = (
    "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight",
    "shared_expert_gate.weight",
)


# ---------------------------------------------------------------------------------- config.json


def moe_fields_from_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE `ModelSpec` fields of a qwen2_moe or qwen3_moe config.json (absent keys: the
    HF config class's defaults).

    Raises:
        ValueError: `decoder_sparse_step` other than 1, non-empty `mlp_only_layers`,
            `qkv_bias` false (qwen2_moe), or `num_experts` below 1 (each named).
    """
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r}; allowed: {', '.join(MODEL_TYPES)}")
    where = f"config.json (model_type {model_type!r})"
    step = config.get("decoder_sparse_step", 1)
    if step != 1:
        raise ValueError(
            f"{where} decoder_sparse_step={step!r}; only 1 (every layer MoE) is supported"
        )
    dense_layers = config.get("mlp_only_layers") or []
    if dense_layers:
        raise ValueError(
            f"{where} mlp_only_layers={list(dense_layers)}; dense layers inside an "
            "MoE model are not supported"
        )
    if model_type == MODEL_TYPE and not config.get("qkv_bias", True):
        raise ValueError(
            f"{where} qkv_bias=false is not supported (torchtune qwen2 attention has q/k/v biases)"
        )
    keys = _MOE_KEYS if model_type == MODEL_TYPE else _QWEN3_MOE_KEYS
    fields = {name: config.get(key, default) for key, (name, default) in keys.items()}
    if model_type == QWEN3_MODEL_TYPE and "num_local_experts" in config:
        local = config["num_local_experts"]
        if "num_experts" in config and config["num_experts"] != local:
            raise ValueError(
                f"{where} num_experts={config['num_experts']!r} and num_local_experts="
                f"{local!r} disagree (transformers takes num_local_experts); keep one"
            )
        fields["num_experts"] = local
    if fields["num_experts"] in (0, None):
        dense = model_type.removesuffix("_moe")
        raise ValueError(
            f"{where} num_experts={fields['num_experts']!r}; a {model_type} config "
            f"without experts is not supported (write it as model_type {dense!r})"
        )
    if isinstance(fields["router_aux_loss_coef"], int) and not isinstance(
        fields["router_aux_loss_coef"], bool
    ):
        fields["router_aux_loss_coef"] = float(fields["router_aux_loss_coef"])
    return fields


def hf_moe_config_fields(spec: ModelSpec) -> dict[str, Any]:
    """The qwen2_moe (family "qwen2") or qwen3_moe (family "qwen3") config.json keys for an MoE
    `spec`, merged into the dense family's.

    Raises:
        ValueError: a "qwen3" spec with `shared_expert_dim` > 0 (Qwen3-MoE has no shared expert),
            or a family without an HF MoE model (named).
    """
    if spec.family not in HF_NAMES:
        raise ValueError(
            f"ModelSpec.family={spec.family!r} has no HF MoE model; allowed: {', '.join(HF_NAMES)}"
        )
    model_type, architecture = HF_NAMES[spec.family]
    if model_type == QWEN3_MODEL_TYPE and spec.shared_expert_dim:
        raise ValueError(
            f"ModelSpec.shared_expert_dim={spec.shared_expert_dim}: a qwen3_moe checkpoint "
            "(Qwen3MoeForCausalLM) has no shared expert; use 0, or family 'qwen2' (qwen2_moe)"
        )
    keys = _MOE_KEYS if model_type == MODEL_TYPE else _QWEN3_MOE_KEYS
    fields = {key: getattr(spec, name) for key, (name, _) in keys.items()}
    extra = {"qkv_bias": True} if model_type == MODEL_TYPE else {}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        **fields,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        **extra,
        "output_router_logits": False,
    }


# -------------------------------------------------------------------------------------- weights


def is_tune_moe_key(key: str) -> bool:
    """True for a torchtune state-dict key inside an MoE layer's `mlp`."""
    return _TUNE_MLP.match(key) is not None


def is_hf_moe_key(key: str) -> bool:
    """True for a HF key inside a layer's `mlp` (router, experts, shared expert)."""
    return _HF_MLP.match(key) is not None


def moe_tune_to_hf(sd: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF tensors of the MoE-layer keys of a torchtune state dict (other keys are ignored).

    Stacked [E, ...] expert weights are split into one tensor per expert (copies: safetensors
    refuses tensors that share memory). A qwen2_moe spec without a shared expert gets zero-size
    shared tensors and a zero gate (Qwen2-MoE's block always holds them; Qwen3-MoE's never).

    Raises:
        ValueError: for an MoE-layer key this conversion does not know.
    """
    out: dict[str, torch.Tensor] = {}
    known = {"router.weight", "gate_proj", "up_proj", "down_proj", *_SHARED}
    layers: set[str] = set()
    for key, value in sd.items():
        match = _TUNE_MLP.match(key)
        if match is None:
            continue
        layer, name = match.groups()
        if name not in known:
            raise ValueError(f"no HF name for the MoE key {key!r}")
        layers.add(layer)
        prefix = f"model.layers.{layer}.mlp."
        if name == "router.weight":
            out[prefix + "gate.weight"] = value
        elif name in ("gate_proj", "up_proj", "down_proj"):
            for e in range(value.shape[0]):
                out[f"{prefix}experts.{e}.{name}.weight"] = value[e].clone()
        else:
            out[prefix + name] = value
    if spec.shared_expert_dim == 0 and spec.family == "qwen2":
        for layer in sorted(layers):
            prefix = f"model.layers.{layer}.mlp."
            like = sd[f"layers.{layer}.mlp.router.weight"]
            for name, shape in _zero_shared_shapes(spec).items():
                out[prefix + name] = like.new_zeros(shape)
    return out


def moe_hf_to_tune(sd: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """torchtune tensors of the MoE-layer keys of a HF state dict (other keys are ignored).

    Per-expert tensors are stacked along dim 0. Expects the keys `expected_hf_moe_shapes`
    lists (checked by the caller); zero-size shared-expert tensors are dropped.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for key, value in sd.items():
        match = _HF_MLP.match(key)
        if match is None:
            continue
        layer, name = match.groups()
        prefix = f"layers.{layer}.mlp."
        expert = _HF_EXPERT.match(name)
        if expert is not None:
            experts.setdefault((layer, expert.group(2)), {})[int(expert.group(1))] = value
        elif name == "gate.weight":
            out[prefix + "router.weight"] = value
        elif name in _SHARED and spec.shared_expert_dim > 0:
            out[prefix + name] = value
    for (layer, name), by_index in experts.items():
        out[f"layers.{layer}.mlp.{name}"] = torch.stack(
            [by_index[e] for e in range(spec.num_experts)]
        )
    return out


def expected_hf_moe_shapes(spec: ModelSpec) -> dict[str, torch.Size]:
    """HF key -> shape of every MoE-layer tensor a qwen2_moe checkpoint of `spec` holds (the
    zero-size shared expert of a spec without one is not listed: it is optional on load)."""
    D, H, S = spec.embed_dim, spec.moe_intermediate_dim, spec.shared_expert_dim
    out: dict[str, torch.Size] = {}
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}.mlp."
        out[prefix + "gate.weight"] = torch.Size([spec.num_experts, D])
        for e in range(spec.num_experts):
            out[f"{prefix}experts.{e}.gate_proj.weight"] = torch.Size([H, D])
            out[f"{prefix}experts.{e}.up_proj.weight"] = torch.Size([H, D])
            out[f"{prefix}experts.{e}.down_proj.weight"] = torch.Size([D, H])
        if S > 0:
            out[prefix + "shared_expert.gate_proj.weight"] = torch.Size([S, D])
            out[prefix + "shared_expert.up_proj.weight"] = torch.Size([S, D])
            out[prefix + "shared_expert.down_proj.weight"] = torch.Size([D, S])
            out[prefix + "shared_expert_gate.weight"] = torch.Size([1, D])
    return out


def drop_absent_shared_expert(sd: dict[str, torch.Tensor], spec: ModelSpec) -> None:
    """Remove, in place, the shared-expert tensors of a qwen2_moe checkpoint whose config has
    shared_expert_intermediate_size 0 (zero-size tensors and a gate that multiplies nothing).
    A qwen3_moe checkpoint is left alone: shared-expert tensors there are unexpected keys."""
    if spec.shared_expert_dim > 0 or spec.family != "qwen2":
        return
    for key in [k for k in sd if (m := _HF_MLP.match(k)) is not None and m.group(2) in _SHARED]:
        del sd[key]


def _zero_shared_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    D = spec.embed_dim
    return {
        "shared_expert.gate_proj.weight": (0, D),
        "shared_expert.up_proj.weight": (0, D),
        "shared_expert.down_proj.weight": (D, 0),
        "shared_expert_gate.weight": (1, D),
    }
