"""Finding a job's `ParallelPlan` and model spec in its config, and checking the plan against the
job before anything is submitted (`launch` calls `resolve_plan` for every cfg).

The rule, for a cfg that is a dataclass or a mapping (a dict):

* its plan is the top-level field (or key) `plan` or `parallel` (not both): a `ParallelPlan`, a
  mapping of ParallelPlan fields (`{"dp_shard": 2, "tp": 2}`, as a YAML preset gives it), or a
  section that converts itself (`to_plan()`) or has the plan's axis fields (`dp_shard`, `tp`,
  ...). None, or a plan of one rank (every axis 1, ParallelPlan's defaults), is no plan: the
  ranks of the job are plain data-parallel replicas, whatever their number;
* its model spec is the field `spec` or `model`: a `ModelSpec`, a preset name, or a section with
  a preset `name` (and `init_from` None) or a HF folder `init_from` (its config.json is read);
* `launch(..., plan=p)` puts `p` into that `plan`/`parallel` field (in a copy of the cfg) so the
  job finds it there; the field must exist, and may hold None, a one-rank plan or `p` itself.

A plan must multiply to the job's world size (nodes x tasks_per_node), fit the spec
(`ParallelPlan.validate`: tp and sp divide the head counts, pp the layers, ep the experts) and
use only the axes this version applies (`posttrain.train.sharding`). Each failure is a
ValueError that names the field as it is written in the cfg (`cfg.parallel.tp=3`) and the
allowed values.

Example:
    >>> from posttrain.train import ParallelPlan
    >>> cfg = {"parallel": {"dp_shard": 2, "tp": 2}, "model": "tiny-1m"}
    >>> print(resolve_plan(cfg, None, nodes=1, tasks_per_node=4)[1])
    ParallelPlan(dp_shard=2, tp=2)
    >>> resolve_plan(cfg, None, nodes=2, tasks_per_node=4)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: cfg['parallel']=ParallelPlan(dp_shard=2, tp=2) needs 4 ranks ... 8 ranks; ...
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where needed: `import posttrain.launch` stays free of torch
    from posttrain.models import ModelSpec
    from posttrain.train.parallel import ParallelPlan

__all__ = ["PLAN_FIELDS", "SPEC_FIELDS", "plan_of", "spec_of", "check_plan_fits", "resolve_plan"]

PLAN_FIELDS = ("plan", "parallel")
"""Top-level cfg fields (or keys) that carry a job's ParallelPlan."""
SPEC_FIELDS = ("spec", "model")
"""Top-level cfg fields (or keys) that name a job's model spec."""

_LOG = logging.getLogger(__name__)


def _plan_field_names() -> tuple[str, ...]:
    from posttrain.train.parallel import ParallelPlan

    return tuple(f.name for f in dataclasses.fields(ParallelPlan))


def _fields(cfg: Any) -> dict[str, Any] | None:
    """The top-level fields of a dataclass instance or mapping cfg (None for anything else)."""
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {
            f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if hasattr(cfg, f.name)
        }
    return None


def _get(section: Any, key: str) -> Any:
    """`section[key]` of a mapping, `section.key` of anything else (None when absent)."""
    return section.get(key) if isinstance(section, Mapping) else getattr(section, key, None)


def _where(cfg: Any, name: str) -> str:
    return f"cfg[{name!r}]" if isinstance(cfg, Mapping) else f"cfg.{name}"


def _as_plan(value: Any, where: str) -> ParallelPlan | None:
    """`value` (a ParallelPlan, a mapping of its fields, or a section) as a ParallelPlan."""
    from posttrain.train.parallel import AXES, ParallelPlan

    names = _plan_field_names()
    if value is None or isinstance(value, ParallelPlan):
        return value
    if callable(getattr(value, "to_plan", None)):
        plan = value.to_plan()
        if not isinstance(plan, ParallelPlan):
            raise ValueError(
                f"{where}.to_plan() returned a {type(plan).__name__}, not a "
                "posttrain.train.ParallelPlan"
            )
        return plan
    if isinstance(value, Mapping):
        fields = dict(value)
    elif (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and any(hasattr(value, axis) for axis in AXES)
    ):
        fields = {k: getattr(value, k) for k in names if hasattr(value, k)}
    else:
        raise ValueError(
            f"{where} holds a {type(value).__name__}; a plan is a posttrain.train."
            "ParallelPlan, a mapping of its fields, a section with to_plan(), or None"
        )
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(
            f"{where} has unknown plan field(s) {', '.join(unknown)}; allowed: {', '.join(names)}"
        )
    try:
        return ParallelPlan(**fields)
    except ValueError as e:
        raise ValueError(str(e).replace("ParallelPlan.", f"{where}.")) from None


