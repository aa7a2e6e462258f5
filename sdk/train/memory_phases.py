"""What a phase holds beside training the policy, per rank, for `posttrain.train.memory_plan`
(notation there): the reference model (dpo, grpo, ppo), the value head (ppo), the rollout copy
(grpo, ppo under a plan), and the rollout's KV cache and prefill (grpo, ppo, rollout).

Terms:

  reference model   phases dpo, grpo, ppo: a forward-only copy sharded like the policy, in
                    `reference_dtype` (its forward saves nothing: transients below the policy's).
                    Not held with `reference=False`: `RLTrainer` builds one only when
                    kl_coef > 0 and the policy has no LoRA adapters (`posttrain.rl.parallel
                    .uses_reference`); a LoRA policy's reference is its own base.
  rollout copy      phases grpo, ppo under a plan (one that is not `ParallelPlan()`): the plain,
                    unsharded copy of the policy `RLTrainer.rollout_policy` samples from, p x
                    all parameters, held through the step. Every step it loads the gathered full
                    state dict (as many bytes again): the "rollout refresh" moment of the plan.
  value head        phase ppo: posttrain's `ValueHead`, Linear(D, 1) on the final hidden state:
                    parameters, gradients and optimizer state.
  KV cache          phases grpo, ppo, rollout: 2 x n x (K/tp) x d x (num_sequences x max_total_len)
                    x p bytes per rank (sequences are per data-parallel rank).
  prefill           phases grpo, ppo, rollout: the prefill's logits (num_sequences x prompt_len x V
                    x p) and one block's no-grad working set ((3D + 3F) x p per prompt token).

Example:
    >>> from posttrain.models import get_preset
    >>> from posttrain.train.memory_counts import MemoryBatch
    >>> from posttrain.train.parallel import ParallelPlan
    >>> spec = get_preset("tiny-1m")
    >>> t = phase_terms(spec, ParallelPlan(), MemoryBatch(micro_batch_size=2, seq_len=8),
    ...                 "rollout", held=1e3, n=spec.num_layers, p=4, ref_p=4, states=2, whole=4e3)
    >>> t.reference, int(t.kv_cache) == 2 * 4 * 2 * 32 * (2 * 8) * 4
    (0.0, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from posttrain.models.specs import ModelSpec
    from posttrain.train.memory_counts import MemoryBatch
    from posttrain.train.plan_value import PlanFields

__all__ = ["PhaseTerms", "phase_terms"]

Row = tuple[str, float, str, str]  # term, bytes, divided_by, note (memory_plan's columns)


def axes(plan: PlanFields, *names: str) -> str:
    """The plan axes among `names` above 1 and their product ("dp_shard x tp = 4"), or "1"."""
    used = [n for n in names if getattr(plan, n) > 1]
    return f"{' x '.join(used)} = {math.prod(getattr(plan, n) for n in used)}" if used else "1"


@dataclass
class PhaseTerms:
    """The bytes of the terms a phase adds (0.0 where it has none) and their rows, in the order
    `plan_memory` shows them."""

    reference: float = 0.0
    value_head: float = 0.0
    rollout_copy: float = 0.0
    kv_cache: float = 0.0
    prefill: float = 0.0
    rows: list[Row] = field(default_factory=list)


def phase_terms(
    spec: ModelSpec,
    plan: PlanFields,
    batch: MemoryBatch,
    phase: str,
    *,
    held: float,
    n: int,
    p: int,
    ref_p: int,
    states: float,
    whole: float,
    reference: bool | None = None,
) -> PhaseTerms:
    """The reference model, value head, rollout copy, KV cache and prefill of `phase` (module
    docstring).

    Args:
        spec, plan, batch, phase: as `plan_memory`.
        held: parameters the rank holds of the policy (the reference is sharded alike).
        n: blocks on the rank's pipeline stage. p, ref_p: bytes of a parameter of the policy
            and of the reference. states: fp32 optimizer states per parameter. whole: bytes of
            all the policy's parameters, unsharded (the rollout copy).
        reference: None (the phase's rule: held in dpo, grpo, ppo) or whether it is held.

    Raises:
        ValueError: `reference` not None or a bool, or True in a phase without a reference.
    """
    t = PhaseTerms()
    with_reference = phase in ("dpo", "grpo", "ppo")
    if reference is not None:
        if not isinstance(reference, bool):
            raise ValueError(f"reference={reference!r}; must be None, True or False")
        if reference and not with_reference:
            raise ValueError(
                f"reference=True with phase={phase!r}; a reference is held in phases dpo, grpo, "
                "ppo only"
            )
        with_reference = reference
    param_axes = axes(plan, "dp_shard", "ep", "sp", "tp", "pp") + (
        f" (experts: {axes(plan, 'ep')})" if spec.is_moe else ""
    )
    if with_reference:
        t.reference = held * ref_p
        t.rows.append(
            (
                "reference model",
                t.reference,
                param_axes,
                "forward-only copy sharded like the policy",
            )
        )
    if phase == "ppo":
        D = spec.embed_dim
        t.value_head = (D + 1) * (2 * p + 4 * states)
        t.rows.append(
            (
                "value head",
                t.value_head,
                "1",
                "Linear(D, 1): parameters, gradients, optimizer state",
            )
        )
    if phase in ("grpo", "ppo") and not plan.is_default:
        t.rollout_copy = whole
        t.rows.append(
            (
                "rollout copy",
                whole,
                "1 (unsharded)",
                "RLTrainer.rollout_policy: the full policy the rollouts sample from",
            )
        )
    if phase in ("grpo", "ppo", "rollout"):
        seqs = batch.num_sequences or batch.micro_batch_size
        total_len = batch.max_total_len or batch.seq_len
        prompt = batch.prompt_len or total_len
        V, D, F, tp = spec.vocab_size, spec.embed_dim, spec.intermediate_dim, plan.tp
        t.kv_cache = 2 * n * (spec.num_kv_heads / tp) * spec.head_dim * seqs * total_len * p
        t.prefill = seqs * prompt * (V * p + (3 * D + 3 * F / tp) * p)
        t.rows.append(
            (
                "KV cache",
                t.kv_cache,
                axes(plan, "tp", "pp"),
                f"{seqs} sequences x {total_len} tokens",
            )
        )
        t.rows.append(
            (
                "prefill",
                t.prefill,
                axes(plan, "tp") + (" (logits: not tp)" if tp > 1 else ""),
                "prefill logits + one block's no-grad working set",
            )
        )
    return t
