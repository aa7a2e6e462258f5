"""Where an RL step's time goes: the timing, throughput and MFU columns of `RLTrainer` rows.

Notation: B = trajectories of the kept batch, T = padded tokens per row, N = non-embedding
parameters of the policy (`posttrain.core.timing.non_embedding_params`).

Every row of `RLTrainer.step` (and of `train_on_groups`) gets, in seconds of wall time
(time.perf_counter; synchronised at the phase boundaries only when the policy is on CUDA):

    time_rollout_s    generation: the `policy.generate` calls of the rollout (under a
                      ParallelPlan those of this rank's share of the prompts)
    time_scoring_s    the rest of the rollout: environment steps with their verifier / judge
                      calls, prompt rendering and group reward hooks (under a plan also the
                      gathering of the full weights and of every data rank's groups), and the
                      rollout engine's weight sync (also shown apart as `weight_sync_s`)
    time_logprobs_s   the frozen forward passes: reference log-probs, the trainer's own old
                      log-probs (low-bit rollout) and old values (PPO)
    time_update_s     every minibatch's forward, backward and optimizer step
    time_other_s      step_time_s minus the four above (exclusion, batching, advantages,
                      buffer, scheduler); the five columns sum to step_time_s

and, per second of step_time_s, `tokens_per_s` (sampled tokens), `trained_tokens_per_s`
(response tokens the loss covers, counted once per step) and `flops_per_s` (the step's model
FLOPs), and `mfu` = flops_per_s / (measured matmul peak x devices). Every column depends on the
wall clock (names ending in `_s`, and `mfu`): runs that must agree bit for bit compare rows
without them. FLOPs by the convention of `posttrain.core.timing.step_flops` (6 N D / 2 N D,
Kaplan et al. 2020, + the attention term 12 / 4 L d_attn per token per position of its
sequence, PaLM appendix B; L and d_attn from `attention_dims`), each sequence at its own real
length n (every token of a sequence of n tokens attends over n positions: n^2 per sequence):

    rollout   2 N x (prompt + completion tokens of every trajectory sampled)
              + 4 L d_attn x sum of (prompt + completion)^2 over those trajectories
    logprobs  (2 N x real tokens + 4 L d_attn x sum of n_b^2) of the kept batch x frozen passes
    update    (6 N x real tokens + 12 L d_attn x sum of n_b^2) of the kept batch x ppo_epochs

n_b = the real (unpadded) tokens of row b of the kept batch (its attention_mask_BT).

`devices` is the world size under a ParallelPlan (the work is split), else 1 (ranks without a
plan repeat the same work). Phases a step does not have (no reference, no kept group) are 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from posttrain.core.timing import (
    PhaseTimer,
    attention_dims,
    matmul_peak_flops,
    mfu,
    non_embedding_params,
    on_cuda,
    step_flops,
)
from posttrain.rl.environment import Group

__all__ = ["RL_TIME_PHASES", "TIMING_COLUMNS", "TimedGeneration", "new_step_timer", "timing_row"]

RL_TIME_PHASES = ("rollout", "scoring", "logprobs", "update")
"""The measured phases of an RL step, in order; `time_other_s` is the remainder."""

TIMING_COLUMNS = tuple(f"time_{p}_s" for p in RL_TIME_PHASES) + (
    "time_other_s",
    "tokens_per_s",
    "trained_tokens_per_s",
    "flops_per_s",
    "mfu",
)
"""The columns `timing_row` adds to each RL metrics row (stable names)."""


class TimedGeneration:
    """A policy whose `generate` calls are charged to `timer`'s "rollout" phase; every other
    attribute (tokenizer, spec, model, ...) is the wrapped policy's."""

    def __init__(self, policy: Any, timer: PhaseTimer) -> None:
        self._policy, self._timer = policy, timer

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self._timer.phase("rollout"):
            return self._policy.generate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)


def new_step_timer(model) -> PhaseTimer:
    """A `PhaseTimer` that synchronises CUDA only when `model` lives on a GPU."""
    return PhaseTimer(cuda=on_cuda(model))


def timing_row(
    timer: PhaseTimer,
    *,
    model,
    groups: Sequence[Group],
    batch: dict[str, Tensor] | None,
    frozen_passes: int,
    ppo_epochs: int,
    collect_s: float,
    step_s: float,
    planned: bool = False,
) -> dict[str, float]:
    """The timing, throughput and FLOP columns (`TIMING_COLUMNS`) of one RL step.

    Args:
        timer: the step's timer ("rollout" holds generation when it was timed apart,
            "logprobs" and "update" the frozen passes and the update).
        model: the policy's model (N, the device of the peak measurement).
        groups: every group the rollout produced (excluded ones too: they were sampled).
        batch: the kept batch (`make_batch`: attention_mask_BT, response_mask_BT), or None.
        frozen_passes: forward passes over the batch outside the update (reference, trainer
            log-probs, old values). ppo_epochs: passes of the update over the batch.
        collect_s: seconds of the whole rollout; what generation did not take is scoring.
        step_s: the step's wall seconds (step_time_s).
        planned: the policy runs under a ParallelPlan (MFU counts every rank's device).

    Raises:
        ValueError: for a negative count or time.
    """
    if min(frozen_passes, ppo_epochs, collect_s, step_s) < 0:
        raise ValueError(
            f"frozen_passes={frozen_passes!r}, ppo_epochs={ppo_epochs!r}, "
            f"collect_s={collect_s!r}, step_s={step_s!r}; all must be >= 0"
        )
    devices = dist.get_world_size() if planned and dist.is_initialized() else 1
    generation = timer.seconds.get("rollout")
    if generation is None:  # generation was not timed apart (given groups)
        timer.add("rollout", collect_s)
    else:
        timer.add("scoring", max(collect_s - generation, 0.0))
    row: dict[str, float] = timer.row(step_s, RL_TIME_PHASES)
    n = non_embedding_params(model)
    layers, width = attention_dims(model)
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for g in groups for t in g]
    rows_B = batch["attention_mask_BT"].sum(-1) if batch is not None else None
    real = int(rows_B.sum()) if rows_B is not None else 0
    real_span = int((rows_B * rows_B).sum()) if rows_B is not None else 0
    trained = int(batch["response_mask_BT"].sum()) if batch is not None else 0
    dims = dict(num_layers=layers, attn_dim=width)
    context = sum(lengths)
    flops = (
        step_flops(n, context, span=sum(k * k for k in lengths), kind="forward", **dims)
        + step_flops(n, real, span=real_span, kind="forward", **dims) * frozen_passes
        + step_flops(n, real, span=real_span, kind="train", **dims) * ppo_epochs
    )
    device = next(model.parameters()).device
    sampled_tokens = sum(
        sum(t.completion_mask) if t.completion_mask is not None else len(t.completion_ids)
        for g in groups
        for t in g
    )
    per_s = (lambda x: x / step_s) if step_s > 0 else (lambda x: float("nan"))
    row.update(
        tokens_per_s=per_s(sampled_tokens),
        trained_tokens_per_s=per_s(trained),
        flops_per_s=per_s(flops),
        mfu=mfu(flops, step_s, peak_flops_per_s=matmul_peak_flops(device), devices=devices),
    )
    return row
