"""The Hugging Face PEFT adapter format: `adapter_config.json` <-> LoRA settings, and torchtune
adapter keys <-> PEFT keys. Pure functions over dicts and tensors; the functions that read and
write a model's adapters (`save_peft_adapter`, `load_peft_adapter`) are in
`posttrain.models.lora`.

A PEFT LoRA folder (what `peft.PeftModel.save_pretrained` writes for a `*ForCausalLM`) holds:
  * adapter_config.json: `peft_type` "LORA", `r`, `lora_alpha`, `lora_dropout`, `target_modules`
    (HF module names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), and options
    that posttrain refuses when they are switched on (`UNSUPPORTED_OPTIONS`).
  * adapter_model.safetensors: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
    `[r, in]` and `...lora_B.weight` `[out, r]` per adapted linear; PEFT's forward adds
    `(lora_alpha / r) * B @ A @ x`, as torchtune's `LoRALinear` does with lora_a / lora_b.

Llama: torchtune's RoPE pairs interleaved channels, HF's pairs the two halves of each head, so the
q/k rows of a checkpoint are permuted (`torchtune.models.convert_weights.hf_to_tune`). Only B has
output rows, so only lora_B of q_proj / k_proj is permuted; torchtune's
`tune_to_peft_adapter_weights` does it on the way out and `_hf_to_tune_rows` undoes it on the way
in. Qwen2's torchtune RoPE is rotate-half already: no permutation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, TypeGuard

import torch

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "TUNE_TO_HF_MODULE",
    "HF_TO_TUNE_MODULE",
    "UNSUPPORTED_OPTIONS",
    "peft_config",
    "lora_settings_from_peft_config",
    "tune_to_peft_weights",
    "peft_to_tune_weights",
    "check_weights",
    "shared_settings",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"

TUNE_TO_HF_MODULE = {
    "q_proj": "q_proj",
    "k_proj": "k_proj",
    "v_proj": "v_proj",
    "output_proj": "o_proj",
    "w1": "gate_proj",
    "w2": "down_proj",
    "w3": "up_proj",
}
"""torchtune linear name -> HF (and PEFT target_modules) name, for the modules LoRA targets."""
HF_TO_TUNE_MODULE = {hf: tune for tune, hf in TUNE_TO_HF_MODULE.items()}
_BLOCK = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "output_proj": "attn",
    "w1": "mlp",
    "w2": "mlp",
    "w3": "mlp",
}
_HF_BLOCK = {"attn": "self_attn", "mlp": "mlp"}

UNSUPPORTED_OPTIONS: dict[str, Any] = {
    "use_dora": False,
    "use_rslora": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "fan_in_fan_out": False,
    "lora_bias": False,
    "use_qalora": False,
    "exclude_modules": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "layer_replication": None,
    "alora_invocation_tokens": None,
    "megatron_config": None,
    "use_bdlora": None,
    "arrow_config": None,
    "monteclora_config": None,
    "kasa_config": None,
}
"""adapter_config.json options that change what the adapter computes or where it sits, with the
value that switches them off (an empty list or dict counts as off too). Any other value is
refused: a torchtune `LoRALinear` on every layer computes plain LoRA only."""

_PREFIX = "base_model.model."
_TUNE_KEY = re.compile(r"^layers\.(\d+)\.(attn|mlp)\.(\w+)\.lora_([ab])\.weight$")
_PEFT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])\.weight$"
)


def peft_config(
    *,
    rank: int,
    alpha: float,
    dropout: float,
    modules: tuple[str, ...],
    base_model_name_or_path: str = "",
) -> dict[str, Any]:
    """The adapter_config.json dict of plain LoRA on `modules` (torchtune names) of every layer.

    Target names are mapped by torchtune's `tune_to_peft_adapter_config` (output_proj -> o_proj,
    w1 -> gate_proj, w2 -> down_proj, w3 -> up_proj). Raises ValueError for an unknown module.
    """
    from torchtune.models.convert_weights import tune_to_peft_adapter_config

    unknown = [m for m in modules if m not in TUNE_TO_HF_MODULE]
    if unknown:
        raise ValueError(
            f"module {unknown[0]!r} has no PEFT name; allowed: {', '.join(TUNE_TO_HF_MODULE)}"
        )
    config = tune_to_peft_adapter_config(
        {"r": rank, "lora_alpha": alpha, "target_modules": list(modules)},
        base_model_name_or_path=base_model_name_or_path or None,
    )
    config.setdefault("base_model_name_or_path", base_model_name_or_path or None)
    config.update(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        lora_dropout=dropout,
        bias="none",
        inference_mode=True,
        init_lora_weights=True,
        target_modules=sorted(config["target_modules"]),
    )
    config.update({k: v for k, v in UNSUPPORTED_OPTIONS.items() if v is not None})
    return config


def shared_settings(
    adapters: Mapping[str, tuple[int, float, float]], *, num_layers: int
) -> dict[str, Any]:
    """The one (rank, alpha, dropout) and the module names that `adapters` (qualified module
    name, e.g. "layers.0.attn.q_proj" -> (rank, alpha, dropout)) share, as `peft_config` takes
    them. Raises ValueError when the settings differ or the adapters do not sit on the same
    modules of every one of `num_layers` layers (one adapter_config.json cannot say that)."""
    found = set(adapters.values())
    if len(found) != 1:
        raise ValueError(
            f"the adapters have different (rank, alpha, dropout) settings "
            f"{sorted(found)}; a PEFT adapter_config.json holds one"
        )
    rank, alpha, dropout = found.pop()
    modules = tuple(m for m in TUNE_TO_HF_MODULE if any(n.endswith(f".{m}") for n in adapters))
    expected = {f"layers.{i}.{_BLOCK[m]}.{m}" for i in range(num_layers) for m in modules}
    if set(adapters) != expected:
        raise ValueError(
            f"adapters on {sorted(set(adapters) ^ expected)[:4]} break the pattern "
            f"of {', '.join(modules)} on every layer that PEFT's target_modules "
            "expresses"
        )
    return {"rank": rank, "alpha": alpha, "dropout": dropout, "modules": modules}


def lora_settings_from_peft_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Read a parsed adapter_config.json as plain-LoRA settings.

    Returns:
        {"rank": int, "alpha": float, "dropout": float, "modules": tuple of torchtune names in
        `TUNE_TO_HF_MODULE` order}.

    Raises:
        ValueError: naming the field when `peft_type` is not "LORA", `task_type` is neither
            "CAUSAL_LM" nor null, `bias` is not "none", an option of `UNSUPPORTED_OPTIONS` is
            switched on, `target_modules` is not a non-empty list of HF linear names (a regex
            string such as "all-linear" is refused), or r / lora_alpha / lora_dropout are out
            of range.
    """

    def bad(field: str, allowed: str) -> ValueError:
        return ValueError(f"adapter_config.json {field}={config.get(field)!r}; {allowed}")

    if config.get("peft_type") != "LORA":
        raise bad("peft_type", "only 'LORA' adapters are supported")
    if config.get("task_type") not in ("CAUSAL_LM", None):
        raise bad("task_type", "allowed: 'CAUSAL_LM' or null")
    if config.get("bias", "none") != "none":
        raise bad("bias", "allowed: 'none' (trained biases are not part of a LoRA adapter here)")
    for field, off in UNSUPPORTED_OPTIONS.items():
        value = config.get(field, off)
        if value != off and value not in (None, False, [], {}):
            raise bad(field, f"only plain LoRA is supported; allowed: {off!r}")
    targets = config.get("target_modules")
    if not isinstance(targets, (list, tuple)) or not targets:
        raise bad(
            "target_modules",
            "must be a non-empty list of module names from "
            f"{', '.join(HF_TO_TUNE_MODULE)} (regex strings such as 'all-linear' are not "
            "supported)",
        )
    unknown = [t for t in targets if t not in HF_TO_TUNE_MODULE]
    if unknown:
        raise bad(
            "target_modules",
            f"{unknown[0]!r} is not supported; allowed: {', '.join(HF_TO_TUNE_MODULE)}",
        )
    rank, alpha, dropout = (
        config.get("r"),
        config.get("lora_alpha"),
        config.get("lora_dropout", 0.0),
    )
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise bad("r", "must be an integer >= 1")
    if not _is_number(alpha) or not (math.isfinite(alpha) and alpha > 0):
        raise bad("lora_alpha", "must be a finite number > 0")
    if not _is_number(dropout) or not 0 <= dropout < 1:
        raise bad("lora_dropout", "must be a number in [0, 1)")
    wanted = {HF_TO_TUNE_MODULE[t] for t in targets}
    return {
        "rank": rank,
        "alpha": float(alpha),
        "dropout": float(dropout),
        "modules": tuple(m for m in TUNE_TO_HF_MODULE if m in wanted),
    }


