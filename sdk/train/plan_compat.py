"""The earlier spelling of parallel plans, kept for one release with a DeprecationWarning, and how
a trainer finds its runtime.

Before `ParallelPlan.parallelize` returned a `PlanRuntime`, a plan was applied with
`model = plan.apply(model, spec=spec)` (or `apply_plan(plan, model)`), looked up with
`plan_state(model)`, and named to a trainer with `plan=plan`. These still work:
`plan.apply` parallelizes the model and records its runtime in this module's registry, a
`WeakKeyDictionary` from model to runtime that only this shim reads, so that `plan_state(model)`,
`Trainer(model, ..., plan=plan)` (or without `plan=`) and `full_state_dict(model)` find it.
The registry keeps such a model alive for the life of the process (its runtime refers to it);
the new spelling holds the runtime where the trainer holds it and has no registry:

    runtime = plan.parallelize(model, spec=spec)
    Trainer(runtime.model, optimizer, data=loader, runtime=runtime)

`resolve_runtime` is the one place a trainer turns its arguments into a `Runtime`.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from posttrain.train.runtime import LocalRuntime, PlanRuntime, Runtime
from posttrain.train.sharding import parallelize, parallelized

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from posttrain.models.specs import ModelSpec
    from posttrain.train.plan_value import PlanFields

__all__ = [
    "resolve_runtime",
    "runtime_of",
    "full_state_dict",
    "register",
    "warn_deprecated",
    "apply_plan",
    "plan_state",
    "PlanState",
    "check_plan",
    "set_gradient_sync",
    "sum_over_data_ranks",
]

_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, PlanRuntime] = weakref.WeakKeyDictionary()
"""model -> the runtime `plan.apply` made for it (the deprecated spelling only)."""

PlanState = PlanRuntime
"""The earlier name of what a plan leaves: now the `PlanRuntime` (same attribute names)."""

_NEW_SPELLING = (
    "runtime = plan.parallelize(model, spec=spec), then pass runtime=runtime to the trainer"
)


def warn_deprecated(what: str, stacklevel: int = 2, instead: str = _NEW_SPELLING) -> None:
    """Warn (DeprecationWarning) that `what` goes away in the next release and what to use
    `instead`; stacklevel=2 attributes it to the caller of the function that calls this one."""
    warnings.warn(
        f"{what} is deprecated and will be removed in the next release: {instead}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )


def _deprecated(what: str, stacklevel: int = 3) -> None:
    warn_deprecated(what, stacklevel)


def apply_plan(
    plan: PlanFields,
    model: nn.Module,
    *,
    spec: ModelSpec | str | None = None,
    mesh: DeviceMesh | None = None,
    _stacklevel: int = 3,
) -> nn.Module:
    """Deprecated: `plan.parallelize(model, spec=spec)` returns the runtime; this returns the
    model (split in place) and records its runtime for `plan_state` and the trainers.

    Raises:
        ValueError, TypeError, RuntimeError: as `posttrain.train.sharding.parallelize`; also if
            the plan was applied to this model before.
    """
    _deprecated("plan.apply(model) / apply_plan(plan, model)", _stacklevel)
    if model in _RUNTIMES:
        raise ValueError("this model already has a ParallelPlan applied; build a fresh model")
    return register(parallelize(plan, model, spec=spec, mesh=mesh))


def register(runtime: PlanRuntime) -> nn.Module:
    """Record `runtime` for its model (the deprecated spelling of a parallelizing function that
    returned the model); returns the model."""
    _RUNTIMES[runtime.model] = runtime
    return runtime.model


def plan_state(model: nn.Module) -> PlanRuntime | None:
    """Deprecated: the runtime `plan.apply` made for `model`, or None. Hold the runtime
    `plan.parallelize` returns instead."""
    _deprecated("plan_state(model)")
    return _RUNTIMES.get(model)


def runtime_of(model: nn.Module | Runtime) -> Runtime:
    """The runtime of `model`: itself for a `Runtime`, the registered one for a model split by
    the deprecated `plan.apply`, a `LocalRuntime` of this process alone for a plain model.

    Raises:
        ValueError: for a model split by a plan whose runtime is not known here (pass the
            `PlanRuntime` that `plan.parallelize` returned instead of its model).
    """
    if isinstance(model, Runtime):
        return model
    if model in _RUNTIMES:
        return _RUNTIMES[model]
    done = parallelized(model)
    if done is not None:
        raise ValueError(
            f"this model is split by a ParallelPlan ({done}) and was given without "
            "its runtime: pass the PlanRuntime that plan.parallelize(model, "
            "spec=spec) returned"
        )
    return LocalRuntime(model, replicas=False)


def full_state_dict(model: nn.Module | Runtime) -> dict[str, torch.Tensor]:
    """The unsharded `state_dict()` of a model, on CPU, on every rank: `runtime.full_state_dict()`
    of its runtime (`runtime_of`; a collective under a plan: every rank must call it), the plain
    state dict of a model without a plan. Use it to export a sharded run
    (`posttrain.models.save_hf_checkpoint` on rank 0).

    Raises:
        ValueError: for a model split by a plan given without its runtime (pass the
            `PlanRuntime` that `plan.parallelize` returned).
    """
    return runtime_of(model).full_state_dict()


def check_plan(model: nn.Module, plan: PlanFields | None, runtime: Runtime | None = None) -> None:
    """Raise ValueError if `plan` (when given) is not the plan applied to `model` (by `runtime`,
    or by the deprecated `plan.apply`)."""
    if plan is None:
        return
    if runtime is None:
        runtime = _RUNTIMES.get(model)
    if runtime is None or runtime.plan is None:
        raise ValueError(
            f"{plan} was not applied to the model: call runtime = "
            "plan.parallelize(model, spec=spec) first, then build the optimizer "
            "over runtime.model.parameters() and pass runtime=runtime"
        )
    if runtime.plan != plan:
        raise ValueError(f"the model was split by {runtime.plan}, not by the given {plan}")


def resolve_runtime(
    model: nn.Module,
    *,
    runtime: Runtime | None,
    plan: PlanFields | None,
    replicas: bool = True,
    argument: str = "model",
) -> Runtime:
    """The runtime a trainer of `model` holds.

    Args:
        model: what the trainer trains (`runtime.model` must be this object).
        runtime: the `Runtime` given to the trainer, or None.
        plan: the deprecated `plan=` argument (checked against the runtime), or None.
        replicas: for a `LocalRuntime`: whether the ranks of a default process group are
            data-parallel replicas (see `LocalRuntime`).
        argument: the trainer's argument that holds `model`, for messages.

    Returns:
        `runtime`; else the runtime of the deprecated `plan.apply` (with a DeprecationWarning);
        else a `LocalRuntime(model)`.

    Raises:
        TypeError: if `runtime` is not a `Runtime`.
        ValueError: if `runtime.model` is not `model`, `plan` differs from the applied plan or
            was not applied, or `model` is split by a plan whose runtime was not given.
    """
    if runtime is not None and not isinstance(runtime, Runtime):
        raise TypeError(
            f"runtime must be a posttrain.train.Runtime (what plan.parallelize "
            f"returns) or None; got {type(runtime).__name__}"
        )
    if runtime is not None and runtime.model is not model:
        raise ValueError(
            f"runtime.model is not the {argument} given to the trainer; pass "
            f"runtime.model as the {argument}"
        )
    if plan is not None:
        warnings.warn(
            "the plan= argument of the trainers is deprecated and will be removed in "
            f"the next release: {_NEW_SPELLING}",
            DeprecationWarning,
            stacklevel=3,
        )
    if runtime is None and model in _RUNTIMES:
        if plan is None:  # (one warning per call)
            warnings.warn(
                "a model split by plan.apply is deprecated and will be removed in the "
                f"next release: {_NEW_SPELLING}",
                DeprecationWarning,
                stacklevel=3,
            )
        runtime = _RUNTIMES[model]
    check_plan(model, plan, runtime)
    if runtime is not None:
        return runtime
    done = parallelized(model)
    if done is not None:
        raise ValueError(
            f"the {argument} is split by a ParallelPlan ({done}) but no runtime "
            "was given: pass runtime= (what plan.parallelize returned)"
        )
    return LocalRuntime(model, replicas=replicas)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Deprecated: `runtime.set_gradient_sync(enabled)`."""
    _deprecated("set_gradient_sync(model, enabled)")
    runtime = _RUNTIMES.get(model)
    if runtime is not None:
        runtime.set_gradient_sync(enabled)


def sum_over_data_ranks(model: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """Deprecated: `runtime.sum_over_data_ranks(value)`."""
    _deprecated("sum_over_data_ranks(model, value)")
    runtime = _RUNTIMES.get(model)
    return value if runtime is None else runtime.sum_over_data_ranks(value)
