"""The training engine: the part of the loop every trainer shares.

A trainer (`Trainer` for SFT/CPT, the DPO family and reward models; `RLTrainer` for RL) is an
`Engine` that provides `step()` (one step's work) and says what its checkpoint holds. The
engine owns everything around the step:

    fit(n):  while step_count < n:
                 row = step()                  # the trainer's work; rolls itself back on error;
                                               # ends in _complete_step(row): the row recorded
                                               # (metrics.jsonl on rank 0, callbacks), then a
                                               # checkpoint when due (atomic, verified; rank 0
                                               # or every rank's shards, all wait)
                 progress bar
                 preemption boundary           # Slurm's warning signal acts here, never mid-step
             at the end: a checkpoint of the last step when checkpointing is on
             Ctrl-C: the step in flight is rolled back (or finished, if its update had begun),
                     a checkpoint is saved at the last whole step, `interrupted` is set.

A step called directly (`trainer.step()`, RL's `train_on_groups`) is recorded and checkpointed
the same way, since `_complete_step` ends it. Every parameter update goes through one method,
`update(loss)`: the global gradient norm, refusal of a non-finite loss or norm (the gradients
are discarded, nothing is applied), clipping to `max_grad_norm`, `optimizer.step()`, the
learning-rate schedule (`_step_schedule`, its one place), `optimizer.zero_grad()`.

What depends on how the model is split is the trainer's `runtime` (`posttrain.train.runtime`):
the sums over the data-parallel ranks (plain all-reduces over the default process group without
a plan; under a `ParallelPlan` FSDP2/TP reduce the gradients and the sums go over the plan's
data-parallel group), the gradient norm and clipping, and the checkpoint format. The engine
also applies the run-folder rules (a folder that holds a run needs `resume`; one live process
per folder, `posttrain.core.run_lock`). What a checkpoint holds (model, optimizer, scheduler,
RNG states, step count, metrics rows, the trainer's own state such as a data position or a
replay buffer, and the settings that cannot change on resume, `_fixed_settings`), and how a run
resumes from it bit for bit, is `posttrain.train.engine_checkpoint`'s.
"""

from __future__ import annotations

import abc
import os
import warnings
from math import inf
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from posttrain.core import preemption
from posttrain.core.checkpoint import check_new_run_dir, latest_checkpoint
from posttrain.core.checks import check_int
from posttrain.core.distributed import device_of, rank_and_world_size
from posttrain.core.metrics import MetricsLog
from posttrain.core.run_lock import claim_run_dir
from posttrain.train.engine_checkpoint import load_train_checkpoint, save_train_checkpoint
from posttrain.train.hooks import check_data_shard
from posttrain.train.losses import check_finite_update
from posttrain.train.optimizer_check import check_optimizer
from posttrain.train.runtime import PlanRuntime, Runtime

__all__ = ["Engine", "StepUpdate"]


class StepUpdate(NamedTuple):
    """What `Engine.update` applied: the gradient norm before clipping (a 0-dim float32
    tensor) and the learning rate the optimizer step used."""

    grad_norm: torch.Tensor
    lr: float


