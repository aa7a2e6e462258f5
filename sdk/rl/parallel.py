"""RL under a `ParallelPlan`: how `RLTrainer` samples, scores and updates when the policy (and
the reference) are split over the ranks of a job (`RLTrainer(..., runtime=plan.parallelize(
policy.model, spec=policy.spec))`).

The trainer runs one step, with or without a plan: every rank samples, scores and trains its
data rank's share through its `runtime` (`posttrain.train.runtime`); with one data rank (no
plan, or tp/sp only) the shares are the whole batch and every collective is a no-op. This
module holds the pieces: the setup under a plan (`plan_rollout_parts`), the reference
(`frozen_reference`, `checked_reference`), the shares and seeds of the data ranks, the gathering
of groups and the padding rows. It applies no plan: the caller splits the policy and the
reference alike, as `posttrain.rl.trainer`'s docstring shows.

Notation: B = trajectories of the step (all data-parallel ranks together), T = padded tokens per
row, W = data-parallel ranks (`runtime.data_size`), r = this rank's index among them
(`runtime.data_rank`).

One step under a plan (every rank runs it; the collectives are marked *):

    rollout copy  <- runtime.full_state_dict()*        one gather per step, into a plain
                                                       (unsharded) copy of the policy per rank;
                                                       with rollout_quantization, the rollouts
                                                       sample from a quantised copy of it
    local groups  = collect_groups(copy, builders[r-th of W equal slices],
                                   seed = step_seed * W + r)   # no collective per token
    groups        = gather_groups(local groups)*       in data-rank order, group ids renumbered
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
(tests/rl/test_plans_trainers.py: at most 9.5e-7 on TINY under dp_shard=2, tp=2 and dp_shard=2 x
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

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from posttrain.core.distributed import flat_collective
from posttrain.models.lora import has_adapters
from posttrain.models.specs import ModelSpec
from posttrain.policy.policy import Policy
from posttrain.rl.environment import Group
from posttrain.train.collectives import gather_rows, reduce_metrics, sum_grads_over_group
from posttrain.train.sharding import parallelize

if TYPE_CHECKING:
    from posttrain.rl.config import RLAlgorithm
    from posttrain.train.runtime import PlanRuntime, Runtime

__all__ = [
    "plan_rollout_parts",
    "frozen_reference",
    "checked_reference",
    "uses_reference",
    "data_shares",
    "rollout_seed",
    "gather_groups",
    "padding_rows",
    "plain_copy",
    "gather_rows",
    "reduce_metrics",
    "sum_grads_over_data_ranks",
]

sum_grads_over_data_ranks = sum_grads_over_group
"""The earlier name of `posttrain.train.collectives.sum_grads_over_group`."""


def plan_rollout_parts(
    runtime: PlanRuntime,
    policy: Policy,
    *,
    value_head: nn.Module | None,
    prompts_per_step: int,
) -> Policy:
    """Check a plan for RL, broadcast the value head, and build the plain rollout copy of the
    policy that the trainer samples with under it (full weights, refreshed every step). The
    plan is not applied here: the policy and its reference come split (`frozen_reference`).

    Args:
        runtime: the `PlanRuntime` of `policy.model`.
        policy: the trained `Policy` (its model split by the plan).
        value_head: PPO's value head (stays a plain module), or None.
        prompts_per_step: groups per step, shared out among the data ranks.

    Returns:
        The rollout copy.

    Raises:
        ValueError: pp > 1, sp > 1 with a value head, prompts_per_step not divisible by the
            data-parallel size, or a split value head (named, with the allowed values). The
            optimizer is checked for every trainer by the engine
            (`posttrain.train.optimizer_check`).
    """
    from torch.distributed.tensor import DTensor

    plan = runtime.plan
    if plan.pp > 1:
        raise ValueError(
            f"RLTrainer under {plan}: pp={plan.pp} is not supported (a pipelined "
            "policy has no plain forward to score the rollouts with); allowed pp "
            "for RL: 1 (split with dp_replicate, dp_shard, tp, sp or ep)"
        )
    if value_head is not None and plan.sp > 1:
        raise ValueError(
            f"RLTrainer under {plan}: a value head with sp={plan.sp} is not "
            "supported: the head reads the hidden state of model.norm through a "
            "hook, inside the sequence-parallel region, where each sp rank holds "
            "only its slice of the sequence; allowed sp for PPO: 1 (GRPO, without "
            "a value head, runs under sp)"
        )
    ranks = plan.data_parallel_size
    if prompts_per_step % ranks:
        raise ValueError(
            f"prompts_per_step={prompts_per_step} must be divisible by the "
            f"data-parallel size {ranks} of {plan}: each data rank samples "
            "prompts_per_step / data_parallel_size prompts"
        )
    if value_head is not None:
        if any(isinstance(p, DTensor) for p in value_head.parameters()):
            raise ValueError(
                "the value head must stay a plain module under a plan (the trainer "
                "sums its gradients over the data-parallel ranks); apply the plan "
                "to policy.model only"
            )
        flat_collective(list(value_head.parameters()), lambda flat: dist.broadcast(flat, src=0))
    rollout = Policy(plain_copy(policy.model, policy.spec), policy.tokenizer, policy.spec)
    rollout.model.load_state_dict(runtime.full_state_dict())
    return rollout


def frozen_reference(policy: Policy) -> nn.Module:
    """A frozen plain copy of `policy`'s weights as they are now: the reference an `RLTrainer`
    under a plan is given, taken before the plan splits the policy and then split by the same
    plan on the same mesh (module docstring of `posttrain.rl.trainer`). A plain decoder of
    `policy.spec` (converters such as FP8 are not copied), in eval mode, without gradients.

    Raises:
        ValueError: if `policy.model` is already split (its parameters are DTensors): take the
            copy before `plan.parallelize(policy.model, ...)`.
    """
    if is_split(policy.model):
        raise ValueError(
            "frozen_reference(policy): policy.model is already split by a plan; take the "
            "reference before plan.parallelize(policy.model, ...), then split it with "
            "plan.parallelize(reference, spec=policy.spec, mesh=runtime.mesh)"
        )
    reference = plain_copy(policy.model, policy.spec)
    reference.load_state_dict(policy.model.state_dict())
    return reference.eval().requires_grad_(False)


def uses_reference(algo: RLAlgorithm, model: nn.Module) -> bool:
    """Whether an `RLTrainer` of `algo` on `model` scores with a frozen reference model:
    `algo.kl_coef > 0` and `model` has no LoRA adapters (a LoRA policy's reference is its own
    base, adapters disabled). The rule `plan_memory(reference=)` is given."""
    return algo.kl_coef > 0 and not has_adapters(model)


def checked_reference(
    reference: nn.Module | None,
    policy: Policy,
    *,
    runtime: Runtime,
    needed: bool,
    deprecated_start: Policy | None = None,
) -> nn.Module | None:
    """The frozen reference an `RLTrainer` scores with: `reference` as given (frozen), a deep copy
    of the policy without a plan, or None when the algorithm needs none (`needed`: KL > 0 and
    no LoRA adapters). `deprecated_start`: the plain copy of the starting weights, given only on
    the deprecated `RLTrainer(plan=)` path (one release), where the trainer still splits the
    reference itself when none is given, as it did before.

    Raises:
        ValueError: a reference given where none is used; under a plan that split the policy,
            no reference, or one that is not split as the policy is (each named, with how to
            build it); a split reference beside a plain policy.
        TypeError: a reference that is not an `nn.Module`.
    """
    if not needed:
        if reference is not None:
            raise ValueError(
                "reference= was given, but this run scores with none: the algorithm's "
                "kl_coef is 0, or the policy has LoRA adapters (its reference is its own "
                "base, adapters disabled); pass reference=None"
            )
        return None
    policy_split, how = (
        is_split(policy.model),
        (
            "reference = frozen_reference(policy) before plan.parallelize(policy.model, ...), "
            "then plan.parallelize(reference, spec=policy.spec, mesh=runtime.mesh)"
        ),
    )
    if reference is None:
        if policy_split and deprecated_start is not None and runtime.plan is not None:
            reference = frozen_reference(deprecated_start)
            parallelize(runtime.plan, reference, spec=policy.spec, mesh=runtime.mesh)
            return reference
        if policy_split:
            raise ValueError(
                f"RLTrainer under {runtime.plan} with a KL term needs reference=, the frozen "
                f"reference split by the same plan: {how}"
            )
        return copy.deepcopy(policy.model).eval().requires_grad_(False)
    if not isinstance(reference, nn.Module):
        raise TypeError(f"reference={reference!r}; must be an nn.Module (a frozen model)")
    if is_split(reference) != policy_split:
        raise ValueError(
            f"reference is a plain module, but policy.model is split by {runtime.plan}: "
            f"split it by the same plan: {how}"
            if policy_split
            else "reference is split by a plan, but policy.model is not; pass a plain "
            "reference (or split the policy by the same plan)"
        )
    return reference.eval().requires_grad_(False)


def is_split(model: nn.Module) -> bool:
    """Whether a plan split `model` over ranks (FSDP2 or TP: its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


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


def gather_groups(local: Sequence[Group], *, offset: int, runtime: Runtime) -> list[Group]:
    """Every data rank's groups, in data-rank order, with group ids renumbered to their global
    index (`offset` = this rank's first; a collective over the data ranks of `runtime`); `local`
    itself with one data rank."""
    if runtime.data_size == 1:
        return list(local)
    renumbered = [
        Group([dataclasses.replace(t, group_id=offset + i) for t in g]) for i, g in enumerate(local)
    ]
    return [g for groups in runtime.gather_objects(renumbered) for g in groups]


def padding_rows(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The batch's first row with its response mask cleared: a micro-batch that runs the
    forward and backward of a rank without rows and trains nothing."""
    rows = {k: v[:1].clone() for k, v in batch.items()}
    rows["response_mask_BT"] = torch.zeros_like(rows["response_mask_BT"])
    return rows


def plain_copy(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """A plain (unsharded) decoder of `spec` on `model`'s device and dtype, for the full weights
    of a split model (its own initialisation is overwritten on the first load)."""
    from posttrain.models.specs import build_model

    param = next(model.parameters())
    return build_model(spec, device=param.device, dtype=param.dtype, seed=0)
