"""The `parallel` section of the recipes' configs (`ParallelConfig`: the fields of a
`posttrain.train.ParallelPlan`) and its checks: against the model when the config is validated
(`check_parallel`, with the global batches that must split over the data-parallel ranks), and
against the job's world size when a run starts (`check_world_size`, from `start_run`).

Example:
    >>> ParallelConfig().plan() is None            # the default: no plan
    True
    >>> str(ParallelConfig(dp_shard=2, tp=2).plan())
    'ParallelPlan(dp_shard=2, tp=2)'
    >>> sorted(f.name for f in dataclasses.fields(ParallelConfig)) == sorted(
    ...     f.name for f in dataclasses.fields(ParallelPlan))   # the same fields
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.models.specs import PRESETS
from posttrain.train.parallel import ParallelPlan
from posttrain.workflows.config import ROOT, ModelConfig, fail

__all__ = ["ParallelConfig", "model_spec", "check_parallel", "check_world_size"]


@dataclass(kw_only=True)
class ParallelConfig:
    """How the recipe's models are split over the ranks of a job: the fields of
    `posttrain.train.ParallelPlan` (dp_replicate x dp_shard x tp x sp x pp x ep = the job's
    world size; FSDP2 mixed precision, CPU offload, activation checkpointing). Every field at
    its default means no plan: the recipe runs as without this section (one process, or plain
    data-parallel replicas for SFT under a process group). With a plan, the recipe applies it
    to every model it trains (and to the frozen ones it scores with) before building the
    optimizers, passes it to the trainers, and checks it against the model and the world size
    before any work (`check_plan_fits`)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    sp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"
    n_microbatches: int | None = None
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False

    def plan(self) -> ParallelPlan | None:
        """The `ParallelPlan` of these fields; None when every field is at its default."""
        fields = dataclasses.asdict(self)
        if fields == dataclasses.asdict(ParallelConfig()):
            return None
        return ParallelPlan(**fields)

    def check(self, at: str) -> None:
        try:  # every field, also where it equals its default (True == 1 is not a degree)
            ParallelPlan(**dataclasses.asdict(self))
        except ValueError as e:  # "ParallelPlan.tp=0; ..." -> "Config.parallel.tp=0; ..."
            raise ValueError(str(e).replace("ParallelPlan.", f"{at}.")) from None


def model_spec(model: ModelConfig) -> Any:
    """The `ModelSpec` of a recipe's model section: its preset's, or the HF folder's (None if
    the folder has no readable config.json)."""
    if model.init_from is None:
        return PRESETS[model.name]
    import json

    from posttrain.models.hf_config import spec_from_hf_config

    path = Path(model.init_from) / "config.json"
    if not path.is_file():
        return None
    return spec_from_hf_config(json.loads(path.read_text()))


def check_parallel(cfg: Any, at: str, *, divisible: Iterable[str] = (),
                   unsupported: Iterable[str] = ()) -> None:
    """A recipe's `parallel` plan fits its model (`ParallelPlan.validate(spec=...)`: heads,
    widths, layers, experts), each dotted field in `divisible` (a global batch: sequences,
    pairs, prompts) is divisible by the plan's data-parallel size, and the axes in
    `unsupported` (what one of the recipe's stages cannot run under yet) are 1. Nothing to
    check without a plan. The world size is checked when the run starts (`check_world_size`)."""
    plan = cfg.parallel.plan()
    if plan is None:
        return
    for axis in unsupported:
        if getattr(plan, axis) > 1:
            raise fail(f"{at}.parallel.{axis}", getattr(plan, axis),
                       "1: this recipe does not support it yet")
    spec = model_spec(cfg.model)
    try:
        plan.validate(spec=spec)
    except ValueError as e:
        raise ValueError(f"{at}.parallel does not fit {at}.model: "
                         f"{str(e).replace('ParallelPlan.', f'{at}.parallel.')}") from None
    for name in divisible:
        value: Any = cfg
        for part in name.split("."):
            value = getattr(value, part)
        if value % plan.data_parallel_size:
            raise fail(f"{at}.{name}", value, f"divisible by the data-parallel size "
                       f"{plan.data_parallel_size} of {at}.parallel ({plan}): it is the global "
                       "batch of all data-parallel ranks together")


def check_world_size(cfg: Any, at: str = ROOT) -> None:
    """Before a run does any work: a recipe config with a `parallel` plan runs under an
    initialised torch.distributed process group of exactly the plan's world size.

    Raises:
        ValueError: naming `Config.parallel`, the plan's world size and the job's.
    """
    section = getattr(cfg, "parallel", None)
    plan = section.plan() if section is not None else None
    if plan is None:
        return
    from posttrain.core.distributed import rank_and_world_size
    import torch.distributed as dist

    world = rank_and_world_size()[1]
    if plan.world_size == 1 and world == 1:
        return  # a plan of one rank (activation checkpointing) needs no process group
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{at}.parallel asks for {plan} on {plan.world_size} ranks, but no "
                         "torch.distributed process group is initialised: run the recipe as a "
                         f"job of {plan.world_size} tasks (posttrain.launch) or under torchrun "
                         f"--nproc-per-node {plan.world_size}, or leave {at}.parallel at its "
                         "defaults")
    try:
        plan.validate(world_size=world)
    except ValueError as e:
        raise ValueError(f"{at}.parallel: {e}") from None