def _plan_field(cfg: Any) -> tuple[str | None, Any]:
    """(name, value) of the cfg's plan field (None, None if it has neither `plan` nor
    `parallel`)."""
    fields = _fields(cfg)
    if fields is None:
        return None, None
    present = [name for name in PLAN_FIELDS if name in fields]
    held = [name for name in present if fields[name] is not None]
    if len(held) > 1:
        raise ValueError(
            f"{_where(cfg, held[0])} and {_where(cfg, held[1])} both hold a plan; "
            "keep one of them (the other None)"
        )
    name = held[0] if held else (present[0] if present else None)
    return name, None if name is None else fields[name]


def plan_of(cfg: Any) -> tuple[str | None, ParallelPlan | None]:
    """(where, plan): the cfg field that carries a plan (`cfg.parallel`, `cfg['plan']`; None if
    the cfg has neither field) and the plan it holds (None if none).

    Raises:
        ValueError: both `plan` and `parallel` hold something, or the field holds something that
            is not a plan (or a plan with a bad field, named as in the cfg).
    """
    name, value = _plan_field(cfg)
    if name is None:
        return None, None
    where = _where(cfg, name)
    return where, _as_plan(value, where)


def spec_of(cfg: Any) -> tuple[str | None, ModelSpec | None]:
    """(where, spec): the cfg field that names the model (`cfg.model.name='tiny-1m'`) and its
    ModelSpec; (None, None) when the cfg names none that can be read without building it (an
    unknown preset, a folder without config.json: the job's own checks report those)."""
    from posttrain.models import PRESETS, ModelSpec, spec_from_hf_config

    fields = _fields(cfg)
    if fields is None:
        return None, None
    for name in SPEC_FIELDS:
        value = fields.get(name)
        where = _where(cfg, name)
        if isinstance(value, ModelSpec):
            return where, value
        if isinstance(value, str) and value in PRESETS:
            return f"{where}={value!r}", PRESETS[value]
        init_from = _get(value, "init_from")
        if isinstance(init_from, (str, Path)):
            path = Path(init_from).expanduser() / "config.json"
            try:
                return f"{where}.init_from={str(init_from)!r}", spec_from_hf_config(
                    json.loads(path.read_text())
                )
            except (OSError, ValueError):
                continue
        preset = _get(value, "name")
        if isinstance(preset, str) and preset in PRESETS:
            return f"{where}.name={preset!r}", PRESETS[preset]
    return None, None


def _fitting_dp_shard(plan: ParallelPlan, world_size: int) -> str:
    """A hint: the dp_shard that would make `plan` multiply to `world_size`, if there is one."""
    others = plan.world_size // plan.dp_shard
    if world_size % others == 0:
        return f" (e.g. dp_shard={world_size // others} with the other axes as they are)"
    return ""


def check_plan_fits(
    plan: ParallelPlan,
    where: str,
    *,
    nodes: int,
    tasks_per_node: int,
    spec: ModelSpec | None = None,
    spec_where: str | None = None,
) -> None:
    """Raise ValueError unless `plan` (found at `where`) fits a job of `nodes` x `tasks_per_node`
    ranks and the model `spec` (named at `spec_where`), naming the field and allowed values.
    A plan at its defaults is no plan and fits any job (`ParallelPlan.is_default`, the rule a
    recipe uses too); any other plan, one of one rank included, needs a job of exactly its
    world size. Logs a warning when tensor- or
    sequence-parallel groups would span nodes (they communicate in every layer)."""
    world_size = nodes * tasks_per_node
    if plan.is_default:
        return
    if plan.world_size != world_size:
        raise ValueError(
            f"{where}={plan} needs {plan.world_size} ranks (dp_replicate x dp_shard x tp x sp x pp "
            f"x ep), but the job has nodes={nodes} x tasks_per_node={tasks_per_node} = "
            f"{world_size} ranks; the axes must multiply to {world_size}"
            f"{_fitting_dp_shard(plan, world_size)}, or launch nodes x tasks_per_node = "
            f"{plan.world_size}"
        )
    try:
        plan.validate(spec=spec)
    except ValueError as e:
        model = f" ({spec_where})" if spec_where else ""
        raise ValueError(
            str(e)
            .replace("ParallelPlan.", f"{where}.")
            .replace("of the model", f"of the model{model}")
        ) from None
    inner = plan.tp * plan.sp
    if nodes > 1 and inner > 1 and tasks_per_node % inner:
        _LOG.warning(
            "%s=%s: tp x sp = %d does not divide tasks_per_node=%d, so some tensor/"
            "sequence-parallel groups span nodes (slow: they communicate in every "
            "layer)",
            where,
            plan,
            inner,
            tasks_per_node,
        )


