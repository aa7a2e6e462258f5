"""FP8 training: the `nn.Linear` layers of a built model compute their matmuls in float8
(torchao's `Float8Linear`, `torchao.float8.convert_to_float8_training`), chosen by a module
filter that says why each other layer stays in high precision.

What float8 training does (torchao 0.15, `torchao/float8/README.md`): the weights, optimizer
state and every other operation stay in the model's dtype; each converted linear casts its input
and weight to float8_e4m3fn (and the output gradient, in backward, to float8_e5m2 for
"tensorwise", e4m3fn for "rowwise") with a dynamic scale `finfo(float8).max / amax(|x|)`, and
multiplies with `torch._scaled_mm`, accumulating in high precision. Recipes:

    tensorwise  one scale per tensor (amax over the whole tensor); FSDP2 can all-gather the
                weights already cast to float8 (half the bytes of bf16, a quarter of fp32)
    rowwise     one scale per row of each operand (amax along the reduction dimension), scales
                rounded down to powers of 2; more accurate for outlier-heavy activations;
                torchao has no float8 all-gather for it

Order with a parallel plan (as torchtitan applies `model.converters = ["float8"]`): build the
model, `apply_float8`, then `ParallelPlan.apply`, then build the optimizer. A model that already
has a plan is refused (the plan replaced its parameters by DTensors the conversion would miss).

Measured on CPU with gloo (torch 2.13, torchao 0.15): `torch._scaled_mm` runs on CPU, ~3x slower
than fp32 at tiny size. Both recipes train under `ParallelPlan(dp_shard=2)` (with and without
float8 all-gather), `ParallelPlan(tp=2)` (torchtune's Llama TP plan: the amax of a sharded
DTensor is reduced over its shards, so the first tensorwise loss equals one process's to float
rounding) and `dp_shard=2 x tp=2` (there, with float8 all-gather, FSDP2's pre-all-gather reduces
a weight's amax over the FSDP ranks only, so each tp shard gets its own weight scale: a slightly
different, equally valid scaling). Under data parallelism each rank scales its own micro-batch
(the tensorwise activation amax is a per-rank statistic), so a dp run is not bitwise equal to
one process on the same global batch (tests/train/test_float8.py states the bound). `apply_float8`
refuses no plan; which axes a model converted through `posttrain.train.converters.convert_model`
may use is `posttrain.models.conversion.PLAN_AXES["float8"]`, checked by `parallelize`.

`torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model)` is an optional speed-up of the
float8 all-gather (one all-reduce for the amaxes of all weights instead of one per weight). It
would go right after every `optimizer.step()` (the engine's update), because the scale it stores
on each weight is reused by every later all-gather until it is computed again: a stale scale
after a skipped call would silently cast new weights with old scales. It is not used: each
all-gather computes its weight's scale itself (`reduce_amax=True`), which is always current.

Example:
    >>> from posttrain.models import build_model, get_preset
    >>> model = build_model(get_preset("tiny-1m"), seed=0)
    >>> report = apply_float8(model, Float8Config(recipe="tensorwise"))
    >>> len(report.converted), report.skipped["output"][:30]
    (28, 'tied to tok_embeddings.weight ')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from posttrain.models.conversion import ConversionReport
from posttrain.train.sharding import parallelized

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

    from posttrain.models.specs import ModelSpec

__all__ = ["FLOAT8_RECIPES", "Float8Config", "float8_module_filter", "apply_float8"]

FLOAT8_RECIPES = ("tensorwise", "rowwise")
"""Recipes of `torchao.float8.Float8LinearConfig.from_recipe_name` that posttrain offers."""

_MULTIPLE = 16  # torch._scaled_mm needs both matrix dimensions of the weight to be multiples


@dataclass(kw_only=True, frozen=True)
class Float8Config:
    """Which float8 recipe, which layers to keep in high precision, and FSDP2's all-gather.

    Args:
        recipe: "tensorwise" or "rowwise" (see the module docstring).
        skip_modules: modules kept in high precision, matched against the last component of a
            module's name ("output", "w2") or its full name ("layers.0.mlp.w2"). The default
            keeps the output projection (the logits are sensitive to rounding; torchtitan's
            float8 converter skips it by default, `filter_fqns = ["output"]`). Every entry must
            name some module.
        fsdp_float8_all_gather: with "tensorwise", mark the converted weights so FSDP2
            all-gathers them already cast to float8 (torchao `enable_fsdp_float8_all_gather`);
            without FSDP2 it changes nothing. torchao supports it for "tensorwise" only: with
            "rowwise" the flag has no effect and the weights are gathered in their own dtype
            (`float8_all_gather` says which applies).

    Raises:
        ValueError: naming the field, its value and the allowed values, for an unknown recipe,
            a skip_modules that is not a tuple/list of non-empty strings, or a non-bool flag.
    """

    recipe: str = "tensorwise"
    skip_modules: tuple[str, ...] = ("output",)
    fsdp_float8_all_gather: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, str) or self.recipe not in FLOAT8_RECIPES:
            raise ValueError(
                f"Float8Config.recipe={self.recipe!r}; allowed: {', '.join(FLOAT8_RECIPES)}"
            )
        skip = self.skip_modules
        if not isinstance(skip, (tuple, list)) or not all(isinstance(s, str) and s for s in skip):
            raise ValueError(
                f"Float8Config.skip_modules={skip!r}; must be a tuple of module "
                "names (last name component such as 'output', or a full name such "
                "as 'layers.0.mlp.w2'), e.g. ('output',) or ()"
            )
        object.__setattr__(self, "skip_modules", tuple(skip))
        if not isinstance(self.fsdp_float8_all_gather, bool):
            raise ValueError(
                f"Float8Config.fsdp_float8_all_gather="
                f"{self.fsdp_float8_all_gather!r}; allowed: True, False"
            )

    @property
    def converter(self) -> str:
        """The converter's registered name, as in `ConversionReport.name`: "float8"."""
        return "float8"

    @property
    def float8_all_gather(self) -> bool:
        """Whether FSDP2 will all-gather the converted weights in float8 (tensorwise and the
        flag set); False for rowwise, which torchao cannot gather in float8."""
        return self.recipe == "tensorwise" and self.fsdp_float8_all_gather

    def torchao_config(self) -> Float8LinearConfig:
        """The `torchao.float8.Float8LinearConfig` of this recipe (`from_recipe_name`), with
        `enable_fsdp_float8_all_gather` set as `float8_all_gather` says."""
        import dataclasses

        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        if self.float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        return config


