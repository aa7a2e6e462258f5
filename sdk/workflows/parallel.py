"""The `parallel` section of the recipes' configs: a `posttrain.train.ParallelPlan` itself
(the config machinery builds it from dotted keys, `parallel.dp_shard=2`, and names a bad field
`Config.parallel.tp`), the one rule that a plan with every field at its default is no plan
(`plan_of`), and its checks: against the model when the config is validated
(`check_parallel`, with the global batches that must split over the data-parallel ranks), and
against the job's world size and the model in one call when a run starts (`check_world_size`,
from `RecipeRun.start`), which returns the `CheckedPlan` the run hands to `parallelize`.

A recipe with a plan applies it to every model it trains (and to the frozen ones it scores
with) before building the optimizers, passes it to the trainers, and checks it against the
model and the world size before any work. Every field at its default means no plan: the recipe
runs as without the section (one process, or plain data-parallel replicas for SFT under a
process group).

`ParallelConfig`, the section's former class (a copy of the plan's fields), is a deprecated
alias of `ParallelPlan`.

Example:
    >>> from dataclasses import dataclass, field
    >>> @dataclass(kw_only=True)
    ... class Config:
    ...     parallel: ParallelPlan = field(default_factory=ParallelPlan)
    >>> plan_of(Config()) is None                   # the default: no plan
    True
    >>> str(plan_of(Config(parallel=ParallelPlan(dp_shard=2, tp=2))))
    'ParallelPlan(dp_shard=2, tp=2)'
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.train.parallel import ParallelPlan
from posttrain.workflows.config import ROOT, ModelConfig, fail
from posttrain.workflows.stack_checks import stack_checks_deferred

if TYPE_CHECKING:  # torch loads when a plan is checked against its model or job
    from posttrain.train.plan_value import CheckedPlan

__all__ = ["ParallelPlan", "plan_of", "model_spec", "check_parallel", "check_world_size"]


def plan_of(cfg: Any) -> ParallelPlan | None:
    """The `parallel` plan of a recipe config; None when it has no `parallel` section or every
    field of it is at its default (`ParallelPlan.is_default`, the rule `posttrain.launch` uses
    too: the recipes run as without the section then)."""
    plan = getattr(cfg, "parallel", None)
    return None if plan is None or plan.is_default else plan


def __getattr__(name: str) -> Any:
    if name == "ParallelConfig":
        warnings.warn(
            "posttrain.workflows.ParallelConfig is deprecated: a recipe's parallel "
            "section is a posttrain.train.ParallelPlan (the same fields)",
            DeprecationWarning,
            stacklevel=2,
        )
        return ParallelPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_spec(model: ModelConfig) -> Any:
    """The `ModelSpec` of a recipe's model section: its preset's, or the HF folder's (None if
    the folder has no readable config.json)."""
    if model.init_from is None:
        from posttrain.models.specs import PRESETS

        return PRESETS[model.name]
    import json

    from posttrain.models.hf_config import spec_from_hf_config

    path = Path(model.init_from) / "config.json"
    if not path.is_file():
        return None
    return spec_from_hf_config(json.loads(path.read_text()))


def check_parallel(
    cfg: Any, at: str, *, divisible: Iterable[str] = (), unsupported: Iterable[str] = ()
) -> None:
    """A recipe's `parallel` plan fits its model (`ParallelPlan.validate(spec=...)`: heads,
    widths, layers, experts), each dotted field in `divisible` (a global batch: sequences,
    pairs, prompts) is divisible by the plan's data-parallel size, and the axes in
    `unsupported` (what one of the recipe's stages cannot run under yet) are 1, and no
    `loss_chunk_tokens` of the `optim` or `sft` section is set under sp or pp. Nothing to
    check without a plan. The world size is checked when the run starts (`check_world_size`)."""
    plan = plan_of(cfg)
    if plan is None:
        return
    for axis in unsupported:
        if getattr(plan, axis) > 1:
            raise fail(
                f"{at}.parallel.{axis}",
                getattr(plan, axis),
                "1: this recipe does not support it yet",
            )
    for section in ("optim", "sft"):  # the chunked loss needs each row's whole hidden states
        chunk = getattr(getattr(cfg, section, None), "loss_chunk_tokens", None)
        for axis in ("sp", "pp"):
            if chunk is not None and getattr(plan, axis) > 1:
                raise fail(
                    f"{at}.{section}.loss_chunk_tokens",
                    chunk,
                    f"None with {at}.parallel.{axis}={getattr(plan, axis)}: a sequence-parallel "
                    "rank's head sees a slice of every row and a pipeline's loss runs on the "
                    "last stage's logits",
                )
    if not stack_checks_deferred():  # the model's spec and the plan's rules import torch
        spec = model_spec(cfg.model)
        try:
            plan.validate(spec=spec)
        except ValueError as e:
            raise ValueError(
                f"{at}.parallel does not fit {at}.model: "
                f"{str(e).replace('ParallelPlan.', f'{at}.parallel.')}"
            ) from None
    for name in divisible:
        value: Any = cfg
        for part in name.split("."):
            value = getattr(value, part)
        if value % plan.data_parallel_size:
            raise fail(
                f"{at}.{name}",
                value,
                f"divisible by the data-parallel size "
                f"{plan.data_parallel_size} of {at}.parallel ({plan}): it is the global "
                "batch of all data-parallel ranks together",
            )


def check_world_size(cfg: Any, at: str = ROOT) -> CheckedPlan | None:
    """The run-start check: a recipe config with a `parallel` plan runs under an initialised
    torch.distributed process group of exactly the plan's world size (a plan of one rank also
    in a process without one), and the plan fits the config's model; both in one call
    (`posttrain.train.plan_checks.check_plan`). Returns the `CheckedPlan` that
    `posttrain.train.parallelize` takes without checking again (`RecipeRun.parallelize`), or
    None without a plan.

    Raises:
        ValueError: naming `Config.parallel`, the plan's world size and the job's (or the
            field that does not fit the model).
    """
    plan = plan_of(cfg)
    if plan is None:
        return None
    import torch.distributed as dist

    from posttrain.core.distributed import rank_and_world_size
    from posttrain.train.plan_checks import check_plan

    world = rank_and_world_size()[1]
    one_rank = plan.world_size == 1 and world == 1  # needs no process group
    if not one_rank and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"{at}.parallel asks for {plan} on {plan.world_size} ranks, but no "
            "torch.distributed process group is initialised: run the recipe as a "
            f"job of {plan.world_size} tasks (posttrain.launch) or under torchrun "
            f"--nproc-per-node {plan.world_size}, or leave {at}.parallel at its "
            "defaults"
        )
    try:
        return check_plan(plan, world_size=world, spec=model_spec(cfg.model))
    except ValueError as e:
        raise ValueError(
            f"{at}.parallel: {str(e).replace('ParallelPlan.', f'{at}.parallel.')}"
        ) from None
