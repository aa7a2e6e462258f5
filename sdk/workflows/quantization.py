"""The `adapters` and `quantization` sections of the recipes' configs, and the steps a recipe
takes with them: convert the trained model before its optimizer is built
(`convert_for_training`), build the optimizer over what trains (`trainable_parameters`), and
export after training (`export_adapters`: the adapter alone in PEFT's format, then the merged
model; `finish_quantized`: a QAT model converted and evaluated).

    adapters:      method none | lora | qlora, rank, alpha, dropout, modules
    quantization:  training none | fp8 | qat (fp8_recipe, qat_scheme, qat_group_size)
                   RL recipes also: rollout none | int8 ... (the sampler's copy),
                   rollout_correction none | token_tis | sequence_tis, rollout_is_threshold

The converters themselves are `posttrain.train.converters` (LoRA / QLoRA:
`posttrain.models.lora`, FP8: `posttrain.train.float8`, QAT: `posttrain.train.qat`). In the
recipes they apply to the stage the recipe is about (SFT in `sft`, DPO in `dpo`, the reward
model in `reward_model`, RL in `grpo`/`ppo`); an SFT warm start before it trains in full.

Example:
    >>> AdaptersConfig().lora() is None and QuantizationConfig().training_config() is None
    True
    >>> AdaptersConfig(method="lora", rank=4).lora().rank
    4
    >>> AdaptersConfig(method="lora", rank=0).check("Config.adapters")
    Traceback (most recent call last):
    ...
    ValueError: Config.adapters.rank=0; must be an integer >= 1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.workflows.config import choice, fail
from posttrain.workflows.stack_checks import stack_checks_deferred

if TYPE_CHECKING:  # imported where used: torchao loads only when a recipe asks for it
    from torch import nn

    from posttrain.models.conversion import ConversionReport
    from posttrain.models.lora_config import LoRAConfig
    from posttrain.train.float8 import Float8Config
    from posttrain.train.qat import QATConfig

__all__ = [
    "ADAPTER_METHODS",
    "TRAINING_QUANTIZATIONS",
    "AdaptersConfig",
    "QuantizationConfig",
    "RLQuantizationConfig",
    "check_converted_run",
    "convert_for_training",
    "trainable_parameters",
    "export_adapters",
    "finish_quantized",
]

ADAPTER_METHODS = ("none", "lora", "qlora")
TRAINING_QUANTIZATIONS = ("none", "fp8", "qat")


def _rename(error: ValueError, cls: str, at: str) -> ValueError:
    """A converter config's error (`LoRAConfig.rank=0; ...`) named by the dotted config path."""
    return ValueError(str(error).replace(f"{cls}.", f"{at}.", 1))


@dataclass(kw_only=True)
class AdaptersConfig:
    """LoRA or QLoRA adapters on the trained model (`posttrain.models.lora.LoRAConfig`): only the
    adapters train; `qlora` stores the frozen base in NF4. After training the recipe saves the
    adapter alone (`adapter/`, PEFT format) and the merged model (`policy/`)."""

    method: str = "none"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "output_proj"]
    )

    def lora(self) -> LoRAConfig | None:
        """The `LoRAConfig` of these settings; None for method "none"."""
        if self.method == "none":
            return None
        from posttrain.models.lora_config import LoRAConfig

        return LoRAConfig(
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            modules=tuple(self.modules),
            quantize_base=self.method == "qlora",
        )

    def check(self, at: str) -> None:
        choice(f"{at}.method", self.method, ADAPTER_METHODS)
        if (
            not isinstance(self.modules, (list, tuple))
            or not self.modules
            or not all(isinstance(m, str) for m in self.modules)
        ):
            raise fail(f"{at}.modules", self.modules, "a non-empty list of module names")
        if stack_checks_deferred():  # LoRAConfig checks the numbers (torch)
            return
        try:
            (self if self.method != "none" else dataclasses.replace(self, method="lora")).lora()
        except ValueError as e:
            raise _rename(e, "LoRAConfig", at) from None


