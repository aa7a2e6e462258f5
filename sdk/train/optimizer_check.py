"""The check every trainer makes of its optimizer: it must hold exactly the model's current
trainable parameters, the very tensor objects, or some weights silently never change.

Three ways an optimizer comes to hold other tensors, each refused by name:

* built before the model's parameters were replaced: `plan.parallelize` (FSDP2 and TP register
  DTensors in place of the parameters), or a converter that swaps modules; or built while FSDP2
  had the root's gathered (unsharded) copies registered, after a forward with grad that no
  backward followed. Those tensors never receive a gradient.
* holding frozen parameters (requires_grad=False: a LoRA base after `convert_model`), which
  the update skips.
* missing trainable ones (a LoRA adapter added after the optimizer, a value head left out):
  they receive gradients, are counted in the gradient norm, and never change.

The check first reshards every FSDP2 unit of the model (`reshard`),
so that `model.parameters()` are the sharded parameters whatever ran before.

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Linear(2, 2)
    >>> check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    >>> check_optimizer(  # doctest: +NORMALIZE_WHITESPACE
    ...     torch.optim.SGD([model.weight], lr=0.1), model)
    Traceback (most recent call last):
    ...
    ValueError: optimizer: does not hold 1 trainable parameter(s) of the model: bias (they would
    receive gradients but never change); build the optimizer over [p for p in
    model.parameters() if p.requires_grad] right before the trainer (after plan.parallelize and
    any converter), or freeze what should not train with requires_grad_(False)
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["check_optimizer", "remember_parameters", "former_names", "reshard"]

_REPLACED: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[str, Any, str]]] = (
    weakref.WeakKeyDictionary()
)
"""module -> {id: (name, weak reference, event)} of its parameters before an event replaced
them (kept here, not on the module; weak both ways)."""

_SHOWN = 6  # names listed per kind in a message


def _listed(names: list[str]) -> str:
    more = f", ... ({len(names) - _SHOWN} more)" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def reshard(module: nn.Module) -> None:
    """Put every FSDP2 unit of `module` in its sharded state: the sharded parameters (the ones
    that receive gradients and that the optimizer holds) registered on the modules again. A
    no-op for a module without FSDP2 and for units already sharded."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def remember_parameters(model: nn.Module, event: str) -> None:
    """Record `model`'s parameters by name, weakly, before `event` replaces some of them (a
    ParallelPlan's DTensors, a converter's modules), so that an optimizer built earlier is
    refused with their names (`former_names`). A parameter already recorded keeps its first
    event."""
    record = _REPLACED.setdefault(model, {})
    for name, p in model.named_parameters():
        kept = record.get(id(p))
        if kept is None or kept[1]() is not p:  # a weak reference: an id may be reused
            record[id(p)] = (name, weakref.ref(p), event)


def former_names(module: nn.Module) -> dict[int, tuple[str, str]]:
    """{id: (name, event)} of the parameters `remember_parameters` recorded on `module` or its
    submodules (names prefixed) that are still alive, e.g. held by an optimizer."""
    names: dict[int, tuple[str, str]] = {}
    for prefix, sub in module.named_modules():
        for key, (name, ref, event) in _REPLACED.get(sub, {}).items():
            if ref() is not None:
                names.setdefault(key, (f"{prefix}.{name}" if prefix else name, event))
    return names


def check_optimizer(optimizer: Any, module: nn.Module, *, argument: str = "optimizer") -> None:
    """Refuse an optimizer that does not hold every current trainable parameter of `module`
    (compared by identity, as the optimizer updates them), or that holds a tensor that is not a
    current parameter of `module`. Frozen parameters may be held: they receive no gradient, so
    the optimizer leaves them as they are (AdamW(model.parameters()) on a LoRA model, or
    progressive unfreezing, are accepted).

    Reshards every FSDP2 unit of `module` first (a no-op without FSDP2), so that its registered
    parameters are the sharded ones that receive the gradients.

    Args:
        optimizer: a `torch.optim.Optimizer` (anything with `param_groups`).
        module: every module the trainer trains, in one container (names in the message are
            relative to it).
        argument: the trainer's argument named in the message.

    Raises:
        ValueError: naming `argument`, the parameters concerned and the fix, if the optimizer
            holds a tensor that is not a current parameter of `module` (built before
            `plan.parallelize` or a converter replaced it, or while FSDP2 had the root's gathered
            copies registered), or lacks a trainable one.
    """
    gathered = {id(p): name for name, p in module.named_parameters()}
    reshard(module)
    current = {id(p): (name, p) for name, p in module.named_parameters()}
    replaced = former_names(module)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    held_ids = {id(p) for p in held}
    unknown, gathered_copies = [], []
    before: dict[str, list[str]] = {}  # event -> names
    for p in held:
        if id(p) in current:  # frozen ones too: they get no gradient, so no update
            continue  # (AdamW(model.parameters()) on LoRA, progressive unfreezing)
        if id(p) in gathered:
            gathered_copies.append(gathered[id(p)])
        elif id(p) in replaced:
            name, event = replaced[id(p)]
            before.setdefault(event, []).append(name)
        else:
            unknown.append(f"a tensor of shape {list(p.shape)}")
    stale = set(gathered_copies).union(*before.values())  # their current ones: named once
    missing = [
        name
        for key, (name, p) in current.items()
        if p.requires_grad and key not in held_ids and name not in stale
    ]
    fix = (
        "build the optimizer over [p for p in model.parameters() if p.requires_grad] right "
        "before the trainer (after plan.parallelize and any converter)"
    )
    problems = []
    if gathered_copies:
        problems.append(
            f"holds FSDP2's gathered (unsharded) copies of "
            f"{_listed(gathered_copies)}, registered on the model by a forward that "
            "no backward followed when the optimizer was built; they never receive "
            "a gradient (the model has its sharded parameters again now)"
        )
    for event, names in before.items():
        problems.append(
            f"holds {len(names)} parameter(s) the model no longer has: "
            f"{_listed(names)}; it was built before {event}; they never receive a "
            "gradient"
        )
    if unknown:
        problems.append(
            f"holds {len(unknown)} tensor(s) that are not parameters of the "
            f"model: {_listed(unknown)} (built before a converter replaced them, "
            "or over another model); they never receive a gradient"
        )
    if missing:
        problems.append(
            f"does not hold {len(missing)} trainable parameter(s) of the model: "
            f"{_listed(missing)} (they would receive gradients but never change)"
        )
    if problems:
        raise ValueError(
            f"{argument}: {'; '.join(problems)}; {fix}"
            + (", or freeze what should not train with requires_grad_(False)" if missing else "")
        )