def tune_to_peft_weights(
    adapter_state: Mapping[str, torch.Tensor],
    *,
    family: str,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    head_dim: int,
) -> dict[str, torch.Tensor]:
    """torchtune adapter state (`layers.{i}.attn.q_proj.lora_a.weight` ...) -> PEFT keys
    (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ...).

    For a family with torchtune's interleaved RoPE ("llama3", "mistral":
    `FamilyTraits.interleaved_rope`) torchtune's `tune_to_peft_adapter_weights` renames and
    permutes the q/k lora_B rows `[H * head_dim, r]` into HF's rotate-half order, as
    `posttrain.models.hf` permutes the q/k weights; for "qwen2" and "qwen3" keys are renamed only.
    Raises ValueError for a key that is not a layer's lora_a / lora_b weight.
    """
    for key in adapter_state:
        match = _TUNE_KEY.match(key)
        if match is None or match.group(3) not in TUNE_TO_HF_MODULE:
            raise ValueError(
                f"adapter key {key!r} is not a LoRA weight of a transformer layer "
                "(layers.{i}.attn|mlp.<module>.lora_a|lora_b.weight)"
            )
    if _interleaved_rope(family):
        from torchtune.models.convert_weights import tune_to_peft_adapter_weights

        return tune_to_peft_adapter_weights(
            dict(adapter_state),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dim=embed_dim,
            head_dim=head_dim,
        )
    out = {}
    for key, value in adapter_state.items():
        match = _TUNE_KEY.match(key)
        if match is None:
            raise ValueError(
                f"adapter key {key!r} is not a torchtune LoRA key "
                "(layers.N.attn|mlp.NAME.lora_a|lora_b.weight)"
            )
        layer, block, name, ab = match.groups()
        hf = f"model.layers.{layer}.{_HF_BLOCK[block]}.{TUNE_TO_HF_MODULE[name]}"
        out[f"{_PREFIX}{hf}.lora_{ab.upper()}.weight"] = value
    return out


