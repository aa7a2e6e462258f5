"""The training loop: one optimizer step at a time, with gradient accumulation, clipping, a
learning-rate schedule, evaluation, metrics and checkpoints for exact resume.

The `Trainer` takes built parts (model, optimizer, data loader, scheduler) and a loss chosen by
name from `posttrain.train.losses`. One step:

    batches = [data.next_batch() for _ in range(grad_accum_steps)]   # all fetched first
    units = sum(loss.num_units(b) for b in batches)                  # trained tokens of the step
    for b in batches:
        loss(model, b, units).backward()                             # share = loss_sum / units
    clip grad norm; optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()

so the gradient is that of the token mean over the whole step, whatever the micro-batching.

Data parallelism: when a `torch.distributed` default process group is initialised with more
than one rank (`posttrain.launch.submit` does it in a job; gloo on CPU, NCCL on GPUs), every rank holds
a full replica of the model and optimizer and its own share of each global batch (an
`SFTLoader` shards by itself). The step above then gains three SUM all-reduces:

    units = all_reduce(units)              # before any forward: the global normaliser
    ... forward/backward of the local micro-batches, each share = local loss_sum / global units
    all_reduce(every gradient); all_reduce(loss_sum)   # after the last backward

so the summed gradient is, up to float rounding, the single-process gradient of the global
batch, and clipping, the update and the logged loss are identical on every rank. Plain
collectives rather than `DistributedDataParallel`: DDP averages gradients (dividing by the world
size) and all-reduces during every backward unless told `no_sync()`; the token normaliser across
micro-batches and ranks needs a SUM of per-rank sums taken once, after the last micro-batch, and
two explicit all-reduces keep that visible. The price is no overlap of communication with
backward; gradients go in flat buckets (one collective per ~64 MiB). Parameters are broadcast
from rank 0 when the Trainer is built, as DDP does (buffers are not: a KV cache may exist on one
rank only). Each rank's data must yield that rank's share of the global batch.

Only rank 0 writes (checkpoints, `metrics.jsonl`, TensorBoard, the progress bar); the other
ranks keep their metrics rows in memory and wait at a barrier after each checkpoint, so a
resume right after it finds it on every rank. `resume` loads on every rank from the shared run
folder. The checkpoint holds rank 0's RNG states, which every rank restores: enough for SFT,
whose step draws no random numbers of its own (no dropout in these models; the loader's order
comes from its own seeded generator, and its global position is the same on every rank). A
loss that samples would need each rank's RNG states saved.

Preemption (`posttrain.core.preemption`): `fit` defers the Slurm warning signal to the end of the
step it arrives in, saves a checkpoint there (when the trainer has a run_dir and stateful data)
and then hands over to submitit's handler (requeue). With several ranks, the ranks agree after
every step whether any of them got the signal, so they all save the same step.

Interrupting (Ctrl-C in a notebook, KeyboardInterrupt) never leaves a half step: an interrupt
during data fetch, forward or backward discards the partial gradients and puts the data position
and RNG back; one during the parameter update is held until the update is done. `fit` then
returns, and calling it again continues as if nothing happened.

Example:
    >>> import torch
    >>> from posttrain.data import SFTDataset, SFTLoader
    >>> from posttrain.models import build_model, get_preset
    >>> from posttrain.models import ByteTokenizer
    >>> from posttrain.train import warmup_cosine_schedule
    >>> rows = [{"prompt": f"{i}+1?", "completion": str(i + 1)} for i in range(8)]
    >>> loader = SFTLoader(SFTDataset(rows, ByteTokenizer(), max_seq_len=32), batch_size=4)
    >>> model = build_model(get_preset("tiny-1m"), seed=0)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> trainer = Trainer(model, opt, data=loader, progress=False,
    ...                   lr_scheduler=warmup_cosine_schedule(opt, warmup_steps=1, total_steps=4))
    >>> trainer.fit(4)["step"].tolist()
    [1, 2, 3, 4]
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from posttrain.core import preemption
from posttrain.core.checkpoint import (CHECKPOINT_DIR, capture_rng_state, check_new_run_dir,
                                       checkpoint_name, latest_checkpoint, load_checkpoint, resolve_checkpoint, restore_rng_state,
                                       save_checkpoint)
from posttrain.core.distributed import barrier, device_of, flat_collective, rank_and_world_size
from posttrain.core.preemption import sigint_held
from posttrain.train.hooks import evaluate_model, has_state, seed_all
from posttrain.train.losses import TrainingLoss, check_finite_update, get_loss
from posttrain.core.metrics import MetricsLog
from posttrain.core.checks import check_int

__all__ = ["Trainer"]

TRAIN_STATE_VERSION = 1


# --------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------


class Trainer:
    """Runs optimizer steps on built parts; records metrics; saves and resumes checkpoints.

    Args:
        model: a module; `loss` decides how it is called (SFT: `model(input_ids,
            mask=attention_mask, input_pos=position_ids)` -> logits [B, T, V]).
        optimizer: built over the parameters to train.
        data: has `next_batch()` (endless); `state_dict()` / `load_state_dict()` to checkpoint
            and to put the position back after an interrupted step (`posttrain.data.loader.SFTLoader`).
        loss: a registered name (`posttrain.train.losses.get_loss`) or a `TrainingLoss` object.
        lr_scheduler: stepped once per optimizer step, after it (or None).
        grad_accum_steps: micro-batches per optimizer step.
        max_grad_norm: clip the global L2 norm of the gradients to this (None: no clipping; the
            norm is reported either way).
        run_dir: folder for `metrics.jsonl`, `tensorboard/` and `checkpoints/`; None keeps
            everything in memory. A folder that already holds a run needs `resume`.
        eval_fn: `eval_fn(model) -> {name: number}`, called under `torch.no_grad()` with the
            model in eval mode (training mode and the RNG states are restored after, so
            evaluation does not change the training run). Values land in the step's row as
            "eval/<name>".
        eval_every: evaluate after every `eval_every`-th step (0: never).
        checkpoint_every: save after every `checkpoint_every`-th step and at the end of `fit`
            (0: never); needs `run_dir`.
        keep_last: checkpoints kept (None: all).
        tensorboard: also write the metrics as TensorBoard scalars under `run_dir/tensorboard`.
        progress: show a `tqdm.auto` progress bar in `fit` (a widget in Jupyter).
        seed: seeds Python `random`, numpy and torch's global RNGs here (dropout, sampling in
            losses); a resumed run restores the checkpoint's RNG states instead.
        callbacks: each is called `callback(trainer, row)` after every step (live plots).
        resume: False: start fresh. True: continue from the latest checkpoint in `run_dir` if
            there is one (the requeue idiom). A path: continue from that checkpoint folder or
            the latest one of that run folder.

    Data parallelism (see the module docstring) needs no option: it follows the initialised
    `torch.distributed` process group. `callbacks` and `eval_fn` run on every rank.

    Attributes:
        step_count: optimizer steps taken.
        rank, world_size: this process's place in the data-parallel group (0 and 1 without one).
        metrics: the per-step rows as a DataFrame (columns step, loss, lr, grad_norm,
            trained_tokens, tokens_per_s, step_time_s, eval/...).

    Metrics of a step: loss = token mean of the step's loss (before the update), lr = the lr the
    step used, grad_norm = global L2 norm before clipping, trained_tokens = the step's
    normaliser, tokens_per_s = trained_tokens / step_time_s (as torchtune reports it),
    step_time_s = wall time from data fetch to the end of the update.

    Raises:
        ValueError: for bad options, a `run_dir` that holds a run while `resume` is False, or
            data sharded for another world size or rank than the process group's.
        TypeError: for a `data` without `next_batch`, or a `loss` that is neither.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, data: Any,
                 loss: str | TrainingLoss = "sft_ce",
                 lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                 grad_accum_steps: int = 1, max_grad_norm: float | None = None,
                 run_dir: str | os.PathLike | None = None,
                 eval_fn: Callable[[nn.Module], Mapping[str, float]] | None = None,
                 eval_every: int = 0, checkpoint_every: int = 0, keep_last: int | None = 2,
                 tensorboard: bool = False, progress: bool = True, seed: int = 0,
                 callbacks: Sequence[Callable[[Trainer, dict], None]] = (),
                 resume: bool | str | os.PathLike = False) -> None:
        if not callable(getattr(data, "next_batch", None)):
            raise TypeError(f"data must have a next_batch() method (e.g. posttrain.data.loader."
                            f"SFTLoader); got {type(data).__name__}")
        if isinstance(loss, str):
            loss = get_loss(loss)
        elif not isinstance(loss, TrainingLoss):
            raise TypeError(f"loss must be a registered name or a TrainingLoss (num_units(batch) "
                            f"and __call__(model, batch, num_units_in_step)); got {loss!r}")
        check_int("grad_accum_steps", grad_accum_steps, minimum=1)
        check_int("eval_every", eval_every, minimum=0)
        check_int("checkpoint_every", checkpoint_every, minimum=0)
        if keep_last is not None:
            check_int("keep_last", keep_last, minimum=1)
        if max_grad_norm is not None and not (max_grad_norm > 0):
            raise ValueError(f"max_grad_norm={max_grad_norm!r}; must be positive or None")
        if eval_every and eval_fn is None:
            raise ValueError(f"eval_every={eval_every} needs an eval_fn")
        if (checkpoint_every or resume is True or tensorboard) and run_dir is None:
            raise ValueError("checkpoint_every, resume=True and tensorboard need a run_dir")
        if checkpoint_every and not has_state(data):
            raise ValueError(f"checkpoint_every needs data with state_dict()/load_state_dict() "
                             f"(to resume at the same position); {type(data).__name__} has none")

        self.rank, self.world_size = rank_and_world_size()
        shard = (getattr(data, "rank", self.rank), getattr(data, "world_size", self.world_size))
        if shard != (self.rank, self.world_size):
            raise ValueError(f"data is sharded as rank {shard[0]} of world_size={shard[1]}, but "
                             f"this process is rank {self.rank} of world_size={self.world_size}; "
                             "build the loader after initialising torch.distributed (or pass "
                             "it rank= and world_size=)")

        self.model, self.optimizer, self.data, self.loss = model, optimizer, data, loss
        self.lr_scheduler = lr_scheduler
        self.grad_accum_steps, self.max_grad_norm = grad_accum_steps, max_grad_norm
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.eval_fn, self.eval_every = eval_fn, eval_every
        self.checkpoint_every, self.keep_last = checkpoint_every, keep_last
        self.progress, self.seed, self.callbacks = progress, seed, list(callbacks)
        self.step_count = 0
        self.target_steps: int | None = None  # set by fit (the dashboard's total)
        writes = self.rank == 0  # the other ranks keep their rows in memory
        self._log = MetricsLog(self.run_dir if writes else None, tensorboard=tensorboard and writes)
        self._last_saved_step: int | None = None
        self._rolled_back = False
        seed_all(seed)
        if self.world_size > 1:
            flat_collective(list(model.parameters()), lambda flat: dist.broadcast(flat, src=0))

        if resume is True:
            if latest_checkpoint(self.run_dir) is not None:
                self.resume(self.run_dir)
            else:
                self._log.reset([])  # a run killed before its first checkpoint starts over
        elif resume:
            self.resume(resume)
        elif self.run_dir is not None:
            check_new_run_dir(self.run_dir)

    # ------------------------------------------------------------------ the step

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per step taken so far (restored rows included after a resume)."""
        return self._log.frame()

    def step(self) -> dict[str, float]:
        """One optimizer step, then evaluation, metrics and checkpoint when due.

        Returns:
            The step's metrics row.

        Raises:
            ValueError: if the step's micro-batches hold no trained token.
            KeyboardInterrupt: re-raised after the step was rolled back (interrupt before the
                update) or completed and recorded (interrupt during the update or evaluation).
            Any exception of the loss or data: the step is rolled back first.
        """
        row, interrupted = self._optimizer_step()
        try:
            if self.eval_every and self.step_count % self.eval_every == 0:
                row.update(self.evaluate())
        except KeyboardInterrupt:
            interrupted = True  # the step stands; its row goes without eval metrics
        finally:
            self._record(row)
        if interrupted:
            raise KeyboardInterrupt
        if self.checkpoint_every and self.step_count % self.checkpoint_every == 0:
            self.save_checkpoint()
        return row

    def _optimizer_step(self) -> tuple[dict[str, float], bool]:
        self._rolled_back = False
        self.model.train()
        start = time.perf_counter()
        data_state = self.data.state_dict() if has_state(self.data) else None
        rng_state = capture_rng_state()
        try:
            batches = [self.data.next_batch() for _ in range(self.grad_accum_steps)]
            # The step normaliser, counted before any forward pass. With data parallelism it is
            # all-reduced (SUM) across ranks here, so every rank divides by the global count.
            units = torch.stack([torch.as_tensor(self.loss.num_units(b)) for b in batches]).sum()
            units = self._sum_across_ranks(units)
            num_units = int(units)
            if num_units < 1:
                raise ValueError(f"step {self.step_count + 1}: its {len(batches)} micro-batch(es) "
                                 "hold no trained token; check the loss masks of the data")
            loss_sum = None
            for batch in batches:
                share = self.loss(self.model, batch, units)
                share.backward()
                loss_sum = share.detach() if loss_sum is None else loss_sum + share.detach()
            # Data parallelism: the per-rank sums add up to the single-process step.
            self._sum_gradients_across_ranks()
            loss_sum = self._sum_across_ranks(loss_sum)
            grad_norm = self._clip_gradients()
            check_finite_update(self.step_count + 1, loss_sum, grad_norm)
        except BaseException:
            self.optimizer.zero_grad(set_to_none=True)
            if data_state is not None:
                self.data.load_state_dict(data_state)
            restore_rng_state(rng_state)
            self._rolled_back = True
            raise
        lr = float(self.optimizer.param_groups[0]["lr"])
        with sigint_held() as interrupt:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step_count += 1
        elapsed = time.perf_counter() - start
        row = {"step": self.step_count, "loss": float(loss_sum), "lr": lr,
               "grad_norm": float(grad_norm), "trained_tokens": num_units,
               "tokens_per_s": num_units / elapsed, "step_time_s": elapsed}
        return row, interrupt.received

    def _sum_across_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """SUM of a scalar over the data-parallel ranks (`value` itself with one rank)."""
        if self.world_size == 1:
            return value
        value = value.detach().to(device_of(self.model), copy=True)
        dist.all_reduce(value)
        return value

    def _sum_gradients_across_ranks(self) -> None:
        """Replace every gradient by its SUM over the ranks (in flat buckets)."""
        if self.world_size > 1:
            flat_collective([p.grad for group in self.optimizer.param_groups
                              for p in group["params"] if p.grad is not None], dist.all_reduce)

    def _clip_gradients(self) -> torch.Tensor:
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if not grads:
            raise ValueError("no parameter of the optimizer received a gradient; does the loss "
                             "depend on the optimizer's parameters?")
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(
                [p for group in self.optimizer.param_groups for p in group["params"]
                 if p.grad is not None], self.max_grad_norm, norm)
        return norm

    def _record(self, row: dict[str, float]) -> None:
        self._log.append(row)
        for callback in self.callbacks:
            callback(self, row)

    # ------------------------------------------------------------------ fit / evaluate

    def fit(self, num_steps: int) -> pd.DataFrame:
        """Take steps until `step_count == num_steps` (so a second call continues).

        A KeyboardInterrupt stops the run cleanly (see the module docstring), prints where it
        stopped and returns; call `fit` again to continue. At the end, a checkpoint is saved if
        `checkpoint_every` is set and the last step has none yet.

        Returns:
            `self.metrics`.

        Raises:
            ValueError: if `num_steps` is not a non-negative integer.
        """
        check_int("num_steps", num_steps, minimum=0)
        self.target_steps = num_steps
        from tqdm.auto import tqdm

        bar = tqdm(total=num_steps, initial=min(self.step_count, num_steps), unit="step",
                   desc="train", disable=not self.progress or self.rank != 0, dynamic_ncols=True)
        with preemption.deferring():  # a preemption signal waits for the end of its step
            try:
                while self.step_count < num_steps:
                    row = self.step()
                    bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}",
                                    refresh=False)
                    bar.update(1)
                    self._preemption_boundary()
            except KeyboardInterrupt:
                bar.close()
                if self._rolled_back:
                    what = (f"step {self.step_count + 1} was rolled back (gradients discarded, "
                            f"data position and RNG restored); the model, optimizer and "
                            f"scheduler are as after step {self.step_count}")
                else:
                    what = f"stopped after step {self.step_count} completed"
                print(f"Interrupted: {what}. Call fit({num_steps}) to continue.")
                return self.metrics
            finally:
                bar.close()
            if (self.checkpoint_every and self.step_count
                    and self._last_saved_step != self.step_count):
                self.save_checkpoint()
        return self.metrics

    def _preemption_boundary(self) -> None:
        """After a completed step: if preemption was requested, checkpoint and hand over to the
        original handler (`posttrain.core.preemption.step_boundary`). With several ranks, they first
        agree (one tiny all-reduce) whether any rank got the signal, so all of them enter the
        checkpoint's barrier at the same step; the hand-over happens where the signal arrived."""
        if self.world_size == 1:
            preemption.step_boundary(self._preemption_save)
            return
        flag = torch.tensor(int(preemption.requested()), device=device_of(self.model))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag:
            self._preemption_save()
            preemption.step_boundary()

    def _preemption_save(self) -> None:
        """The checkpoint before a preemption: only with a run_dir and stateful data, and only
        if the last step is not saved yet."""
        if (self.run_dir is not None and has_state(self.data)
                and self._last_saved_step != self.step_count):
            self.save_checkpoint()

    def evaluate(self) -> dict[str, float]:
        """Run `eval_fn(model)` in eval mode under `torch.no_grad()`; training mode and the RNG
        states are restored afterwards. Returns {"eval/<name>": value}.

        Raises:
            ValueError: if there is no eval_fn or it returns something other than a mapping of
                names to numbers.
        """
        if self.eval_fn is None:
            raise ValueError("this Trainer has no eval_fn")
        return evaluate_model(self.model, self.eval_fn)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Save everything needed to continue exactly into
        `run_dir/checkpoints/step_NNNNNN/` (atomically; older ones beyond `keep_last` deleted).

        With data parallelism every rank calls it: rank 0 writes, then all ranks wait at a
        barrier, so the checkpoint is on disk for every rank when it returns (the folder's path
        on every rank).

        Raises:
            ValueError: without a run_dir, or for data without `state_dict()`.
        """
        if self.run_dir is None:
            raise ValueError("save_checkpoint needs a run_dir")
        if not has_state(self.data):
            raise ValueError(f"{type(self.data).__name__} has no state_dict(); its position "
                             "could not be restored")
        train_state = {
            "version": TRAIN_STATE_VERSION,
            "step": self.step_count,
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "data": self.data.state_dict(),
            "rng": capture_rng_state(),
            "metrics": [dict(r) for r in self._log.rows],
        }
        meta = {"grad_accum_steps": self.grad_accum_steps, "loss": repr(self.loss),
                "world_size": self.world_size}
        path = self.run_dir / CHECKPOINT_DIR / checkpoint_name(self.step_count)
        if self.rank == 0:
            path = save_checkpoint(self.run_dir, self.step_count,
                                   model_state=self.model.state_dict(), train_state=train_state,
                                   keep_last=self.keep_last, meta=meta)
        barrier()
        self._last_saved_step = self.step_count
        return path

    def resume(self, path: str | os.PathLike | None = None) -> Path:
        """Load a checkpoint: model, optimizer, scheduler, data position, RNG states, step count
        and metrics rows (`metrics.jsonl` is rewritten to those rows).

        Args:
            path: a checkpoint folder, or a run folder (its latest checkpoint); default run_dir.

        Returns:
            The checkpoint folder loaded.

        Raises:
            FileNotFoundError: if there is no checkpoint there.
            ValueError: if the checkpoint and this trainer disagree (scheduler present in one
                only, another data set, ...).
        """
        path = resolve_checkpoint(path if path is not None else self.run_dir or "")
        ckpt = load_checkpoint(path)
        state = ckpt["train_state"]
        if (state["lr_scheduler"] is None) != (self.lr_scheduler is None):
            saved = "without" if state["lr_scheduler"] is None else "with"
            has = "one" if self.lr_scheduler is not None else "none"
            raise ValueError(f"{path} was saved {saved} an lr_scheduler; this trainer has {has}")
        self.model.load_state_dict(ckpt["model_state"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if not has_state(self.data):
            raise ValueError(f"{type(self.data).__name__} has no load_state_dict()")
        self.data.load_state_dict(state["data"])
        restore_rng_state(state["rng"])
        self.step_count = int(state["step"])
        self._log.reset(state["metrics"])
        self._last_saved_step = self.step_count
        return path

    def __repr__(self) -> str:
        return (f"Trainer(step_count={self.step_count}, loss={self.loss!r}, "
                f"grad_accum_steps={self.grad_accum_steps}, run_dir={self.run_dir})")
