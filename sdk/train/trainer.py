"""The training loop: one optimizer step at a time, with gradient accumulation, clipping, a
learning-rate schedule, evaluation, metrics and checkpoints for exact resume.

The `Trainer` takes built parts (model, optimizer, data loader, scheduler) and a loss chosen by
name from `posttrain.train.losses`. One step:

    batches = [data.next_batch() for _ in range(grad_accum_steps)]   # all fetched first
    units = sum(loss.num_units(b) for b in batches)                  # trained tokens of the step
    for b in batches:
        loss(model, b, units).backward()                             # share = loss_sum / units
    update(loss_sum)   # the engine's: clip grad norm; optimizer.step(); lr_scheduler.step();
                       # optimizer.zero_grad()

so the gradient is that of the token mean over the whole step, whatever the micro-batching.

Data parallelism: when a `torch.distributed` default process group is initialised with more
than one rank (`posttrain.launch.submit` does it in a job; gloo on CPU, NCCL on GPUs), every
rank holds a full replica of the model and optimizer and its own share of each global batch (an
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
saves a checkpoint of the last whole step (when checkpointing is on), sets `interrupted` and
returns; calling it again continues as if nothing happened. The loop itself (fit, metrics,
checkpoints, resume, preemption, rank-0 writes, run-folder rules) is the training engine's,
`posttrain.train.engine.Engine`, shared with `RLTrainer`; this class provides the step.

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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from posttrain.core.checkpoint import capture_rng_state, restore_rng_state
from posttrain.core.checks import check_int
from posttrain.core.preemption import sigint_held
from posttrain.core.timing import (
    attention_dims,
    matmul_peak_flops,
    mfu,
    non_embedding_params,
    step_flops,
)
from posttrain.train.converters import applied_converters, checkpoint_state, load_checkpoint_state
from posttrain.train.engine import Engine
from posttrain.train.hooks import evaluate_model, has_state, seed_all, stable_repr
from posttrain.train.losses import SFTCrossEntropy, TrainingLoss, get_loss
from posttrain.train.memory_check import check_memory
from posttrain.train.parallel import ParallelPlan
from posttrain.train.plan_compat import resolve_runtime
from posttrain.train.runtime import Runtime

__all__ = ["Trainer"]


# --------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------


class Trainer(Engine):
    """Runs optimizer steps on built parts; records metrics; saves and resumes checkpoints.

    Args:
        model: a module; `loss` decides how it is called (SFT: `model(input_ids,
            mask=attention_mask, input_pos=position_ids)` -> logits [B, T, V]).
        optimizer: built over the model's trainable parameters, after `plan.parallelize` and
            any converter (exactly those tensors: checked by identity).
        data: has `next_batch()` (endless); `state_dict()` / `load_state_dict()` to checkpoint
            and to put the position back after an interrupted step
            (`posttrain.data.loader.SFTLoader`).
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
        progress: show a `tqdm.auto` progress bar in `fit` (a widget in Jupyter); when stderr
            is not a terminal, plain lines instead (`posttrain.core.progress`).
        seed: seeds Python `random`, numpy and torch's global RNGs here (dropout, sampling in
            losses); a resumed run restores the checkpoint's RNG states instead.
        callbacks: each is called `callback(trainer, row)` after every step (live plots).
        resume: False: start fresh. True: continue from the latest checkpoint in `run_dir` if
            there is one (the requeue idiom). A path: continue from that checkpoint folder or
            the latest one of that run folder.

        runtime: the `PlanRuntime` of `model` under a plan (`runtime =
            plan.parallelize(model, spec=spec)`, before the optimizer was built; `model` must
            be `runtime.model`), or None: a `LocalRuntime` (no plan).
        plan: deprecated (one release): the `ParallelPlan` already applied to `model` by the
            deprecated `plan.apply(model)`; checked against the applied plan.

    Data parallelism (see the module docstring) needs no option: it follows the initialised
    `torch.distributed` process group. Under a plan, the data must be sharded over the plan's
    data-parallel ranks (`runtime.data_rank`, `runtime.data_size`); FSDP2 and TP reduce the
    gradients and the token normaliser is summed over the data-parallel ranks only.
    `callbacks` and `eval_fn` run on every rank.

    Attributes:
        step_count: optimizer steps taken.
        rank, world_size: this process's place in the data-parallel group (0 and 1 without one).
        metrics: the per-step rows as a DataFrame (columns step, loss, lr, grad_norm,
            trained_tokens, tokens_per_s, step_time_s, mfu, eval/...).

    Metrics of a step: loss = token mean of the step's loss (before the update), lr = the lr the
    step used, grad_norm = global L2 norm before clipping, trained_tokens = the step's
    normaliser (tokens for SFT; pairs or rows for preference losses), step_time_s = wall
    seconds from data fetch to the end of the update, tokens_per_s = the step's non-padding
    tokens the loss trains on (SFT: the normaliser; preference losses: their `num_tokens`, the
    response tokens; summed over ranks) / step_time_s, in tokens per second (as torchtune
    reports it), and mfu = model FLOPs utilisation (a fraction) by the convention of
    `posttrain.core.timing.step_flops` (docs/benchmarks/README.md "Conventions", as RL's
    `mfu`): (6 N x those tokens + 12 L d_attn S) / (step_time_s x measured fp32 matmul peak
    FLOP/s x processes), L and d_attn the model's attention layers and width
    (`attention_dims`), S = the loss's `attention_span` of the step: the sum over those tokens
    of the length of the sequence each sits in, at the step's actual lengths (SFT: the
    document's length in packed rows, which the position ids give; in unpacked right-padded
    rows the row length T, padding included, as the batch does not say where a row's real
    tokens end; preference losses: each row's real length). A loss without `attention_span`
    counts 6 N only. Prompt tokens, which run
    forward and backward without a loss, are not counted, so it is a lower bound. Under a
    pipeline plan N and L are this stage's only.

    Raises:
        ValueError: for bad options, a `run_dir` that holds a run while `resume` is False,
            data sharded for another world size or rank than the process group's, an
            optimizer that does not hold exactly the model's current trainable parameters
            (named; `posttrain.train.optimizer_check`), a `runtime` of another model, or a
            model split by a plan without its runtime.
        TypeError: for a `data` without `next_batch`, a `loss` that is neither, or a `runtime`
            that is not a `Runtime`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        data: Any,
        loss: str | TrainingLoss = "sft_ce",
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        run_dir: str | os.PathLike | None = None,
        eval_fn: Callable[[nn.Module], Mapping[str, float]] | None = None,
        eval_every: int = 0,
        checkpoint_every: int = 0,
        keep_last: int | None = 2,
        tensorboard: bool = False,
        progress: bool = True,
        seed: int = 0,
        callbacks: Sequence[Callable[[Trainer, dict], None]] = (),
        resume: bool | str | os.PathLike = False,
        runtime: Runtime | None = None,
        plan: ParallelPlan | None = None,
    ) -> None:
        if not callable(getattr(data, "next_batch", None)):
            raise TypeError(
                f"data must have a next_batch() method (e.g. posttrain.data.loader."
                f"SFTLoader); got {type(data).__name__}"
            )
        if isinstance(loss, str):
            loss = get_loss(loss)
        elif not isinstance(loss, TrainingLoss):
            raise TypeError(
                f"loss must be a registered name or a TrainingLoss (num_units(batch) "
                f"and __call__(model, batch, num_units_in_step)); got {loss!r}"
            )
        check_int("grad_accum_steps", grad_accum_steps, minimum=1)
        check_int("eval_every", eval_every, minimum=0)
        if eval_every and eval_fn is None:
            raise ValueError(f"eval_every={eval_every} needs an eval_fn")
        if checkpoint_every and not has_state(data):
            raise ValueError(
                f"checkpoint_every needs data with state_dict()/load_state_dict() "
                f"(to resume at the same position); {type(data).__name__} has none"
            )
        runtime = resolve_runtime(model, runtime=runtime, plan=plan)
        self._setup_engine(
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            max_grad_norm=max_grad_norm,
            run_dir=run_dir,
            checkpoint_every=checkpoint_every,
            keep_last=keep_last,
            progress=progress,
            callbacks=callbacks,
            resume=resume,
            runtime=runtime,
            tensorboard=tensorboard,
        )
        self.model, self.data, self.loss = model, data, loss
        self._check_data_shard(data)
        if isinstance(loss, SFTCrossEntropy):
            check_memory(  # under a plan with a spec: refuse early
                runtime,
                data,
                phase="sft",
                loss_chunk_tokens=loss.loss_chunk_tokens,
                optimizer=optimizer,
            )
        if eval_fn is not None and runtime.pipeline is not None:
            raise ValueError(
                f"eval_fn with {runtime.plan}: a pipeline stage holds part of the "
                "model; evaluate the exported full model instead "
                "(runtime.full_state_dict())"
            )
        self.grad_accum_steps, self.seed = grad_accum_steps, seed
        self._flops_n: int | None = None
        self._flops_attention = (0, 0)
        self._flops_device = torch.device("cpu")
        self.eval_fn, self.eval_every = eval_fn, eval_every
        seed_all(seed)
        runtime.share_initial_weights()  # replicas: rank 0's weights (a plan's are already)
        self._start(resume)

    # ------------------------------------------------------------------ the step

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
        except BaseException:
            self._record(row)  # the step stands: its row is kept, then the error
            raise
        return self._complete_step(row, interrupted=interrupted)

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
            local_counts = self._flop_counts(batches)
            if num_units < 1:
                raise ValueError(
                    f"step {self.step_count + 1}: its {len(batches)} micro-batch(es) "
                    "hold no trained token; check the loss masks of the data"
                )
            loss_sum: torch.Tensor | None = None
            for i, batch in enumerate(batches):
                self._set_gradient_sync(i == len(batches) - 1)
                share = self.runtime.forward_backward(self.loss, batch, units)  # or the pipeline
                loss_sum = share.detach() if loss_sum is None else loss_sum + share.detach()
            assert loss_sum is not None, "grad_accum_steps >= 1 micro-batches ran"
            # Data parallelism: the per-rank sums add up to the single-process step.
            self._sum_gradients_across_ranks()
            loss_sum = self._sum_across_ranks(loss_sum)
        except BaseException:
            self._roll_back(data_state, rng_state)
            raise
        with sigint_held() as interrupt:  # from here the step is never cut in half
            try:
                grad_norm, lr = self.update(loss_sum)
            except BaseException:  # a refused update (non-finite): nothing was applied
                self._roll_back(data_state, rng_state)
                raise
            self.step_count += 1
        elapsed = time.perf_counter() - start
        # after the clock stopped: the all-reduce of the token counts and the (cached) peak
        tokens, span = (int(x) for x in self._sum_across_ranks(local_counts).tolist())
        row = {
            "step": self.step_count,
            "loss": float(loss_sum),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "trained_tokens": num_units,
            "tokens_per_s": tokens / elapsed,
            "step_time_s": elapsed,
            "mfu": self._step_mfu(tokens, span, elapsed),
        }
        return row, interrupt.received

    def _roll_back(self, data_state: dict[str, Any] | None, rng_state: Any) -> None:
        """Undo a step that applied nothing: gradients, data position and RNG states."""
        self.optimizer.zero_grad(set_to_none=True)
        if data_state is not None:
            self.data.load_state_dict(data_state)
        restore_rng_state(rng_state)
        self._rolled_back = True

    def _flop_counts(self, batches: list[Any]) -> torch.Tensor:
        """This rank's [tokens, span] of the step (int64 [2], summed over the micro-batches):
        the loss's `num_tokens` (else its `num_units`) and `attention_span` (else 0)."""
        count_tokens = getattr(self.loss, "num_tokens", self.loss.num_units)
        count_span = getattr(self.loss, "attention_span", None)
        rows = []
        for batch in batches:  # tensors on the batch's device: no host sync in the step
            tokens = torch.as_tensor(count_tokens(batch)).to(torch.int64)
            span = torch.zeros_like(tokens) if count_span is None else count_span(batch)
            rows.append(torch.stack([tokens, torch.as_tensor(span).to(tokens)]))
        return torch.stack(rows).sum(0)

    def _step_mfu(self, tokens: int, span: int, seconds: float) -> float:
        """MFU of a step that trained on `tokens` tokens of attention span `span` in `seconds`
        wall seconds: `posttrain.core.timing.mfu` of `step_flops` (kind "train"; N =
        non-embedding parameters, L and d_attn from `attention_dims`, counted once) over the
        measured matmul peak (FLOP/s) of the model's device x the processes of the default
        group (1 without one)."""
        if self._flops_n is None:
            model = self._module()
            param = next(model.parameters(), None)
            self._flops_n = non_embedding_params(model)
            self._flops_attention = attention_dims(model)
            self._flops_device = param.device if param is not None else torch.device("cpu")
        devices = dist.get_world_size() if dist.is_initialized() else 1
        layers, width = self._flops_attention
        return mfu(
            step_flops(
                self._flops_n, tokens, span=span, num_layers=layers, attn_dim=width, kind="train"
            ),
            seconds,
            peak_flops_per_s=matmul_peak_flops(self._flops_device),
            devices=devices,
        )

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

    # ------------------------------------------------------------------ engine hooks
    def _module(self) -> nn.Module:
        return self.model

    def _model_state(self) -> dict[str, Any]:
        return checkpoint_state(self.model)  # with adapters: only what trains

    def _load_model_state(self, state: dict[str, Any]) -> None:
        load_checkpoint_state(self.model, state)

    def _extra_state(self) -> dict[str, Any]:
        return {"data": self.data.state_dict()}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if not has_state(self.data):
            raise ValueError(f"{type(self.data).__name__} has no load_state_dict()")
        self.data.load_state_dict(state["data"])

    def _check_can_save(self) -> None:
        if not has_state(self.data):
            raise ValueError(
                f"{type(self.data).__name__} has no state_dict(); its position "
                "could not be restored"
            )

    def _fixed_settings(self) -> dict[str, Any]:
        return {
            "grad_accum_steps": self.grad_accum_steps,
            "loss": stable_repr(self.loss),
            "converters": list(applied_converters(self.model)),
        }  # LoRA, FP8, QAT, ...

    def _postfix(self, row: dict[str, Any]) -> dict[str, str]:
        return {"loss": f"{row['loss']:.4f}", "lr": f"{row['lr']:.2e}"}

    def __repr__(self) -> str:
        return (
            f"Trainer(step_count={self.step_count}, loss={self.loss!r}, "
            f"grad_accum_steps={self.grad_accum_steps}, run_dir={self.run_dir})"
        )
