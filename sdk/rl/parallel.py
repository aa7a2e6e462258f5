"""RL under a `ParallelPlan`: how `RLTrainer` samples, scores and updates when the policy (and
the reference) are split over the ranks of a job.

Notation: B = trajectories of the step (all data-parallel ranks together), T = padded tokens per
row, W = data-parallel ranks (`plan.data_parallel_size`), r = this rank's index among them.

One step under a plan (every rank runs it; the collectives are marked *):

    rollout copy  <- full_state_dict(policy)*          one gather per step, into a plain
                                                       (unsharded) copy of the policy per rank;
                                                       with rollout_quantization, the rollouts
                                                       sample from a quantised copy of it
    local groups  = collect_groups(copy, builders[r-th of W equal slices],
                                   seed = step_seed * W + r)   # no collective per token
    groups        = all_gather(local groups)*          in data-rank order, group ids renumbered
                                                       0..P-1: every rank holds the global batch
    ref logprobs, old values: rank r scores its contiguous share of the B rows (FSDP2/TP
                  forward*), the shares are all-gathered*
    advantages    on the global batch (identical on every rank, as in one process)
    each minibatch (the same shuffled rows on every rank): rank r trains its contiguous share
                  of the rows, in the same number of micro-batches on every rank (a rank with
                  fewer rows runs a padding micro-batch that trains nothing); FSDP2/TP SUM the
                  policy's gradients*, the value head's are SUMmed over the data ranks*, the
                  normaliser is the minibatch's global `step_units`; metrics are SUMmed*
                  (ratio_max: MAX*).

Why a plain copy for the rollouts: generating with the sharded policy would all-gather every
layer's weights for every sampled token (FSDP2) or all-reduce every layer's output (TP); one
gather of the full weights per step costs one forward's worth of communication, after which
each data-parallel rank samples its own prompts with the unchanged KV-cache sampler. The price
is one full copy of the weights per rank during the rollout (what verl's hybrid engine and
OpenRLHF's vLLM workers hold too, in their own layout). Tensor-parallel ranks of one data rank
sample the same prompts with the same seed and get the same groups.

With W = 1 (tp only) the rollouts are exactly those of one process (same seed, same weights,
same batch). With W > 1 each data rank samples its slice with its own seed, so the step's groups
are those of W one-process `collect_groups` calls, one per slice (`rollout_seed`), not of one
call over all prompts (a batched sampler's random draws depend on the batch).

The sampler-consistent log-prob contract holds as in one process: the old log-probs are the
sampler's own (from the plain copy, same temperature and top-p) and the training log-probs come
from the split policy, which computes the same distribution; they differ by float rounding
(tests/test_plans_trainers.py: at most 9.5e-7 on TINY under dp_shard=2, tp=2 and dp_shard=2 x
tp=2, the same as in one process; the bound is 1e-5).

Axes: dp_replicate, dp_shard, tp, sp and ep; pp > 1 is refused (a pipelined policy has no plain
forward to score with).
  * sp: the sp ranks of a data rank share its prompts (they are not data-parallel: W counts
    them once), sample them with the same seed and get the same groups; the split policy's
    forward returns the full logits on every sp rank (`posttrain.train.sequence_parallel`), so
    log-probs, entropy and losses are those of one process. A value head (PPO) is refused
    under sp: it reads model.norm's output through a hook, inside the sequence-sliced region.
  * ep (MoE): the ep ranks are data ranks (W includes them); the rollout copy is a plain MoE
    model of the same spec with the experts gathered by `full_state_dict`. The RL losses add
    no router load-balancing loss (which would be per rank, not invariant to the split).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.core.distributed import flat_collective
from posttrain.rl.algorithms import accumulate_metrics, step_units
from posttrain.rl.environment import Group
from posttrain.rl.lowbit_rollout import refresh_sampler
from posttrain.rl.rollout import collect_groups
from posttrain.train.sharding import check_plan, plan_state

__all__ = ["setup_plan", "collect_under_plan", "frozen_forward_under_plan",
           "optimizer_step_under_plan", "data_shares", "rollout_seed", "gather_groups",
           "gather_rows", "padding_rows", "reduce_metrics", "sum_grads_over_data_ranks",
           "plain_copy"]


# --------------------------------------------------------------------------------------------
# The parts of RLTrainer that differ under a plan (`trainer` is the RLTrainer)
# --------------------------------------------------------------------------------------------


def setup_plan(trainer: Any, plan: Any) -> None:
    """Check the plan against the trainer's policy, broadcast the value head, build
    the rollout copy (`trainer.rollout_policy`) and the reference split by the same plan
    (`trainer.reference`, when algo.kl_coef > 0 and the policy has no LoRA adapters: a LoRA
    policy's reference is its own base, scored with the adapters disabled).

    Raises:
        ValueError: a plan not applied to the policy (or another one), prompts_per_step not
            divisible by the data-parallel size, a split value head, pp > 1, or sp > 1 with a
            value head (named, with the allowed values). The optimizer is checked for every
            trainer by the engine (`posttrain.train.optimizer_check`).
    """
    from torch.distributed.tensor import DTensor

    from posttrain.models.lora import has_adapters
    from posttrain.policy.policy import Policy

    policy, head = trainer.policy, trainer.value_head
    check_plan(policy.model, plan)
    state = plan_state(policy.model)
    if state.plan.pp > 1:
        raise ValueError(f"RLTrainer under {state.plan}: pp={state.plan.pp} is not supported (a "
                         "pipelined policy has no plain forward to score the rollouts with); "
                         "allowed pp for RL: 1 (split with dp_replicate, dp_shard, tp, sp or ep)")
    if head is not None and state.plan.sp > 1:
        raise ValueError(f"RLTrainer under {state.plan}: a value head with sp={state.plan.sp} "
                         "is not supported: the head reads the hidden state of model.norm "
                         "through a hook, inside the sequence-parallel region, where each sp "
                         "rank holds only its slice of the sequence; allowed sp for PPO: 1 "
                         "(GRPO, without a value head, runs under sp)")
    ranks = state.plan.data_parallel_size
    if trainer.prompts_per_step % ranks:
        raise ValueError(f"prompts_per_step={trainer.prompts_per_step} must be divisible by the "
                         f"data-parallel size {ranks} of {state.plan}: each data rank samples "
                         "prompts_per_step / data_parallel_size prompts")
    if head is not None:
        if any(isinstance(p, DTensor) for p in head.parameters()):
            raise ValueError("the value head must stay a plain module under a plan (the trainer "
                             "sums its gradients over the data-parallel ranks); apply the plan "
                             "to policy.model only")
        flat_collective(list(head.parameters()), lambda flat: dist.broadcast(flat, src=0))
    trainer.rollout_policy = Policy(plain_copy(policy.model, policy.spec), policy.tokenizer,
                                    policy.spec)
    trainer.sampler_policy = trainer.rollout_policy  # a quantised copy after the first rollout
    trainer._refresh_rollout_policy()
    if trainer.algo.kl_coef > 0 and not has_adapters(policy.model):
        # the starting weights, split by the same plan, frozen
        reference = plain_copy(policy.model, policy.spec)
        reference.load_state_dict(trainer.rollout_policy.model.state_dict())
        state.plan.apply(reference, spec=policy.spec, mesh=state.mesh)
        trainer.reference = reference.eval().requires_grad_(False)


def collect_under_plan(trainer: Any, builders: Sequence, step_seed: int,
                       options: dict[str, Any]) -> list[Group]:
    """The step's groups: this data rank's slice of `builders` sampled with the refreshed plain
    copy, or a quantised copy of it (`refresh_sampler`; seed `rollout_seed`), then every data
    rank's groups (collectives)."""
    trainer._refresh_rollout_policy()
    rank, ranks = trainer.data_rank_and_size
    mine = data_shares(len(builders), ranks)[rank]
    local = collect_groups(refresh_sampler(trainer), builders[mine.start:mine.stop],
                           seed=rollout_seed(step_seed, rank, ranks), **options)
    if ranks == 1:
        return local
    return gather_groups(local, rank=rank, offset=mine.start,
                         group=trainer.plan_state.data_group)


def frozen_forward_under_plan(trainer: Any, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Reference log-probs and old values of the global batch: this data rank scores its
    contiguous share of the rows (a padding row when it has none), the shares are gathered."""
    rank, ranks = trainer.data_rank_and_size
    shares = data_shares(batch["scores_B"].shape[0], ranks)
    mine = shares[rank]
    rows = ({k: v[mine.start:mine.stop] for k, v in batch.items()} if len(mine)
            else padding_rows(batch))
    out = trainer._frozen_outputs(rows)
    if ranks == 1 or not out:
        return out
    return gather_rows(out, [len(s) for s in shares], trainer.plan_state.data_group)


def optimizer_step_under_plan(trainer: Any, mb: dict[str, Tensor]) -> dict[str, float]:
    """One optimizer step on a minibatch of the global batch: this data rank's contiguous share
    of its rows, in as many micro-batches as the largest share needs (a padding micro-batch runs
    the same forward and backward and contributes nothing); FSDP2/TP reduce the policy's
    gradients, the value head's are summed here, the metrics too. Returns the metrics."""
    algo, model, head = trainer.algo, trainer.policy.model, trainer.value_head
    model.train()
    units = step_units(mb["response_mask_BT"], algo.loss_agg_mode)  # the whole minibatch
    units_tokens = mb["response_mask_BT"].sum()
    rank, ranks = trainer.data_rank_and_size
    shares = data_shares(mb["scores_B"].shape[0], ranks)
    mine, largest = shares[rank], len(shares[0])
    micro = trainer.micro_batch_size or largest
    rounds = -(-largest // micro)
    totals: dict[str, Tensor] = {}
    for i in range(rounds):
        rows = mine[i * micro:(i + 1) * micro]
        m = {k: v[rows.start:rows.stop] for k, v in mb.items()} if len(rows) else padding_rows(mb)
        trainer._set_gradient_sync(i == rounds - 1)
        loss, metrics, logprobs_BT, values_BT = trainer._micro_batch_loss(model, m, units, head)
        if not len(rows):  # padding: the same graph and collectives, no contribution
            loss = logprobs_BT.sum() * 0.0 + (0.0 if values_BT is None else values_BT.sum() * 0.0)
            metrics = {k: torch.zeros_like(v) for k, v in metrics.items()}
        loss.backward()
        accumulate_metrics(totals, metrics, m["response_mask_BT"].sum() / units_tokens)
    group = trainer.plan_state.data_group
    if group is not None:
        totals = reduce_metrics(totals, group)
        if head is not None:
            sum_grads_over_data_ranks(head, group)
    trainer._sum_gradients_across_ranks()  # the plan's own syncs (experts over dp x sp ranks)
    grad_norm = trainer.clip_and_check(totals["loss"])
    totals["lr"] = torch.tensor(float(trainer.optimizer.param_groups[0]["lr"]))
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    totals["grad_norm"] = grad_norm
    return {k: float(v) for k, v in totals.items()}


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------


def data_shares(n: int, ranks: int) -> list[range]:
    """`ranks` contiguous slices of range(n), sizes differing by at most one (the first ones
    larger), as `torch.tensor_split` cuts; slices may be empty when n < ranks."""
    size, extra = divmod(n, ranks)
    bounds = [r * size + min(r, extra) for r in range(ranks + 1)]
    return [range(bounds[r], bounds[r + 1]) for r in range(ranks)]


def rollout_seed(step_seed: int, rank: int, ranks: int) -> int:
    """The sampling seed of data rank `rank` of `ranks` for a step whose one-process seed is
    `step_seed` (itself when ranks == 1; distinct for every (step, rank))."""
    return step_seed * ranks + rank


def gather_groups(local: Sequence[Group], *, rank: int, offset: int, group: Any) -> list[Group]:
    """Every data rank's groups, in data-rank order, with group ids renumbered to their global
    index (`offset` = this rank's first; a collective over `group`, the data-parallel group)."""
    renumbered = [Group([dataclasses.replace(t, group_id=offset + i) for t in g])
                  for i, g in enumerate(local)]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (rank, renumbered), group=group)
    return [g for _, groups in sorted(gathered, key=lambda item: item[0]) for g in groups]


def padding_rows(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The batch's first row with its response mask cleared: a micro-batch that runs the
    forward and backward of a rank without rows and trains nothing."""
    rows = {k: v[:1].clone() for k, v in batch.items()}
    rows["response_mask_BT"] = torch.zeros_like(rows["response_mask_BT"])
    return rows


def gather_rows(local: dict[str, Tensor], sizes: Sequence[int], group: Any) -> dict[str, Tensor]:
    """Concatenate every data rank's row tensors ([sizes[r], ...] each, in data-rank order; a
    collective over `group`): each is padded to the largest share, all-gathered, and cut back."""
    out = {}
    most = max(sizes)
    for key in sorted(local):
        mine = local[key]
        padded = torch.zeros((most, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        rows = min(most, mine.shape[0])
        padded[:rows] = mine[:rows]
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        out[key] = torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])
    return out


def reduce_metrics(totals: dict[str, Tensor], group: Any) -> dict[str, Tensor]:
    """A minibatch's metrics over the data ranks: step shares and token-weighted means are
    SUMmed, `ratio_max` is the MAX (a collective over `group`; the keys are the same on every
    rank)."""
    keys = sorted(k for k in totals if k != "ratio_max")
    flat = torch.stack([totals[k].float().reshape(()) for k in keys])
    dist.all_reduce(flat, group=group)
    out = dict(zip(keys, flat.unbind()))
    if "ratio_max" in totals:
        top = totals["ratio_max"].float().reshape(1).clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        out["ratio_max"] = top[0]
    return out


def sum_grads_over_data_ranks(module: nn.Module, group: Any) -> None:
    """SUM the gradients of a replicated (plain) module over the data ranks, in place; a
    parameter without a gradient on this rank counts as zero."""
    params = list(module.parameters())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat_collective([p.grad for p in params], lambda flat: dist.all_reduce(flat, group=group))


def plain_copy(model: nn.Module, spec: Any) -> nn.Module:
    """A plain (unsharded) decoder of `spec` on `model`'s device and dtype, for the full weights
    of a split model (its own initialisation is overwritten on the first load)."""
    from posttrain.models.specs import build_model

    param = next(model.parameters())
    return build_model(spec, device=param.device, dtype=param.dtype, seed=0)
