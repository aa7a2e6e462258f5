"""LoRA and QLoRA adapters on a built torchtune decoder (torchtune's `LoRALinear`), merging them
into the base, and the Hugging Face PEFT folder format. The settings and the linears they select
(`LoRAConfig`, `LORA_MODULES`, QLoRA's shape rule) are in `posttrain.models.lora_config` and
import from here too.

LoRA (Hu et al. 2021, arXiv:2106.09685, eq. 3) replaces a frozen linear `W x` by
`W x + (alpha / rank) * B A x` with `A: [rank, in]`, `B: [out, rank]`; QLoRA (Dettmers et al. 2023,
arXiv:2305.14314) stores the frozen `W` as 4-bit NormalFloat (torchao `NF4Tensor`).

Order of use (see `posttrain.train.converters`): build or load the model, `apply_lora`, then an
optional ParallelPlan, then the optimizer over the parameters that require grad.

    model = build_model(spec)
    report = apply_lora(model, LoRAConfig(rank=8, modules=("q_proj", "v_proj")), spec=spec)
    ...                                   # train
    save_peft_adapter(model, "out/adapter", spec=spec)   # peft.PeftModel.from_pretrained reads it
    merge_lora(model)                     # a plain decoder again
    save_hf_checkpoint(model, spec, "out/merged")
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from posttrain.models import peft_format
from posttrain.models.conversion import ConversionReport, forget_converter
from posttrain.models.lora_config import (
    HF_MODULE_ALIASES,
    LORA_MODULES,
    NF4_BLOCK_SIZE,
    NF4_NUMEL_MULTIPLE,
    NF4_SCALER_BLOCK_SIZE,
    LoRAConfig,
    _check_nf4_shape,
    _find_targets,
    _linear_names,
)

if TYPE_CHECKING:
    from posttrain.models.specs import ModelSpec

__all__ = [
    "LORA_MODULES",
    "HF_MODULE_ALIASES",
    "NF4_NUMEL_MULTIPLE",
    "ADAPTER_INIT_SEED",
    "LoRAConfig",
    "apply_lora",
    "adapter_state_dict",
    "merge_lora",
    "merge_into",
    "merged_state_dict",
    "parameter_bytes",
    "save_peft_adapter",
    "load_peft_adapter",
    "has_adapters",
    "adapters_disabled",
]

ADAPTER_INIT_SEED = 0
"""`apply_lora` draws A from this seed in a forked RNG: converting the same model twice gives
the same adapters whatever the global RNG state, which it leaves untouched."""


# ---------------------------------------------------------------------------------------------
# Apply


def apply_lora(
    model: nn.Module, config: LoRAConfig, *, spec: ModelSpec | None = None
) -> ConversionReport:
    """Replace the targeted `nn.Linear` of every transformer layer by a torchtune `LoRALinear`,
    in place, and freeze everything but the adapters.

    The base weight and bias are kept as they are (the same tensors; NF4 with `quantize_base`);
    A takes torchtune's Kaiming-uniform initialisation (drawn from `ADAPTER_INIT_SEED` in a forked
    RNG, so the conversion is deterministic) and B zeros, so the
    converted model's logits equal the original's exactly (LoRA) or those of the dequantised
    base (QLoRA). Adapters take the base weight's dtype (for NF4 the dtype it was quantised
    from). Apply before any ParallelPlan and before building the optimizer.

    Args:
        model: a torchtune `TransformerDecoder` (`model.layers[i].attn` / `.mlp`), no adapters.
        config: the LoRA settings.
        spec: the model's `ModelSpec`; when given, its num_layers must match the model.

    Returns:
        A `ConversionReport` named `config.converter`, listing the converted modules and the
        trainable (adapter) and total parameter counts.

    Raises:
        TypeError: `config` is not a LoRAConfig, or the model has no `layers`.
        ValueError: before anything is changed: the model has adapters already; it lacks a linear
            named in `LoRAConfig.modules` (e.g. w1 of an MoE MLP; the names it has are listed);
            `spec` disagrees with it; or, with `quantize_base`, a targeted weight's numel is not
            a multiple of `NF4_NUMEL_MULTIPLE` (module, shape and numel named).
    """
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    if not isinstance(config, LoRAConfig):
        raise TypeError(f"apply_lora needs a LoRAConfig, got {type(config).__name__}")
    if has_adapters(model):
        raise ValueError(
            "this model has LoRA adapters already; apply_lora converts a plain "
            "model once (merge_lora first to adapt a merged model again)"
        )
    targets = _find_targets(model, config.modules, spec)
    if config.quantize_base:
        for name, linear in targets:
            _check_nf4_shape(name, linear.weight)

    cuda = sorted(
        {lin.weight.device.index or 0 for _, lin in targets if lin.weight.device.type == "cuda"}
    )
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(ADAPTER_INIT_SEED)
        for name, linear in targets:
            _replace_linear(model, name, linear, config)

    set_trainable_params(model, get_adapter_params(model))
    params = list(model.parameters())
    return ConversionReport(
        name=config.converter,
        converted=tuple(name for name, _ in targets),
        skipped={"output": "the output projection and embeddings are not adapted"},
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad),
        total_parameters=sum(p.numel() for p in params),
    )


def _replace_linear(model: nn.Module, name: str, linear: nn.Linear, config: LoRAConfig) -> None:
    """Put a `LoRALinear` holding `linear`'s weight (NF4 when quantising) and bias at `name`."""
    from torchao.dtypes.nf4tensor import to_nf4
    from torchtune.modules.peft import LoRALinear

    weight = linear.weight
    with torch.device("meta"):
        lora = LoRALinear(
            linear.in_features,
            linear.out_features,
            rank=config.rank,
            alpha=config.alpha,
            dropout=config.dropout,
            use_bias=linear.bias is not None,
            quantize_base=config.quantize_base,
        )
    lora.to_empty(device=weight.device)  # materialises lora_a / lora_b only
    lora.initialize_parameters()
    lora.lora_a.to(dtype=weight.dtype)
    lora.lora_b.to(dtype=weight.dtype)
    with torch.no_grad():
        base = (
            to_nf4(weight.detach().contiguous(), NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE)
            if config.quantize_base
            else weight.detach()
        )
    lora.weight = nn.Parameter(base, requires_grad=False)
    lora.bias = linear.bias
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name), attr, lora)


