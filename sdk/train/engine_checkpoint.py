"""The training engine's checkpoints: what one holds, how it is saved, how a run resumes from it.

A checkpoint of a trainer (`posttrain.train.engine.Engine.save_checkpoint`) is the model, the
optimizer and a train state: the step count, the learning-rate scheduler's state, the RNG states
(`posttrain.core.checkpoint.capture_rng_state`), the metrics rows so far and the trainer's own
state (a data position, a replay buffer). Its meta holds the settings that cannot change on
resume (the trainer's `_fixed_settings`: the loss, gradient accumulation, the RL algorithm, ...)
and the world size. How the model and optimizer are written is the trainer's `runtime`'s
(`posttrain.train.runtime.Runtime.save_checkpoint`): one full file from rank 0 without a plan,
torch.distributed.checkpoint shards from every rank under a `ParallelPlan`, which reload under
another plan or none (`posttrain.train.sharded_checkpoint`); the folder is written atomically
and verified.

Resuming loads all of it back, after checking that the checkpoint can continue this trainer
(`posttrain.train.hooks.check_resumable`: a fixed setting that differs is an error naming it);
after that a run continues bit for bit (CPU, fixed threads).

The functions take the parts a checkpoint holds, never the trainer: the engine's two methods
(`save_checkpoint`, `resume`) pass them and keep the step count and metrics log.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from posttrain.core.checkpoint import (
    capture_rng_state,
    load_checkpoint,
    resolve_checkpoint,
    restore_rng_state,
)
from posttrain.train.hooks import check_resumable
from posttrain.train.runtime import Runtime

__all__ = ["TRAIN_STATE_VERSION", "save_train_checkpoint", "load_train_checkpoint"]

TRAIN_STATE_VERSION = 1
"""Version of the train state a checkpoint holds (its "version" key)."""


def save_train_checkpoint(
    runtime: Runtime,
    run_dir: Path,
    *,
    step: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    metrics_rows: Sequence[Mapping[str, Any]],
    extra_state: Mapping[str, Any],
    fixed_settings: Mapping[str, Any],
    model_state: Callable[[], dict[str, Any]],
    keep_last: int | None,
    rank: int,
    world_size: int,
) -> Path:
    """Save step `step` into `run_dir/checkpoints/step_NNNNNN/` through `runtime` (atomically;
    older ones beyond `keep_last` deleted). With several ranks every rank calls it: rank 0
    writes (under a plan every rank writes its shards), then all ranks wait at a barrier.

    Args:
        module: what a sharded checkpoint holds with the optimizer (the trainer's
            `_checkpoint_module()`).
        lr_scheduler: the scheduler (its `state_dict()` is saved), or None.
        metrics_rows: the per-step rows so far (copied).
        extra_state: the trainer's own state, merged into the train state.
        fixed_settings: the settings that cannot change on resume, saved in the meta with
            `world_size`.
        model_state: returns the model weights a full checkpoint holds.

    Returns:
        The checkpoint folder (its final name on every rank).
    """
    train_state = {
        "version": TRAIN_STATE_VERSION,
        "step": step,
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        "rng": capture_rng_state(),
        "metrics": [dict(r) for r in metrics_rows],
        **extra_state,
    }
    return runtime.save_checkpoint(
        run_dir,
        step,
        module=module,
        optimizer=optimizer,
        train_state=train_state,
        meta={**fixed_settings, "world_size": world_size},
        keep_last=keep_last,
        rank=rank,
        model_state=model_state,
    )


def load_train_checkpoint(
    path: str | os.PathLike,
    runtime: Runtime,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    fixed_settings: Mapping[str, Any],
    load_model_state: Callable[[dict[str, Any]], None],
    load_extra_state: Callable[[dict[str, Any]], None],
) -> tuple[Path, dict[str, Any]]:
    """Check the checkpoint at `path` against this trainer, then load the model(s) and the
    optimizer (through `runtime`: sharded or full, saved under this plan, another one or none),
    the scheduler, the trainer's own state (`load_extra_state(train_state)`) and, last, the RNG
    states.

    Args:
        path: a checkpoint folder, or a run folder (its latest checkpoint).

    Returns:
        (the checkpoint folder loaded, its train state); the caller restores the step count
        (`train_state["step"]`) and the metrics rows (`train_state["metrics"]`).

    Raises:
        FileNotFoundError: if there is no checkpoint there.
        ValueError: if the checkpoint and this trainer disagree: a fixed setting (named)
            differs, or a scheduler is present in one only.
    """
    folder = resolve_checkpoint(path)
    ckpt = load_checkpoint(folder)
    state = ckpt["train_state"]
    check_resumable(
        folder,
        state,
        ckpt.get("meta") or {},
        fixed_settings=fixed_settings,
        has_lr_scheduler=lr_scheduler is not None,
    )
    runtime.load_checkpoint(
        ckpt, module=module, optimizer=optimizer, load_model_state=load_model_state
    )
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    load_extra_state(state)
    restore_rng_state(state["rng"])
    return folder, state