def _with_plan(cfg: Any, where: str, name: str, current: Any, plan: ParallelPlan) -> Any:
    """A copy of `cfg` whose field `name` holds `plan`, in the form the field held before."""
    from posttrain.train.parallel import ParallelPlan

    if current is None or isinstance(current, ParallelPlan):
        value: Any = plan
    elif isinstance(current, Mapping):
        value = plan.to_dict()
    elif dataclasses.is_dataclass(current) and not isinstance(current, type):
        names = {f.name for f in dataclasses.fields(current)}
        value = dataclasses.replace(
            current, **{k: v for k, v in plan.to_dict().items() if k in names}
        )
    else:
        raise ValueError(
            f"plan= cannot be written into {where} (a {type(current).__name__}); "
            f"put the plan into the cfg yourself"
        )
    if _as_plan(value, where) != plan:
        raise ValueError(
            f"plan={plan} cannot be expressed in {where} (a "
            f"{type(current).__name__} without all of the plan's fields); put the "
            "plan into the cfg yourself"
        )
    if isinstance(cfg, Mapping):
        return {**cfg, name: value}
    return dataclasses.replace(cfg, **{name: value})


def check_plan_memory(
    cfg: Any, plan: ParallelPlan | None, *, executor: str, tasks_per_node: int
) -> None:
    """Refuse, before submitting, a plan whose memory floor cannot fit this machine: the
    parameters, gradients and AdamW state one rank holds (`plan_memory` at one token, so any
    real batch needs more) against an accelerator's memory, or this host's available RAM shared
    by its `tasks_per_node` ranks. Only for jobs that run here (executor "local" or "debug");
    a Slurm job's devices are the trainers' to check when it starts.

    Raises:
        ValueError: naming the dominant term and the plan axis that would lower it.
    """
    if plan is None or executor not in ("local", "debug"):
        return
    spec_where, spec = spec_of(cfg)
    if spec is None:
        return
    import torch

    from posttrain.train.memory_plan import MemoryBatch, device_memory_bytes
    from posttrain.train.memory_plan import check_plan_fits as fits

    device = device_memory_bytes()
    if not torch.cuda.is_available():
        device //= tasks_per_node
    try:
        fits(spec, plan, MemoryBatch(micro_batch_size=1, seq_len=1), device_bytes=device)
    except ValueError as e:
        raise ValueError(
            f"{e} (the model {spec_where}, at a batch of one token: the floor of any run)"
        ) from None


def resolve_plan(
    cfg: Any, plan: ParallelPlan | None, *, nodes: int, tasks_per_node: int
) -> tuple[Any, ParallelPlan | None]:
    """(cfg, plan) for one job: `cfg` with `plan` written into its plan field when `plan` is
    given (else unchanged), and the job's plan (None without one), checked against the job
    (`check_plan_fits`) and the spec the cfg names.

    Raises:
        TypeError: `plan` is not a ParallelPlan.
        ValueError: the plan does not fit (see `check_plan_fits`); `plan` is given but the cfg
            has no `plan`/`parallel` field, or holds another plan there.
    """
    name, current = _plan_field(cfg)
    if name is None and plan is None:
        return cfg, None
    from posttrain.train.parallel import ParallelPlan

    where, found = plan_of(cfg)
    if plan is not None:
        if not isinstance(plan, ParallelPlan):
            raise TypeError(f"plan={plan!r}; must be a posttrain.train.ParallelPlan or None")
        if where is None or name is None:
            raise ValueError(
                f"plan={plan} needs a cfg with a {' or '.join(PLAN_FIELDS)} field (a "
                "dataclass field or dict key) to carry it to the job; got a "
                f"{type(cfg).__name__} without one"
            )
        if found is not None and not found.is_default and found != plan:
            raise ValueError(
                f"plan={plan} and {where}={found} disagree; give the plan once (plan=, or {where})"
            )
        cfg = _with_plan(cfg, where, name, current, plan)
        found, where = plan, "plan"  # errors name the keyword the plan came from
    if found is None or where is None:  # plan_of gives both or neither
        return cfg, None
    spec_where, spec = spec_of(cfg)
    check_plan_fits(
        found, where, nodes=nodes, tasks_per_node=tasks_per_node, spec=spec, spec_where=spec_where
    )
    return cfg, found
