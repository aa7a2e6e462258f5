"""Checkpoints of a run under a `ParallelPlan`: model and optimizer as torch.distributed.checkpoint
(DCP) shards, the rest (scheduler, RNG, step, metrics rows, data position, replay buffer) in
the ordinary `train_state.pt`, all in one verified, atomic checkpoint folder:

    checkpoints/step_000012/sharded/.metadata, __0_0.distcp, ...   every rank's shards (DCP)
    checkpoints/step_000012/model.pt                               {} (the weights are above)
    checkpoints/step_000012/train_state.pt, meta.json, manifest.json

Saving: every rank writes its shards into the staging folder (`staging_dir`), then rank 0 writes
the rest, the manifest (sha256 of every shard too) and renames the folder into place; all ranks
wait at a barrier, so a requeued job finds the same checkpoint on every rank. That last part,
`save_on_rank_zero`, is also how a run without a plan saves its full checkpoint (`LocalRuntime`).

Loading reshards: the state dicts are keyed by parameter name (`get_state_dict`), so a checkpoint
saved under one plan loads under another (dp_shard 4 -> 2, FSDP -> TP) or into one process
without a plan (DCP reads the shards it needs and redistributes them); the other way, a full
checkpoint of a run without a plan loads under a plan (`load_full_state`).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.core.checkpoint import (
    CHECKPOINT_DIR,
    SHARDED_DIR,
    checkpoint_name,
    save_checkpoint,
    staging_dir,
)
from posttrain.core.checkpoint_files import (
    check_dcp_metadata,
    is_disk_full,
    make_private_dir,
    no_space_error,
    state_bytes,
)
from posttrain.core.distributed import barrier

__all__ = ["save_sharded_checkpoint", "save_on_rank_zero", "load_sharded_state", "load_full_state"]


def save_sharded_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int | None,
    rank: int,
) -> Path:
    """Save a sharded checkpoint (collective: every rank calls it). `train_state` must not hold
    the optimizer (it goes into the shards). Returns the checkpoint folder.

    Raises:
        OSError: errno ENOSPC on every rank if the file system is full, naming the staging
            folder, the bytes of this rank's shards and the bytes free (rank 0 removes the
            partial shards; earlier checkpoints are untouched); from `save_checkpoint` likewise.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    stage = staging_dir(run_dir, step)
    if rank == 0:
        make_private_dir(Path(run_dir))
        make_private_dir(Path(run_dir) / CHECKPOINT_DIR)
        shutil.rmtree(stage, ignore_errors=True)  # a crashed save of the same step
        make_private_dir(stage)
    barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        dcp.save(
            {"model": model_state, "optimizer": optim_state}, checkpoint_id=str(stage / SHARDED_DIR)
        )
    except BaseException as e:  # DCP raises the same CheckpointException on every rank
        needed = state_bytes((model_state, optim_state))
        if not is_disk_full(e, stage, needed):
            raise
        if rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
        raise no_space_error(
            stage.parent,
            needed,
            f"rank {rank}'s shards of checkpoint {checkpoint_name(step)}",
            estimate=True,
            note="; earlier checkpoints are untouched",
        ) from e
    barrier()
    return save_on_rank_zero(
        run_dir,
        step,
        rank=rank,
        model_state=dict,  # the weights are in the shards
        train_state=train_state,
        meta={**meta, "sharded": True},
        keep_last=keep_last,
        staged=stage,
    )


def save_on_rank_zero(
    run_dir: Path,
    step: int,
    *,
    rank: int,
    model_state: Callable[[], dict[str, Any]],
    train_state: dict[str, Any],
    meta: dict[str, Any],
    keep_last: int | None,
    staged: Path | None = None,
) -> Path:
    """Rank 0 writes checkpoint `step` (`posttrain.core.checkpoint.save_checkpoint` with
    `model_state()`, called on rank 0 only, and a `staged` folder of shards if given), then every
    rank waits at a barrier (collective: every rank calls it). Returns the checkpoint folder,
    `run_dir/checkpoints/step_NNNNNN`, on every rank.

    Raises what `save_checkpoint` raises (ValueError, TypeError, OSError ENOSPC), on rank 0."""
    if rank == 0:
        save_checkpoint(
            run_dir,
            step,
            model_state=model_state(),
            train_state=train_state,
            keep_last=keep_last,
            meta=meta,
            staged=staged,
        )
    barrier()
    return Path(run_dir) / CHECKPOINT_DIR / checkpoint_name(step)


def load_sharded_state(folder: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the shards in `folder` (a checkpoint's `sharded/`) into `model` and `optimizer`,
    whatever plan (or none) they were saved under; collective under a plan.

    Raises:
        UnsafeCheckpointError: if the DCP metadata (a pickle) names anything but DCP's own
            metadata classes (`check_dcp_metadata`); nothing is loaded.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    check_dcp_metadata(Path(folder) / ".metadata")
    model_state, optim_state = get_state_dict(model, optimizer)
    # DCP loads into this dict in place (its nested values keep DCP's own types)
    state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def load_full_state(
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Load a checkpoint of a run without a plan (the full `state_dict()` of the module, or a
    dict of them keyed by the names of `model`'s children, and `optimizer.state_dict()`) into
    `model` split by a plan and its `optimizer`: every rank reads the whole checkpoint and keeps
    its own shards (`set_state_dict` with `full_state_dict=True`). Collective under a plan.

    The saved optimizer names its parameters by position; they are matched to `model`'s by the
    position of the same parameters in `optimizer` (the same recipe builds it the same way).

    Raises:
        ValueError: if the saved optimizer holds another number of parameter groups or
            parameters than `optimizer`, or a parameter of `optimizer` is not in `model`.
    """
    from torch.distributed.checkpoint.state_dict import (
        OptimizerStateType,
        StateDictOptions,
        set_state_dict,
    )

    flat = model_state
    children = dict(model.named_children())
    if (
        model_state
        and all(isinstance(v, dict) for v in model_state.values())
        and set(model_state) <= set(children)
    ):  # {"policy": {...}, "value_head": {...}}
        flat = {f"{child}.{k}": v for child, sd in model_state.items() for k, v in sd.items()}
    names = {id(p): n for n, p in model.named_parameters()}
    saved_groups, groups = optimizer_state["param_groups"], optimizer.param_groups
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in groups]:
        raise ValueError(
            f"the checkpoint's optimizer has parameter groups of "
            f"{[len(g['params']) for g in saved_groups]} parameters; this one of "
            f"{[len(g['params']) for g in groups]}"
        )
    fqn: dict[int, str] = {}
    for saved, group in zip(saved_groups, groups):
        for index, param in zip(saved["params"], group["params"]):
            if id(param) not in names:
                raise ValueError(
                    "the optimizer holds a parameter that is not in the model it is saved with"
                )
            fqn[index] = _canonical(names[id(param)])
    optim: OptimizerStateType = {
        "state": {fqn[i]: s for i, s in optimizer_state["state"].items()},
        "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]} for g in saved_groups],
    }
    set_state_dict(
        model,
        optimizer,
        model_state_dict=flat,
        optim_state_dict=optim,
        options=StateDictOptions(full_state_dict=True),
    )


def _canonical(name: str) -> str:
    """A parameter name without the wrappers' prefixes (activation checkpointing, compile),
    as `get_state_dict` names it."""
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name