class Engine(abc.ABC):
    """Base of every trainer: fit, metrics, checkpoints, resume, preemption, Ctrl-C, ranks.

    A subclass calls `_setup_engine(...)` early in `__init__` (with its `runtime`) and
    `_start(resume)` last, and implements `step()` (ending in `_complete_step(row)`, its updates
    through `update(loss)`), `_module()` (the model whose device and parameters the engine uses),
    `_model_state()` / `_load_model_state(state)` and optionally `_extra_state()` /
    `_load_extra_state(state)`, `_fixed_settings()`, `_check_can_save()`, `_postfix(row)` and
    `_checkpoint_module()` (what a sharded checkpoint holds).

    Attributes:
        step_count: optimizer steps taken (RL: RL steps).
        rank, world_size: this process's place in the default process group (0 and 1 without
            one).
        runtime: the `Runtime` of the trained model (`LocalRuntime` without a plan, the
            `PlanRuntime` of `plan.parallelize` under one).
        interrupted: True after `fit` stopped on Ctrl-C (reset by the next `fit`).
        metrics: the per-step rows as a DataFrame.
    """

    progress_desc = "train"

    def _setup_engine(
        self,
        *,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        max_grad_norm: float | None,
        run_dir: str | os.PathLike | None,
        checkpoint_every: int,
        keep_last: int | None,
        progress: bool,
        callbacks: Any,
        resume: bool | str | os.PathLike,
        runtime: Runtime,
        tensorboard: bool = False,
    ) -> None:
        check_int("checkpoint_every", checkpoint_every, minimum=0)
        check_int("keep_last", keep_last, minimum=1, optional=True)
        if max_grad_norm is not None and not (max_grad_norm > 0):
            raise ValueError(f"max_grad_norm={max_grad_norm!r}; must be positive or None")
        if (checkpoint_every or resume is True or tensorboard) and run_dir is None:
            raise ValueError("checkpoint_every, resume=True and tensorboard need a run_dir")
        self.rank, self.world_size = rank_and_world_size()
        self.runtime = runtime
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.max_grad_norm = max_grad_norm
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.checkpoint_every, self.keep_last = checkpoint_every, keep_last
        self.progress, self.callbacks = progress, list(callbacks)
        self.step_count = 0
        self.target_steps: int | None = None  # set by fit (the dashboard's total)
        self.interrupted = False
        writes = self.rank == 0  # the other ranks keep their rows in memory
        self._log = MetricsLog(self.run_dir if writes else None, tensorboard=tensorboard and writes)
        self._last_saved_step: int | None = None
        self._rolled_back = False

    def _start(self, resume: bool | str | os.PathLike) -> None:
        """Check the optimizer against the trained modules, then apply the run-folder rules and
        `resume` (the last thing a trainer's __init__ does).

        Raises:
            ValueError: if the optimizer does not hold exactly the current trainable parameters
                of `_checkpoint_module()` (`posttrain.train.optimizer_check.check_optimizer`).
        """
        check_optimizer(self.optimizer, self._checkpoint_module())
        if resume is True:
            if self.run_dir is None:  # refused by _setup_engine already
                raise ValueError("resume=True needs a run_dir")
            if latest_checkpoint(self.run_dir) is not None:
                self.resume(self.run_dir)
            else:
                self._log.reset([])  # a run killed before its first checkpoint starts over
        elif resume:
            self.resume(resume)
        elif self.run_dir is not None:
            check_new_run_dir(self.run_dir)
        if self.run_dir is not None and self.rank == 0:
            claim_run_dir(self.run_dir)

    # ------------------------------------------------------------------ to override
    @abc.abstractmethod
    def step(self) -> dict[str, float]:
        """One step of the trainer's work; returns its metrics row."""

    @abc.abstractmethod
    def _module(self) -> nn.Module:
        """The model whose device and parameters the engine uses."""

    @abc.abstractmethod
    def _model_state(self) -> dict[str, Any]:
        """The model weights a checkpoint holds (a state dict, or a dict of them)."""

    @abc.abstractmethod
    def _load_model_state(self, state: dict[str, Any]) -> None:
        """Load what `_model_state` returned."""

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Restore what `_extra_state` added to the train state (nothing by default)."""

    def _fixed_settings(self) -> dict[str, Any]:
        return {}

    def _check_can_save(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Raise ValueError if a checkpoint could not be resumed from (fine by default)."""

    def _postfix(self, row: dict[str, Any]) -> dict[str, str]:
        return {}

    def _checkpoint_module(self) -> nn.Module:
        """The module a sharded checkpoint (under a ParallelPlan) holds with the optimizer:
        `_module()` by default. A trainer that trains more than one module (RL: a policy and a
        value head) returns one container of them, so that every parameter of the optimizer
        has a name in it; its trainable parameters are what the optimizer must hold (checked
        in `_start`)."""
        return self._module()

    # ------------------------------------------------------------------ the shared loop
    @property
    def metrics(self) -> pd.DataFrame:
        """One row per step taken so far (restored rows included after a resume)."""
        return self._log.frame()

    def _record(self, row: dict[str, Any]) -> None:
        self._log.append(row)
        for callback in self.callbacks:
            callback(self, row)

    def _checkpoint_if_due(self) -> None:
        if self.checkpoint_every and self.step_count % self.checkpoint_every == 0:
            self.save_checkpoint()

    def _complete_step(self, row: dict[str, Any], *, interrupted: bool = False) -> dict[str, Any]:
        """The end of every step: record its row (metrics.jsonl on rank 0, TensorBoard,
        callbacks), then checkpoint when due. Returns `row`.

        Raises:
            KeyboardInterrupt: after recording, when a Ctrl-C was held during the step
                (`interrupted`); no checkpoint then (`fit` saves one where it stops).
        """
        self._record(row)
        if interrupted:
            raise KeyboardInterrupt
        self._checkpoint_if_due()
        return row

    def fit(self, num_steps: int, *, budget_s: float | None = None) -> pd.DataFrame:
        """Take steps until `step_count == num_steps` (so a second call continues), or with
        `budget_s` (seconds) until the summed `step_time_s` of the steps taken so far (restored
        rows included) reaches it, checked before each step (under several ranks, rank 0's sum
        decides for all): training for a fixed compute budget, as for the equal-compute
        baselines.

        Each `step()` records its row (metrics.jsonl on rank 0, TensorBoard, callbacks) and
        saves a checkpoint when one is due, in `_complete_step`; `fit` adds the progress bar,
        the preemption boundary after every step (checkpoint, then requeue) and the checkpoint
        at the end. A KeyboardInterrupt (Ctrl-C) stops the run at a whole step: the step in
        flight is rolled back, or finished when its update had begun; a checkpoint of the last
        whole step is saved (when checkpointing is on), `interrupted` is set, a line says where
        it stopped, and `fit` returns. Call it again to continue. At the end a checkpoint is
        saved if `checkpoint_every` is set and the last step has none yet.

        Returns:
            `self.metrics`.

        Raises:
            ValueError: if `num_steps` is not a non-negative integer, or `budget_s` is not a
                finite number of seconds.
        """
        check_int("num_steps", num_steps, minimum=0)
        if budget_s is not None and not (isinstance(budget_s, int | float) and budget_s < inf):
            raise ValueError(f"budget_s={budget_s!r}; must be a finite number of seconds or None")
        from posttrain.core.progress import progress_bar  # live bar, or lines in a log file

        self.target_steps, self.interrupted = num_steps, False
        bar = progress_bar(
            total=num_steps,
            initial=min(self.step_count, num_steps),
            unit="step",
            desc=self.progress_desc,
            disable=not self.progress or self.rank != 0,
        )
        with preemption.deferring():  # a preemption signal waits for the end of its step
            try:
                while self.step_count < num_steps and not self._spent(budget_s):
                    row = self.step()
                    bar.set_postfix(self._postfix(row), refresh=False)
                    bar.update(1)
                    self._preemption_boundary()
            except KeyboardInterrupt:
                bar.close()
                self._stop_on_interrupt(num_steps)
                return self.metrics
            finally:
                bar.close()
            unsaved = self._last_saved_step != self.step_count
            if self.checkpoint_every and self.step_count and unsaved:
                self.save_checkpoint()
        return self.metrics

    def _spent(self, budget_s: float | None) -> bool:
        """Whether the summed `step_time_s` so far reaches `budget_s` (None: never); rank 0's
        answer under several ranks (their step times differ slightly)."""
        if budget_s is None:
            return False
        rows = self.metrics
        spent = float(rows["step_time_s"].sum()) if "step_time_s" in rows else 0.0
        if self.world_size == 1:
            return spent >= budget_s
        flag = torch.tensor(int(spent >= budget_s), device=device_of(self._module()))
        dist.broadcast(flag, src=0)
        return bool(flag)

    def _stop_on_interrupt(self, num_steps: int) -> None:
        self.interrupted = True
        if self._rolled_back:
            what = (
                f"step {self.step_count + 1} was rolled back (nothing of it was applied); "
                f"the run is as after step {self.step_count}"
            )
        else:
            what = f"stopped after step {self.step_count} completed"
        if self.checkpoint_every and self.step_count and self._last_saved_step != self.step_count:
            path = self.save_checkpoint()
            what += f"; checkpoint {path.name} saved"
        if self.rank == 0:
            print(f"Interrupted: {what}. Call fit({num_steps}) to continue.")

    def _preemption_boundary(self) -> None:
        """After a completed step: if preemption was requested, checkpoint and hand over to the
        original handler (`posttrain.core.preemption.step_boundary`). With several ranks, they
        first agree (one tiny all-reduce) whether any rank got the signal, so all of them enter
        the checkpoint's barrier at the same step."""
        if self.world_size == 1:
            preemption.step_boundary(self._preemption_save)
            return
        flag = torch.tensor(int(preemption.requested()), device=device_of(self._module()))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag:
            self._preemption_save()
            preemption.step_boundary()

    def _preemption_save(self) -> None:
        """The checkpoint before a preemption: only with a run_dir, only if the trainer can save
        (e.g. its data has a position), and only if the last step is not saved yet."""
        if self.run_dir is None or self._last_saved_step == self.step_count:
            return
        try:
            self._check_can_save()
        except ValueError:
            return
        self.save_checkpoint()

    # ------------------------------------------------------------------ gradients
    @property
    def plan_state(self) -> PlanRuntime | None:
        """Deprecated: `runtime` (a `PlanRuntime` under a plan)."""
        warnings.warn(
            "Engine.plan_state is deprecated and will be removed in the next release: "
            "use trainer.runtime (trainer.runtime.plan is None without a plan)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.runtime if isinstance(self.runtime, PlanRuntime) else None

    @property
    def data_rank_and_size(self) -> tuple[int, int]:
        """(index, count) of this rank among the ranks that see different data: the plan's
        data-parallel ranks, or every rank without a plan (`runtime.data_rank`, `.data_size`)."""
        return self.runtime.data_rank, self.runtime.data_size

    def _check_data_shard(self, data: Any) -> None:
        """Raise ValueError if `data` is sharded for another data-parallel rank or size."""
        check_data_shard(data, self.data_rank_and_size, self.runtime.describe())

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Under FSDP2: reduce gradients in the coming backward (the step's last micro-batch)."""
        self.runtime.set_gradient_sync(enabled)

    def _sum_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """SUM of a scalar over the data-parallel ranks (`value` itself with one rank)."""
        return self.runtime.sum_over_data_ranks(value)

    def _sum_gradients_across_ranks(self) -> None:
        """Make every gradient its SUM over the data-parallel ranks (flat all-reduce buckets
        without a plan; under a plan FSDP2 and TP have reduced them, the plan's own syncs run)."""
        self.runtime.sync_gradients(self._params_with_grads())

    def _params_with_grads(self) -> list[torch.nn.Parameter]:
        return [
            p
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def clip_and_check(self, loss: torch.Tensor) -> torch.Tensor:
        """Global L2 norm of the gradients (before clipping), clipped to `max_grad_norm`;
        refuse a non-finite loss or norm for step `step_count + 1`.

        Raises:
            ValueError: if no parameter of the optimizer received a gradient.
            NonFiniteLossError: for a non-finite loss or gradient norm (gradients discarded).
        """
        params = self._params_with_grads()
        if not params:
            raise ValueError(
                "no parameter of the optimizer received a gradient; does the loss "
                "depend on the optimizer's parameters?"
            )
        norm = self.runtime.grad_norm(params)
        try:
            check_finite_update(self.step_count + 1, loss, norm)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        if self.max_grad_norm is not None:
            self.runtime.clip_grads_(params, self.max_grad_norm, norm)
        return norm

    def update(self, loss: torch.Tensor, *, schedule: bool = True) -> StepUpdate:
        """Apply the accumulated gradients: clip -> optimizer step -> learning-rate schedule ->
        zero_grad; the one place every trainer updates its parameters. Call it after the last
        backward (and the gradient sums) of an optimizer step, inside
        `posttrain.core.preemption.sigint_held()`: from the optimizer step on, the update must
        not be cut in half.

        Args:
            loss: the step's loss (a scalar, summed over the ranks), checked to be finite.
            schedule: then step the schedule (`_step_schedule`). False where one step of the
                schedule spans several updates: RL calls `_step_schedule()` once per RL step.

        Returns:
            The gradient norm before clipping and the learning rate the step used.

        Raises:
            ValueError: if no parameter of the optimizer received a gradient.
            NonFiniteLossError: for a non-finite loss or gradient norm: the gradients are
                discarded and nothing is applied (`clip_and_check`).
        """
        grad_norm = self.clip_and_check(loss)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        if schedule:
            self._step_schedule()
        self.optimizer.zero_grad(set_to_none=True)
        return StepUpdate(grad_norm, lr)

    def _step_schedule(self) -> None:
        """One step of the learning-rate schedule (if any); the one place it is stepped."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Save everything needed to continue exactly into `run_dir/checkpoints/step_NNNNNN/`
        (atomically; older ones beyond `keep_last` deleted). With several ranks every rank
        calls it: rank 0 writes (under a plan every rank writes its shards), then all ranks wait
        at a barrier (`posttrain.train.engine_checkpoint.save_train_checkpoint`).

        Raises:
            ValueError: without a run_dir, or when the trainer cannot save (e.g. data without
                `state_dict()`).
        """
        if self.run_dir is None:
            raise ValueError("save_checkpoint needs a run_dir")
        self._check_can_save()
        path = save_train_checkpoint(
            self.runtime,
            self.run_dir,
            step=self.step_count,
            module=self._checkpoint_module(),
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            metrics_rows=self._log.rows,
            extra_state=self._extra_state(),
            fixed_settings=self._fixed_settings(),
            model_state=self._model_state,
            keep_last=self.keep_last,
            rank=self.rank,
            world_size=self.world_size,
        )
        self._last_saved_step = self.step_count
        return path

    def resume(self, path: str | os.PathLike | None = None) -> Path:
        """Load a checkpoint: model(s), optimizer, scheduler, RNG states, step count, metrics
        rows (`metrics.jsonl` is rewritten to those rows) and the trainer's own state
        (`posttrain.train.engine_checkpoint.load_train_checkpoint`).

        Args:
            path: a checkpoint folder, or a run folder (its latest checkpoint); default run_dir.

        Returns:
            The checkpoint folder loaded.

        Raises:
            FileNotFoundError: if there is no checkpoint there.
            ValueError: if the checkpoint and this trainer disagree: a fixed setting (named)
                differs, or a scheduler is present in one only.
        """
        folder, state = load_train_checkpoint(
            path if path is not None else self.run_dir or "",
            self.runtime,
            module=self._checkpoint_module(),
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            fixed_settings=self._fixed_settings(),
            load_model_state=self._load_model_state,
            load_extra_state=self._load_extra_state,
        )
        self.step_count = int(state["step"])
        self._log.reset(state["metrics"])
        self._last_saved_step = self.step_count
        return folder