# ---------------------------------------------------------------------------------------------
# State, merge, bytes


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights: `{layers.{i}.attn.q_proj.lora_a.weight: [rank, in], ...lora_b.weight:
    [out, rank]}` (torchtune names), detached tensors sharing the model's storage (clone to
    keep a snapshot). Raises ValueError for a model without adapters."""
    from torchtune.modules.peft import get_adapter_params

    _require_adapters(model, "adapter_state_dict")
    return {k: v.detach() for k, v in get_adapter_params(model).items()}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base, in place: each `LoRALinear` becomes a plain `nn.Linear`
    with `W' = W + (alpha / rank) * B @ A` (LoRA eq. 3), bias kept.

    The sum is computed in fp32 (an NF4 base dequantised first, exactly as its forward does) and
    cast once to the base dtype: the dtype of `W`, for NF4 the dtype it was quantised from (bf16
    for an NF4 built from bf16, else fp32). So a bf16 `W'` is `W + s B A` rounded once, not the
    result of bf16 arithmetic. Merged weights stay frozen like the rest of the base; the result
    is a plain decoder that `posttrain.models.hf.save_hf_checkpoint` saves.

    Returns `model`. Raises ValueError for a model without adapters.
    """
    from torchtune.modules.peft import LoRALinear

    _require_adapters(model, "merge_lora")
    loras = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, lora in loras:
        merged = _merged_weight(
            lora.weight, lora.lora_a.weight, lora.lora_b.weight, lora.alpha / lora.rank
        )
        with torch.device("meta"):
            linear = nn.Linear(lora.in_dim, lora.out_dim, bias=lora.bias is not None)
        linear.weight = nn.Parameter(merged, requires_grad=False)
        linear.bias = lora.bias
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, linear)
    for converter in ("lora", "qlora"):  # a plain model again: it may be adapted anew
        forget_converter(model, converter)
    return model


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the plain decoder `merge_lora(model)` would make, without changing
    `model`: each adapted linear's `weight` is a NEW tensor `W + (alpha / rank) * B @ A` (fp32
    sum, an NF4 base dequantised, one cast to the base dtype, as `merge_lora`) and its
    `lora_a` / `lora_b` keys are gone; an adapter switched off (`adapters_disabled`) gives its
    base alone. Other entries are `model.state_dict()`'s own (detached) tensors: frozen in LoRA
    training, and read-only here. Nothing returned aliases an adapter, so an optimizer step
    after the call leaves the returned weights as they were. Raises ValueError for a model
    without adapters."""
    from torchtune.modules.peft import LoRALinear

    _require_adapters(model, "merged_state_dict")
    state = model.state_dict()
    for name, lora in model.named_modules():
        if not isinstance(lora, LoRALinear):
            continue
        a, b = state.pop(f"{name}.lora_a.weight"), state.pop(f"{name}.lora_b.weight")
        scale = 0.0 if lora.disabled else lora.alpha / lora.rank
        state[f"{name}.weight"] = _merged_weight(lora.weight, a, b, scale)
    return state


def merge_into(
    base_state_dict: Mapping[str, torch.Tensor],
    adapter_state: Mapping[str, torch.Tensor],
    config: LoRAConfig,
) -> dict[str, torch.Tensor]:
    """Merge a saved adapter (`adapter_state_dict` of a model trained with `config`) into the
    state dict of a base model (torchtune names), as `merge_lora` does: `W' = W + (alpha / rank)
    * B @ A` in fp32, cast once to W's dtype. Returns a new dict; other entries are the same
    tensors as in `base_state_dict`.

    Raises:
        ValueError: an adapter key that is not `<module>.lora_a.weight` / `.lora_b.weight`, a
            module with only one of A and B, a module the base lacks, A / B whose rank is not
            `config.rank`, or a shape mismatch between the adapter and the base weight (module and
            both shapes named).
    """
    if not isinstance(config, LoRAConfig):
        raise TypeError(f"merge_into needs a LoRAConfig, got {type(config).__name__}")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapter_state.items():
        for part in ("a", "b"):
            suffix = f".lora_{part}.weight"
            if key.endswith(suffix):
                modules.setdefault(key[: -len(suffix)], {})[part] = value
                break
        else:
            raise ValueError(f"adapter key {key!r} is not a lora_a / lora_b weight")
    merged = dict(base_state_dict)
    for module, ab in modules.items():
        if set(ab) != {"a", "b"}:
            raise ValueError(
                f"adapter of {module} has lora_{''.join(ab)} only; it needs both lora_a and lora_b"
            )
        if f"{module}.weight" not in base_state_dict:
            raise ValueError(
                f"the base state dict has no {module}.weight for the adapter of {module}"
            )
        base, a, b = base_state_dict[f"{module}.weight"], ab["a"], ab["b"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.rank or b.shape[1] != config.rank:
            raise ValueError(
                f"adapter of {module}: lora_a {tuple(a.shape)} and lora_b "
                f"{tuple(b.shape)} do not have LoRAConfig.rank={config.rank}"
            )
        if (b.shape[0], a.shape[1]) != tuple(base.shape):
            raise ValueError(
                f"adapter of {module} is for a weight of shape "
                f"{(b.shape[0], a.shape[1])} (lora_b {tuple(b.shape)} @ lora_a "
                f"{tuple(a.shape)}) but the base weight has shape {tuple(base.shape)}"
            )
        merged[f"{module}.weight"] = _merged_weight(base, a, b, config.alpha / config.rank)
    return merged


@torch.no_grad()
def _merged_weight(
    base: torch.Tensor, a_RI: torch.Tensor, b_OR: torch.Tensor, scale: float
) -> torch.Tensor:
    """(base + scale * B @ A) in fp32, cast once to the base dtype. Shapes: O out, I in, R rank."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    dense = base.get_original_weight() if isinstance(base, NF4Tensor) else base.detach()
    out = dense.float() + scale * (b_OR.detach().float() @ a_RI.detach().float())
    return out.to(base.dtype)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes the model's parameters occupy (shared parameters counted once). An NF4 weight counts
    its packed 4-bit codes, int8 block scales, per-256-block factors, mean and 16-entry code
    table (the tensors torchao's `NF4Tensor` holds), not its logical `numel * element_size`."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    total = 0
    for p in model.parameters():
        data = p.data if isinstance(p, nn.Parameter) else p
        if isinstance(data, NF4Tensor):
            names, _ = data.__tensor_flatten__()
            total += sum(getattr(data, n).numel() * getattr(data, n).element_size() for n in names)
        else:
            total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------------------------------------
# PEFT folders (formats in posttrain.models.peft_format)


def save_peft_adapter(
    model: nn.Module,
    folder: str | os.PathLike,
    *,
    spec: ModelSpec,
    base_model_name_or_path: str = "",
) -> Path:
    """Write the model's adapters as a PEFT LoRA folder: adapter_config.json and
    adapter_model.safetensors (HF key names, llama q/k lora_B rows in HF's order, tensors in the
    adapters' dtype), so that `peft.PeftModel.from_pretrained(hf_base, folder)` on the HF model of
    the same base gives the same logits.

    Args:
        model: a model converted by `apply_lora` (or `load_peft_adapter`).
        folder: destination (created; existing adapter files are overwritten).
        spec: the model's `ModelSpec` (family and head counts for the q/k permutation).
        base_model_name_or_path: written into adapter_config.json (PEFT's pointer to the base).

    Returns:
        The folder.

    Raises:
        ValueError: the model has no adapters, or its adapters differ in rank, alpha or dropout,
            or do not cover every layer alike (PEFT's config holds one setting for all).
    """
    from safetensors.torch import save_file

    settings = _adapter_settings(model)
    weights = peft_format.tune_to_peft_weights(
        adapter_state_dict(model),
        family=spec.family,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        embed_dim=spec.embed_dim,
        head_dim=spec.head_dim,
    )
    config = peft_format.peft_config(**settings, base_model_name_or_path=base_model_name_or_path)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in weights.items()},
        str(folder / peft_format.ADAPTER_WEIGHTS_NAME),
        metadata={"format": "pt"},
    )
    (folder / peft_format.ADAPTER_CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def load_peft_adapter(
    model: nn.Module, folder: str | os.PathLike, *, spec: ModelSpec, quantize_base: bool = False
) -> ConversionReport:
    """Put the adapters of a PEFT LoRA folder (e.g. written by `peft` itself) onto a plain
    model: `apply_lora` with the folder's r / lora_alpha / lora_dropout / target_modules, then
    the folder's A and B weights (cast to the adapters' dtype).

    Args:
        model: a plain torchtune decoder of `spec` (the base the adapter was trained on).
        folder: holds adapter_config.json and adapter_model.safetensors.
        spec: the model's `ModelSpec`.
        quantize_base: load as QLoRA (NF4 base).

    Returns:
        The `ConversionReport` of `apply_lora`.

    Raises:
        FileNotFoundError: a file of the folder is absent.
        ValueError: before the model is changed: the config is not plain LoRA (field named, see
            `peft_format.lora_settings_from_peft_config`); target modules the model lacks; weight
            keys missing or unexpected for the model's layers; or weights whose shapes do not
            fit the model (key and both shapes named).
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in (peft_format.ADAPTER_CONFIG_NAME, peft_format.ADAPTER_WEIGHTS_NAME):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"no {name} in {folder} (a PEFT adapter folder holds "
                f"{peft_format.ADAPTER_CONFIG_NAME} and "
                f"{peft_format.ADAPTER_WEIGHTS_NAME})"
            )
    settings = peft_format.lora_settings_from_peft_config(
        json.loads((folder / peft_format.ADAPTER_CONFIG_NAME).read_text())
    )
    config = LoRAConfig(**settings, quantize_base=quantize_base)
    if has_adapters(model):
        raise ValueError(
            "this model has LoRA adapters already; load_peft_adapter needs a plain model"
        )
    lacking = [m for m in config.modules if m not in _linear_names(model)]
    if lacking:
        hf = peft_format.TUNE_TO_HF_MODULE
        raise ValueError(
            f"adapter_config.json target_modules names {hf[lacking[0]]!r}, which "
            "this model does not have as a linear in every layer; it has: "
            f"{', '.join(hf[m] for m in _linear_names(model)) or 'none'}"
        )
    targets = dict(_find_targets(model, config.modules, spec))
    state = peft_format.peft_to_tune_weights(
        load_file(str(folder / peft_format.ADAPTER_WEIGHTS_NAME)),
        family=spec.family,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
    )
    expected = {
        f"{name}.lora_{p}.weight": (config.rank, lin.in_features)
        if p == "a"
        else (lin.out_features, config.rank)
        for name, lin in targets.items()
        for p in ("a", "b")
    }
    peft_format.check_weights(state, expected, where=folder / peft_format.ADAPTER_WEIGHTS_NAME)
    report = apply_lora(model, config, spec=spec)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in state.items():
            params[key].copy_(value)
    return report


def _adapter_settings(model: nn.Module) -> dict[str, Any]:
    """rank / alpha / dropout / modules shared by every adapter, or ValueError."""
    from torchtune.modules.peft import LoRALinear

    _require_adapters(model, "save_peft_adapter")
    return peft_format.shared_settings(
        {
            n: (m.rank, float(m.alpha), getattr(m.dropout, "p", 0.0))
            for n, m in model.named_modules()
            if isinstance(m, LoRALinear)
        },
        num_layers=len(getattr(model, "layers", ())),
    )


def _require_adapters(model: nn.Module, what: str) -> None:
    if not has_adapters(model):
        raise ValueError(
            f"{what} needs a model with LoRA adapters "
            "(posttrain.models.lora.apply_lora); this one has none"
        )


def has_adapters(model: nn.Module) -> bool:
    """True when `model` holds LoRA adapters (any torchtune `AdapterModule`: a module with an
    `adapter_params()` method, the test torchtune's `get_adapter_params` and `disable_adapter`
    use; `AdapterModule` is a Protocol that `isinstance` cannot check)."""
    return any(callable(getattr(m, "adapter_params", None)) for m in model.modules())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` as its base inside the block: every adapter is switched off (torchtune
    `disable_adapter`), so the base model serves as the reference policy without a second copy
    in memory. Yields `model`. Raises ValueError if the model has no adapters."""
    from torchtune.modules.peft import disable_adapter

    if not has_adapters(model):
        raise ValueError(
            "adapters_disabled needs a model with LoRA adapters "
            "(posttrain.models.lora.apply_lora); this one has none"
        )
    with disable_adapter(model):
        yield model
