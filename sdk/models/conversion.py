"""What a model transform (LoRA, QLoRA, FP8 training, QAT, a quantised rollout copy) did to a
built model: `ConversionReport`, returned by every converter and printed by the recipes.

Example:
    >>> report = ConversionReport(name="lora", converted=("layers.0.attn.q_proj",),
    ...                           skipped={"output": "the output projection is kept"})
    >>> print(report)
    lora: 1 module converted, 1 skipped (output: the output projection is kept)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ConversionReport",
    "PLAN_AXES",
    "applied_converters",
    "record_converter",
    "forget_converter",
    "check_plan_axes",
]

PLAN_AXES: dict[str, tuple[str, ...]] = {
    "lora": ("dp_replicate", "dp_shard"),
    "qlora": ("dp_replicate", "dp_shard"),
    "float8": ("dp_replicate", "dp_shard", "tp"),
    "qat": ("dp_replicate", "dp_shard"),
}
"""The ParallelPlan axes (degree > 1) a model converted by each converter may use: FSDP2 / HSDP
hold adapters, NF4 bases and float8 linears, and float8 linears also take torchtune's TP plan
(tests/train/test_float8.py: tp=2 against one process); that TP plan, Ulysses, pipeline stages and
expert parallelism were not built for LoRALinear modules or fake-quantised (QAT) linears."""

_ATTR = "_posttrain_converters"
_AXES = ("dp_replicate", "dp_shard", "tp", "sp", "pp", "ep")


@dataclass(frozen=True)
class ConversionReport:
    """The outcome of one converter applied to a model.

    Attributes:
        name: the converter's registered name ("lora", "qlora", "float8", "qat", ...).
        converted: fully qualified names of the modules it replaced or changed.
        skipped: module name -> why it was left alone (a module filter's reasons).
        trainable_parameters: parameters that still require grad afterwards (None when the
            converter does not change which parameters train).
        total_parameters: all parameter elements of the model afterwards (None likewise).
    """

    name: str
    converted: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    trainable_parameters: int | None = None
    total_parameters: int | None = None

    def __str__(self) -> str:
        n = len(self.converted)
        text = f"{self.name}: {n} module{'s' * (n != 1)} converted"
        if self.skipped:
            reasons = "; ".join(f"{k}: {v}" for k, v in list(self.skipped.items())[:4])
            more = f"; +{len(self.skipped) - 4} more" if len(self.skipped) > 4 else ""
            text += f", {len(self.skipped)} skipped ({reasons}{more})"
        if self.trainable_parameters is not None and self.total_parameters:
            share = 100 * self.trainable_parameters / self.total_parameters
            text += (
                f"; {self.trainable_parameters:,} of {self.total_parameters:,} parameters "
                f"train ({share:.2f}%)"
            )
        return text


def applied_converters(model: nn.Module) -> tuple[str, ...]:
    """Names of the converters applied to `model`, in order (empty for a plain model)."""
    return getattr(model, _ATTR, ())


def record_converter(model: nn.Module, name: str) -> None:
    """Note on `model` that converter `name` was applied (what `applied_converters` reads)."""
    setattr(model, _ATTR, applied_converters(model) + (name,))


def forget_converter(model: nn.Module, name: str) -> None:
    """Drop `name` from the converters recorded on `model` (after its effect was undone, e.g.
    adapters merged into the base by `posttrain.models.lora.merge_lora`)."""
    setattr(model, _ATTR, tuple(n for n in applied_converters(model) if n != name))


def check_plan_axes(model: nn.Module, plan: object) -> None:
    """Raise ValueError if `plan` (a ParallelPlan) uses an axis that a converter applied to
    `model` does not support (`PLAN_AXES`); a plain model passes."""
    used = [axis for axis in _AXES if getattr(plan, axis, 1) > 1]
    for name in applied_converters(model):
        bad = [axis for axis in used if axis not in PLAN_AXES.get(name, _AXES)]
        if bad:
            raise ValueError(
                f"{plan} on a model converted by {name!r}: {bad[0]}="
                f"{getattr(plan, bad[0])} is not supported with {name}; allowed "
                f"axes with {name}: {', '.join(PLAN_AXES[name])}"
            )
