"""What LoRA adapts, checked before a model is changed: the settings (`LoRAConfig`), the module
names they may give (`LORA_MODULES`, `HF_MODULE_ALIASES`), QLoRA's rule on the shape of a
quantised weight (`NF4_NUMEL_MULTIPLE`), and the linears of a torchtune decoder a config selects.
The transforms that use them (`apply_lora`, merging, PEFT folders) are in `posttrain.models.lora`,
from which these names import too.

Module names are torchtune's (`LORA_MODULES`); configs also accept the HF names o_proj, gate_proj,
down_proj and up_proj (`HF_MODULE_ALIASES`).

Example:
    >>> from posttrain.models.lora_config import LoRAConfig
    >>> config = LoRAConfig(rank=4, modules=("q_proj", "o_proj", "gate_proj"))
    >>> config.modules, config.converter   # HF names are stored as torchtune's
    (('q_proj', 'output_proj', 'w1'), 'lora')
    >>> LoRAConfig(rank=4, modules=("lm_head",))
    Traceback (most recent call last):
    ...
    ValueError: LoRAConfig.modules names 'lm_head'; allowed: q_proj, k_proj, v_proj, ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from posttrain.models.specs import ModelSpec

__all__ = ["LORA_MODULES", "HF_MODULE_ALIASES", "NF4_NUMEL_MULTIPLE", "LoRAConfig"]

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3")
"""The linears of a transformer layer LoRA can adapt: `attn.{q,k,v,output}_proj`, `mlp.w1`
(HF gate_proj), `mlp.w2` (down_proj), `mlp.w3` (up_proj)."""
HF_MODULE_ALIASES = {"o_proj": "output_proj", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
"""HF module names accepted in `LoRAConfig.modules`, and the torchtune names they stand for."""
NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256
NF4_NUMEL_MULTIPLE = NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE
"""torchao `NF4Tensor.from_tensor` (0.15) needs numel % 64 == 0 (one absmax per block of 64) and
a number of blocks divisible by 256 (the absmax values are quantised again in blocks of 256), so a
quantised weight's numel must be a multiple of 64 * 256 = 16,384."""
_BLOCK_OF = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "output_proj": "attn",
    "w1": "mlp",
    "w2": "mlp",
    "w3": "mlp",
}


@dataclass(kw_only=True, frozen=True)
class LoRAConfig:
    """LoRA settings; the converter named "lora", or "qlora" when `quantize_base`.

    Args:
        rank: r, the inner dimension of A `[r, in]` and B `[out, r]`.
        alpha: the scale numerator; adapters add `(alpha / rank) * B A x`.
        dropout: dropout probability on the adapter's input, in [0, 1).
        modules: which linears of every transformer layer to adapt: names from `LORA_MODULES`
            or `HF_MODULE_ALIASES` (stored as torchtune names, in the order given).
        quantize_base: store the frozen base weights as NF4 (QLoRA).

    Raises:
        ValueError: naming the field, its value and what is allowed.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "output_proj")
    quantize_base: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank={self.rank!r}; must be an integer >= 1")
        if not _is_number(self.alpha) or not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRAConfig.alpha={self.alpha!r}; must be a finite number > 0")
        if not _is_number(self.dropout) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoRAConfig.dropout={self.dropout!r}; must be a number in [0, 1)")
        if not isinstance(self.quantize_base, bool):
            raise ValueError(
                f"LoRAConfig.quantize_base={self.quantize_base!r}; must be True or False"
            )
        allowed = f"allowed: {', '.join(LORA_MODULES)} (or HF names {', '.join(HF_MODULE_ALIASES)})"
        if (
            isinstance(self.modules, str)
            or not isinstance(self.modules, (tuple, list))
            or not self.modules
        ):
            raise ValueError(
                f"LoRAConfig.modules={self.modules!r}; must be a non-empty tuple of "
                f"module names; {allowed}"
            )
        names = []
        for name in self.modules:
            tune = HF_MODULE_ALIASES.get(name, name)
            if tune not in LORA_MODULES:
                raise ValueError(f"LoRAConfig.modules names {name!r}; {allowed}")
            if tune in names:
                raise ValueError(f"LoRAConfig.modules names {tune!r} twice ({self.modules!r})")
            names.append(tune)
        object.__setattr__(self, "modules", tuple(names))

    @property
    def converter(self) -> str:
        """The converter name: "qlora" when the base is quantised, else "lora"."""
        return "qlora" if self.quantize_base else "lora"


def _find_targets(
    model: nn.Module, modules: tuple[str, ...], spec: ModelSpec | None
) -> list[tuple[str, nn.Linear]]:
    """(qualified name, linear) of every targeted linear, or ValueError before any change."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"LoRA needs a torchtune TransformerDecoder (with `layers`), got {type(model).__name__}"
        )
    if spec is not None and getattr(spec, "num_layers", len(layers)) != len(layers):
        raise ValueError(
            f"spec.num_layers={spec.num_layers} but the model has {len(layers)} "
            "layers; pass the model's own ModelSpec"
        )
    has = _linear_names(model)
    missing = [m for m in modules if m not in has]
    if missing:
        mlp = type(getattr(layers[0], "mlp", None)).__name__
        raise ValueError(
            f"LoRAConfig.modules names {missing[0]!r}, which this model does not "
            f"have as a linear in every layer (its MLP is {mlp}); the model has: "
            f"{', '.join(has) or 'none'}"
        )
    return [
        (f"layers.{i}.{_BLOCK_OF[m]}.{m}", getattr(getattr(layer, _BLOCK_OF[m]), m))
        for i, layer in enumerate(layers)
        for m in modules
    ]


def _linear_names(model: nn.Module) -> list[str]:
    """The names of `LORA_MODULES` that are an `nn.Linear` in every layer of `model`."""
    return [
        m
        for m in LORA_MODULES
        if all(
            isinstance(getattr(getattr(layer, _BLOCK_OF[m], None), m, None), nn.Linear)
            for layer in getattr(model, "layers", ())
        )
    ]


def _check_nf4_shape(name: str, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.numel() % NF4_NUMEL_MULTIPLE:
        raise ValueError(
            f"QLoRA (LoRAConfig.quantize_base=True) cannot quantise {name}: weight shape "
            f"{tuple(weight.shape)}, numel {weight.numel()}; NF4 needs a 2-D weight whose numel "
            f"is a multiple of {NF4_BLOCK_SIZE} * {NF4_SCALER_BLOCK_SIZE} = {NF4_NUMEL_MULTIPLE:,} "
            "(torchao block size x scaler block size); drop this module from "
            "LoRAConfig.modules or pick dimensions that fit"
        )
    if not weight.dtype.is_floating_point:
        raise ValueError(f"QLoRA cannot quantise {name}: dtype {weight.dtype} is not a float")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