def _matches(name: str, entry: str) -> bool:
    return name == entry or name.rsplit(".", 1)[-1] == entry


def float8_module_filter(model: nn.Module, config: Float8Config) -> tuple[set[str], dict[str, str]]:
    """Which `nn.Linear` modules of `model` `apply_float8` converts, and why each other one
    (or each module named in `config.skip_modules`) stays in high precision.

    Rules, in order, for every `nn.Linear` (by its name in `model.named_modules()`):
        0. inside a LoRA adapter module (torchtune's `AdapterModule` protocol, a module with
           `adapter_params`: e.g. `LoRALinear.lora_a` / `lora_b`): skipped, the adapters
           train in high precision;
        1. named in `config.skip_modules` (last name component or full name): skipped;
        2. in_features or out_features not a multiple of 16: skipped, because
           `torch._scaled_mm` needs both dimensions of the weight to be multiples of 16;
        3. otherwise converted.
    A skip_modules entry that names something other than an nn.Linear is reported with what it
    is (an nn.Embedding; the output projection of a tied-embedding torchtune model, which is a
    `TiedLinear` reusing tok_embeddings.weight and not a module).

    Args:
        model: a built model (e.g. `posttrain.models.build_model(spec)`), before any plan.
        config: a `Float8Config`.

    Returns:
        (names of the modules to convert, {module name: reason it is skipped}).

    Raises:
        TypeError: if `model` is not an nn.Module or `config` not a Float8Config.
        ValueError: for a skip_modules entry that names no module of `model` (listing the
            last name components of its nn.Linear modules), or a model whose linears are
            already float8 (`apply_float8` ran on it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module; got {type(model).__name__}")
    if not isinstance(config, Float8Config):
        raise TypeError(
            f"config must be a posttrain.train.float8.Float8Config; got {type(config).__name__}"
        )
    from torchao.float8.float8_linear import Float8Linear

    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    if converted:
        raise ValueError(
            f"the model already holds {len(converted)} Float8Linear module(s) "
            f"(e.g. {converted[0]}): apply_float8 runs once, on a model built in "
            "high precision"
        )
    convert: set[str] = set()
    skipped: dict[str, str] = {}
    used: set[str] = set()
    linear_names: list[str] = []
    adapters = [n for n, m in model.named_modules() if n and hasattr(m, "adapter_params")]
    for name, module in model.named_modules():
        hits = [e for e in config.skip_modules if name and _matches(name, e)]
        used.update(hits)
        holder = next((a for a in adapters if name.startswith(a + ".")), None)
        if isinstance(module, nn.Linear):
            linear_names.append(name)
            n_in, n_out = module.in_features, module.out_features
            if holder is not None:
                skipped[name] = (
                    f"part of the LoRA adapter module {holder}: adapter weights "
                    "train in high precision"
                )
            elif hits:
                what = "the output projection" if _matches(name, "output") else "this module"
                skipped[name] = (
                    f"named in Float8Config.skip_modules ({hits[0]!r}): {what} "
                    "is kept in high precision"
                )
            elif n_in % _MULTIPLE or n_out % _MULTIPLE:
                skipped[name] = (
                    f"in_features={n_in}, out_features={n_out}: both must be "
                    f"multiples of {_MULTIPLE} for torch._scaled_mm"
                )
            else:
                convert.add(name)
        elif hits and isinstance(module, nn.Embedding):
            skipped[name] = (
                "an nn.Embedding (a table lookup, no matmul), not an nn.Linear: "
                "float8 training converts only nn.Linear; it stays in high precision"
            )
        elif hits:
            skipped[name] = (
                f"a {type(module).__name__}, not an nn.Linear: float8 training "
                "converts only nn.Linear modules"
            )
    output = getattr(model, "output", None)
    if "output" in config.skip_modules and output is not None and not isinstance(output, nn.Module):
        used.add("output")  # torchtune's TiedLinear: logits = h @ tok_embeddings.weight.T
        skipped["output"] = (
            "tied to tok_embeddings.weight (torchtune TiedLinear, not an "
            "nn.Linear): the output projection stays in high precision"
        )
    unknown = [e for e in config.skip_modules if e not in used]
    if unknown:
        short = sorted({n.rsplit(".", 1)[-1] for n in linear_names})
        raise ValueError(
            f"Float8Config.skip_modules names {unknown}, which match no module of "
            f"this {type(model).__name__}; its nn.Linear modules end in: "
            f"{', '.join(short) or '(none)'} (or give a full module name)"
        )
    return convert, skipped


def apply_float8(
    model: nn.Module, config: Float8Config, *, spec: ModelSpec | str | None = None
) -> ConversionReport:
    """Convert the linears `float8_module_filter` selects to torchao `Float8Linear`, in place.

    Uses `torchao.float8.convert_to_float8_training(model, config=config.torchao_config(),
    module_filter_fn=...)`. Apply it to a freshly built model, before `ParallelPlan.apply`
    and before building the optimizer (the parameters stay the same objects without a plan, but
    the plan replaces them). With FSDP2 (dp_shard > 1) and recipe "tensorwise" the weights are
    all-gathered in float8 (`Float8Config.fsdp_float8_all_gather`); "rowwise" gathers them in
    their own dtype (torchao has no float8 all-gather for it). The optional
    `precompute_float8_dynamic_scale_for_fsdp` is not used (see the module docstring).

    Tensor dtypes: parameters, gradients and optimizer state keep the model's dtype; only the
    matmul operands inside each converted linear are float8 (input and weight e4m3fn; output
    gradient e5m2 with tensorwise, e4m3fn with rowwise). Logits stay [B, T, V] in the model's
    dtype.

    Args:
        model: a built torchtune decoder (or any module holding nn.Linear layers; not an
            nn.Linear itself), without a parallel plan.
        config: the `Float8Config`.
        spec: the model's `ModelSpec` or preset name (optional). With experts
            (num_experts > 0) the report also names the expert weights, which are grouped
            parameters rather than nn.Linear modules and stay in high precision.

    Returns:
        A `ConversionReport` named "float8": converted module names (in model order) and the
        skipped modules with their reasons.

    Raises:
        TypeError: if `model` is not an nn.Module, is an nn.Linear itself, or `config` is not a
            Float8Config.
        ValueError: if the model already has a ParallelPlan or float8 linears, a skip_modules
            entry names nothing, the spec is not a ModelSpec, or the filter leaves nothing to
            convert (the message lists each nn.Linear considered and why it was skipped).
    """
    if isinstance(model, nn.Linear):
        raise TypeError(
            "model is a single nn.Linear; apply_float8 converts the linears inside "
            "a model (torchao would return a new module instead of converting in "
            "place)"
        )
    applied = parallelized(model) if isinstance(model, nn.Module) else None
    if applied is not None:
        raise ValueError(
            f"this model already has a ParallelPlan applied ({applied}); apply "
            "float8 first, then the ParallelPlan (which replaces the parameters "
            "by DTensors), then build the optimizer"
        )
    if isinstance(spec, str):
        from posttrain.models.specs import get_preset

        spec = get_preset(spec)
    if spec is not None and not hasattr(spec, "num_experts"):
        raise ValueError(
            f"spec={spec!r}; must be a posttrain.models.ModelSpec, a preset name, or None"
        )
    convert, skipped = float8_module_filter(model, config)
    if not convert:
        considered = "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "no nn.Linear at all"
        raise ValueError(
            f"float8: the module filter leaves no nn.Linear to convert in this "
            f"{type(model).__name__} (recipe {config.recipe!r}, skip_modules="
            f"{config.skip_modules}). Considered: {considered}"
        )
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    convert_to_float8_training(
        model, config=config.torchao_config(), module_filter_fn=lambda module, fqn: fqn in convert
    )
    done = tuple(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert set(done) == convert, sorted(set(done) ^ convert)
    if spec is not None and spec.num_experts:
        skipped["experts"] = (
            f"{spec.num_experts} experts per MoE layer are grouped "
            "parameters (one [E, out, in] tensor per projection), not "
            "nn.Linear modules: they stay in high precision"
        )
    return ConversionReport(name=config.converter, converted=done, skipped=skipped)