@dataclass(kw_only=True)
class QuantizationConfig:
    """Quantised training of the trained model: `fp8` (torchao float8 linears, recipe
    `fp8_recipe`: tensorwise | rowwise) or `qat` (quantisation-aware training, scheme
    `qat_scheme` with `qat_group_size`; the recipe evaluates the fake-quantised model and the
    converted one)."""

    training: str = "none"
    fp8_recipe: str = "tensorwise"
    qat_scheme: str = "int8da_int4w"
    qat_group_size: int = 32

    def training_config(self, training: str | None = None) -> Float8Config | QATConfig | None:
        """The converter config (`Float8Config` or `QATConfig`) of `training` (default: the
        chosen one); None for "none"."""
        training = self.training if training is None else training
        if training == "fp8":
            from posttrain.train.float8 import Float8Config

            return Float8Config(recipe=self.fp8_recipe)
        if training == "qat":
            from posttrain.train.qat import QATConfig

            return QATConfig(scheme=self.qat_scheme, group_size=self.qat_group_size)
        return None

    def check(self, at: str) -> None:
        """Every field, those of a `training` not chosen too (a bad value is an error wherever
        it is set, not when the section is switched on later)."""
        choice(f"{at}.training", self.training, TRAINING_QUANTIZATIONS)
        if stack_checks_deferred():  # the converters' configs check the fields (torch)
            return
        fields = {
            "fp8": {"recipe": "fp8_recipe"},
            "qat": {"scheme": "qat_scheme", "group_size": "qat_group_size"},
        }
        for training, names in fields.items():
            try:
                self.training_config(training)
            except (TypeError, ValueError) as e:
                message = str(e)
                for name, ours in names.items():
                    for cls in ("Float8Config", "QATConfig"):
                        message = message.replace(f"{cls}.{name}=", f"{at}.{ours}=")
                raise ValueError(message) from None


@dataclass(kw_only=True)
class RLQuantizationConfig(QuantizationConfig):
    """`QuantizationConfig` plus the RL sampler: `rollout` samples from a quantised copy of the
    policy (`posttrain.rl.lowbit_rollout`; the trainer logs the train/infer mismatch), and
    `rollout_correction` applies truncated importance sampling by name, weights truncated at
    `rollout_is_threshold` (`posttrain.rl.config.RLAlgorithm`)."""

    rollout: str = "none"
    rollout_correction: str = "none"
    rollout_is_threshold: float = 2.0

    def check(self, at: str) -> None:
        super().check(at)
        if not stack_checks_deferred():  # the names are the RL stack's (torch)
            from posttrain.rl.config import ROLLOUT_CORRECTIONS

            if self.rollout != "none":
                from posttrain.rl.lowbit_rollout import ROLLOUT_QUANTIZATIONS

                choice(f"{at}.rollout", self.rollout, ("none", *ROLLOUT_QUANTIZATIONS))
            choice(f"{at}.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
        t = self.rollout_is_threshold
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and 1 <= t < float("inf")):
            raise fail(
                f"{at}.rollout_is_threshold",
                t,
                "a finite number >= 1 (weights are truncated at it)",
            )

    def rollout_quantization(self) -> str | None:
        """The `RLTrainer(rollout_quantization=...)` name; None for "none"."""
        return None if self.rollout == "none" else self.rollout


def _configs(cfg: Any) -> list[Any]:
    adapters = getattr(cfg, "adapters", None)
    quantization = getattr(cfg, "quantization", None)
    return [
        c
        for c in (
            adapters.lora() if adapters is not None else None,
            quantization.training_config() if quantization is not None else None,
        )
        if c is not None
    ]


def check_converted_run(
    cfg: Any, at: str, *, training: Sequence[str] = TRAINING_QUANTIZATIONS
) -> None:
    """What spans sections: `quantization.training` is one of `training` (the recipe's), the
    converters run on one process (a `parallel` plan with adapters or quantisation is refused
    here; the SDK's converters compose with FSDP2, the recipes' export of a split converted
    model does not exist yet), and LoRA with QAT or FP8 with QLoRA are refused by the
    converters' rules (`posttrain.train.converters`)."""
    quantization = getattr(cfg, "quantization", None)
    if quantization is not None and quantization.training not in training:
        raise fail(
            f"{at}.quantization.training",
            quantization.training,
            f"one of {', '.join(training)} in this recipe",
        )
    if stack_checks_deferred():  # the converters' configs (torch)
        return
    configs = _configs(cfg)
    if not configs:
        return
    from posttrain.workflows.parallel import plan_of

    plan = plan_of(cfg)
    if plan is not None:
        used = (
            "adapters.method"
            if getattr(cfg.adapters, "method", "none") != "none"
            else "quantization.training"
        )
        raise ValueError(
            f"{at}.parallel={plan} with {at}.{used} set: a recipe runs "
            "adapters and quantised training in one process (set the parallel "
            "section to its defaults, or use posttrain.train.converters with "
            "plan.parallelize in your own loop)"
        )
    names = {c.converter for c in configs}
    from posttrain.train.converters import EXCLUSIVE

    for pair, why in EXCLUSIVE:
        if pair <= names:
            raise ValueError(
                f"{at}.adapters.method={cfg.adapters.method!r} with "
                f"{at}.quantization.training={cfg.quantization.training!r}: {why}"
            )