def peft_to_tune_weights(
    peft_state: Mapping[str, torch.Tensor],
    *,
    family: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, torch.Tensor]:
    """The inverse of `tune_to_peft_weights`: PEFT keys -> torchtune adapter keys, with the
    llama q/k lora_B rows permuted back into torchtune's interleaved RoPE order (the row
    permutation of `torchtune.models.convert_weights.hf_to_tune`).

    Raises ValueError for a key that is not a layer's lora_A / lora_B weight of a supported
    module (e.g. an embedding adapter or `lm_head`).
    """
    out = {}
    for key, value in peft_state.items():
        match = _PEFT_KEY.match(key)
        if match is None or match.group(3) not in HF_TO_TUNE_MODULE:
            raise ValueError(
                f"{ADAPTER_WEIGHTS_NAME} key {key!r} is not a LoRA weight of a "
                "supported module (base_model.model.model.layers.{i}.self_attn|mlp."
                f"<{'|'.join(HF_TO_TUNE_MODULE)}>.lora_A|lora_B.weight)"
            )
        layer, _, hf_name, ab = match.groups()
        name = HF_TO_TUNE_MODULE[hf_name]
        if _interleaved_rope(family) and ab == "B" and name in ("q_proj", "k_proj"):
            heads = num_heads if name == "q_proj" else num_kv_heads
            value = _hf_to_tune_rows(value, heads, head_dim)
        out[f"layers.{layer}.{_BLOCK[name]}.{name}.lora_{ab.lower()}.weight"] = value
    return out


def check_weights(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]], *, where: Any
) -> None:
    """Raise ValueError unless `state` (torchtune adapter keys, as `peft_to_tune_weights` gives)
    holds exactly the keys of `expected`, each with the expected shape (A `[r, in]`, B
    `[out, r]`). The message lists missing / unexpected keys, or names the key and both shapes;
    `where` (the file) is named too."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{where} does not match the model and adapter_config.json "
            f"target_modules: missing {missing[:4]}, unexpected {unexpected[:4]} "
            f"({len(missing)} / {len(unexpected)} keys)"
        )
    for key, shape in expected.items():
        if tuple(state[key].shape) != tuple(shape):
            raise ValueError(
                f"adapter weight {key} in {where} has shape "
                f"{tuple(state[key].shape)} but the model needs {tuple(shape)}; the "
                "adapter was trained on another base (or with another r)"
            )


def _interleaved_rope(family: str) -> bool:
    """Whether `family`'s q/k rows are permuted between torchtune and HF (`FamilyTraits`)."""
    from posttrain.models.specs import FAMILY_TRAITS

    return FAMILY_TRAITS[family].interleaved_rope  # type: ignore[index]


def _hf_to_tune_rows(t_OR: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Rows `[n_heads * head_dim, R]` from HF's rotate-half order to torchtune's interleaved
    order (as `hf_to_tune`'s `_permute` does for the weight, with R columns). A tensor of
    another shape is returned unchanged."""
    if t_OR.dim() != 2 or t_OR.shape[0] != n_heads * head_dim:
        return t_OR  # a misfit; the caller's shape check names the weight and both shapes
    rank = t_OR.shape[1]
    return (
        t_OR.reshape(n_heads, 2, head_dim // 2, rank)
        .transpose(1, 2)
        .reshape(n_heads * head_dim, rank)
    )


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
