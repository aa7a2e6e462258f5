"""Model converters: named transforms of a built model (LoRA, QLoRA, FP8 training, QAT),
registered in one registry and applied in one place, once, after the model is built (or loaded)
and before a `ParallelPlan` splits it and the optimizer is built.

    model = build_model(spec)                      # or load_hf_checkpoint(...)
    convert_model(model, [LoRAConfig(rank=8)], spec=spec)   # this module
    runtime = plan.parallelize(model, spec=spec)   # optional: FSDP2 / HSDP (see PLAN_AXES)
    optimizer = AdamW(p for p in model.parameters() if p.requires_grad)

Each config names its converter (`config.converter`): "lora" and "qlora"
(`posttrain.models.lora.apply_lora`), "float8" (`posttrain.train.float8.apply_float8`), "qat"
(`posttrain.train.qat.prepare_qat`). Whatever the order of the list, they run in
`CONVERTER_ORDER` (adapters first: FP8 and QAT then see only the frozen base's remaining
linears, which they leave alone when adapters hold them), and every converter returns a
`ConversionReport` (what it converted, what it skipped and why, how many parameters train).

Combinations that are refused, with the reason in the error: two adapter converters, FP8 with
QAT (both replace the same linears), FP8 or QAT on a QLoRA model (the base is NF4 already), a
converter twice, a model that already carries a plan (converters come first).

Under a ParallelPlan, a converted model may use the axes in `PLAN_AXES[name]` only (checked by
`posttrain.models.conversion.check_plan_axes`, called from `posttrain.train.sharding.parallelize`):
FSDP2 / HSDP work with adapters, NF4 bases and float8 linears; torchtune's TP plan, Ulysses,
pipeline stages and expert parallelism were not built for LoRALinear / Float8Linear modules.

Example:
    >>> from posttrain.models import build_model, get_preset
    >>> from posttrain.models.lora import LoRAConfig
    >>> model = build_model(get_preset("tiny-1m"), seed=0)
    >>> [r.name for r in convert_model(model, [LoRAConfig(rank=4)])]
    ['lora']
    >>> applied_converters(model)
    ('lora',)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from posttrain.models.conversion import (
    PLAN_AXES,
    ConversionReport,
    applied_converters,
    check_plan_axes,
    record_converter,
)
from posttrain.train.optimizer_check import remember_parameters
from posttrain.train.sharding import parallelized

__all__ = [
    "CONVERTER_ORDER",
    "EXCLUSIVE",
    "PLAN_AXES",
    "register_converter",
    "registered_converters",
    "convert_model",
    "applied_converters",
    "check_plan_axes",
    "checkpoint_state",
    "load_checkpoint_state",
]

CONVERTER_ORDER = ("lora", "qlora", "float8", "qat")
"""The order converters run in, whatever the order they are given in."""

# Pairs of converters that cannot be combined, and why.
EXCLUSIVE = [
    ({"lora", "qlora"}, "a model has one set of adapters (LoRA or QLoRA)"),
    ({"float8", "qat"}, "FP8 training and QAT both replace the same linear layers"),
    ({"qlora", "float8"}, "a QLoRA base is NF4 already; FP8 training would not apply"),
    ({"qlora", "qat"}, "a QLoRA base is NF4 already; QAT would not apply"),
]

Converter = Callable[..., ConversionReport]
_REGISTRY: dict[str, Converter] = {}


def register_converter(name: str, fn: Converter) -> None:
    """Register `fn(model, config, *, spec=None) -> ConversionReport` under `name`.

    Raises:
        ValueError: if `name` is registered already or is not in `CONVERTER_ORDER`.
    """
    if name in _REGISTRY:
        raise ValueError(f"converter {name!r} is registered already")
    if name not in CONVERTER_ORDER:
        raise ValueError(f"converter name {name!r}; allowed: {', '.join(CONVERTER_ORDER)}")
    _REGISTRY[name] = fn


def registered_converters() -> tuple[str, ...]:
    """The registered converter names, in the order they run."""
    _register_builtin()
    return tuple(n for n in CONVERTER_ORDER if n in _REGISTRY)


def _register_builtin() -> None:
    if _REGISTRY:
        return
    from posttrain.models.lora import apply_lora
    from posttrain.train.float8 import apply_float8
    from posttrain.train.qat import prepare_qat

    for name, fn in (
        ("lora", apply_lora),
        ("qlora", apply_lora),
        ("float8", apply_float8),
        ("qat", prepare_qat),
    ):
        register_converter(name, fn)


def convert_model(
    model: nn.Module, configs: Sequence[Any], *, spec: Any = None
) -> list[ConversionReport]:
    """Apply the converter of each config to `model`, in place, in `CONVERTER_ORDER`.

    Args:
        model: a built torchtune decoder without a ParallelPlan and without an optimizer yet.
        configs: converter configs (`LoRAConfig`, `Float8Config`, `QATConfig`); each names its
            converter in `config.converter`. None entries are skipped.
        spec: the model's `ModelSpec` (converters use it to name modules and check shapes).

    Returns:
        One `ConversionReport` per converter, in the order they ran.

    Raises:
        TypeError: for a config without a `converter` name.
        ValueError: for an unknown converter name, a converter given twice or already applied,
            a refused combination (module docstring), or a model that has a ParallelPlan.
    """
    _register_builtin()
    configs = [c for c in configs if c is not None]
    names = []
    for config in configs:
        name = getattr(config, "converter", None)
        if not isinstance(name, str):
            raise TypeError(
                f"{type(config).__name__} is not a converter config (it has no "
                "`converter` name); expected LoRAConfig, Float8Config or QATConfig"
            )
        if name not in _REGISTRY:
            raise ValueError(
                f"unknown converter {name!r}; registered: {', '.join(registered_converters())}"
            )
        names.append(name)
    done = applied_converters(model)
    every = list(done) + names
    twice = sorted({n for n in every if every.count(n) > 1})
    if twice:
        raise ValueError(
            f"converter {twice[0]!r} is given twice (or was applied to this model "
            "already); each converter applies once"
        )
    for pair, why in EXCLUSIVE:
        if pair <= set(every):
            raise ValueError(f"converters {' + '.join(sorted(pair))} cannot be combined: {why}")
    if names:
        plan_applied = parallelized(model)
        if plan_applied is not None:
            raise ValueError(
                f"this model already has a ParallelPlan applied ({plan_applied}); "
                "apply converters first (convert_model before plan.parallelize), "
                "then the plan"
            )
    reports = []
    for config in sorted(configs, key=lambda c: CONVERTER_ORDER.index(c.converter)):
        remember_parameters(
            model, f"convert_model applied {config.converter!r} (which replaces modules)"
        )
        reports.append(_REGISTRY[config.converter](model, config, spec=spec))
        record_converter(model, config.converter)
    return reports


def checkpoint_state(model: nn.Module) -> dict[str, Any]:
    """The weights a checkpoint of `model` holds: with adapters, only the parameters that train
    (the adapters, and e.g. a reward head): the frozen base is rebuilt from where the run
    started, a QLoRA base's NF4 tensors are not saved (and `torch.load(weights_only=True)` could
    not read them), and a LoRA checkpoint stays small; otherwise the full state dict."""
    from posttrain.models.lora import has_adapters

    if not has_adapters(model):
        return model.state_dict()
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_checkpoint_state(model: nn.Module, state: dict[str, Any]) -> None:
    """Load what `checkpoint_state` returned into `model` (converted the same way first).

    Raises:
        ValueError: if `state` holds only trained parameters but `model` has no adapters, or
            names that `model` lacks, or misses one of its trained parameters.
    """
    from posttrain.models.lora import has_adapters

    if not has_adapters(model):
        model.load_state_dict(state)
        return
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(state) != trained:
        extra, missing = sorted(set(state) - trained), sorted(trained - set(state))
        raise ValueError(
            f"the checkpoint's trained parameters differ from this model's: "
            f"{len(missing)} missing (e.g. {missing[:2]}), {len(extra)} unexpected "
            f"(e.g. {extra[:2]}); convert the model as the run did (same adapters "
            "config) before resuming"
        )
    model.load_state_dict(state, strict=False)