def convert_for_training(
    model: nn.Module, cfg: Any, *, spec: Any, verbose: bool = True
) -> list[ConversionReport]:
    """Apply the config's adapters and training quantisation to `model` (in place, before the
    optimizer and any plan; `posttrain.train.converters.convert_model`); prints each report
    when `verbose`. Returns the reports (empty when both sections are at their defaults)."""
    from posttrain.train.converters import convert_model

    reports = convert_model(model, _configs(cfg), spec=spec)
    if verbose:
        for report in reports:
            print(report)
    return reports


def trainable_parameters(*modules: nn.Module | None) -> Iterator[nn.Parameter]:
    """The parameters of `modules` that require grad (adapters only on a LoRA model), each once:
    what the recipe's optimizer is built over."""
    seen: set[int] = set()
    for module in modules:
        for p in module.parameters() if module is not None else ():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                yield p


def export_adapters(model: nn.Module, cfg: Any, out: Path | None, *, spec: Any) -> dict[str, Any]:
    """After training (rank 0): with adapters, save them alone in PEFT's format under
    `out/adapter/` (`posttrain.models.lora.save_peft_adapter`; skipped when `out` is None) and
    merge them into the base (`merge_lora`: fp32 accumulation, one cast to the base dtype), so
    `model` is a plain model the recipe saves. Returns what the results record (empty without
    adapters)."""
    if getattr(cfg, "adapters", None) is None or cfg.adapters.method == "none":
        return {}
    from posttrain.models.lora import adapter_state_dict, merge_lora, save_peft_adapter

    n = sum(t.numel() for t in adapter_state_dict(model).values())
    if out is not None:
        save_peft_adapter(model, out / "adapter", spec=spec)
    merge_lora(model)
    return {
        "adapters": {
            "method": cfg.adapters.method,
            "rank": cfg.adapters.rank,
            "alpha": cfg.adapters.alpha,
            "modules": list(cfg.adapters.modules),
            "adapter_parameters": n,
            "adapter_dir": None if out is None else "adapter",
        }
    }


def finish_quantized(
    policy: Any, cfg: Any, out: Path, evaluate_fn: Callable[[Any], Any] | None
) -> dict[str, Any]:
    """After QAT training (rank 0): convert a copy of the fake-quantised policy to real quantised
    weights (`posttrain.train.qat.convert_qat`), evaluate it with `evaluate_fn(policy) ->
    EvalResult` (its table lands in `out/eval_after_converted.csv`). `policy.model` stays
    fake-quantised; its state dict has the plain model's keys, so the recipe saves the trained
    full-precision weights as a plain HF folder (a converted model does not save: quantise again
    after loading). Returns what the results record (empty without QAT)."""
    quantization = getattr(cfg, "quantization", None)
    if quantization is None or quantization.training != "qat":
        return {}
    import copy

    from posttrain.train.qat import convert_qat
    from posttrain.workflows.reports import write_table

    config = quantization.training_config()
    converted = copy.deepcopy(policy)
    report = convert_qat(converted.model, config)
    results: dict[str, Any] = {
        "qat": {"scheme": config.scheme, "group_size": config.group_size, "converted": str(report)}
    }
    if evaluate_fn is not None:
        after = evaluate_fn(converted)
        write_table(after.table, out / "eval_after_converted.csv")
        results["after_converted"] = after.as_dict()
    return results  # policy.model stays fake-quantised: its state dict is the plain model's
