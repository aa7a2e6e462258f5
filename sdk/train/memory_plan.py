"""Memory plan: the bytes one rank needs for a model, a `ParallelPlan` and a batch, term by term,
and a check that refuses a plan before any work when the total exceeds the device.

Notation (per rank): B = rows of one micro-batch on one data-parallel rank, T = tokens per row,
V = vocabulary, D = embed_dim, F = intermediate_dim, H = num_heads, K = num_kv_heads, d =
head_dim (H x d = D, but for an explicit `attention_head_dim`: qwen3), L = num_layers, n = layers
on the rank's pipeline stage (ceil(L / pp)), E = experts, k = experts_per_token, M =
moe_intermediate_dim, S = shared_expert_dim, a = bytes of an activation element (4 in fp32; 2
with plan.param_dtype "bfloat16"/"float16"), p = bytes of a parameter (the model's dtype), N =
tokens = B x T.

Terms (every one is per rank; "divided by" says which plan axes split it):

  parameters        p x (parameters held by the rank). FSDP2 shards over dp_shard x ep x sp
                    (sharding.py flattens them into one mesh dimension; dp_replicate replicates).
                    Transformer-block weights q/k/v/o and the MLP w1/w2/w3 fall
                    1/(dp_shard x ep x sp x tp x pp); RMSNorm scales, MoE router and shared
                    expert 1/(dp_shard x ep x sp x pp); routed experts 1/ep only (split over ep,
                    left out of FSDP); embedding and output 1/(dp_shard x ep x sp), and 1/tp only
                    when untied (tied ones stay replicated under TP). pp: the worst stage,
                    ceil(L/pp) blocks plus one V x D matrix and the final norm (stage 0 holds the
                    embedding, the last stage the output or, tied, a copy of the embedding).
                    Counts: per block D*H*d + 2*D*K*d + H*d*D (+ H*d + 2*K*d biases for qwen2,
                    + 2*d q/k norm scales for qwen3) + 3*D*F (dense) or E*D + 3*E*M*D
                    + (3*D*S + D if S) (MoE) + 2*D; head V*D (twice if untied) + D.
  gradients         same count and division as the parameters, in p bytes (set to None after
                    every step: they do not coexist with the forward's activations, see peak).
  optimizer state   states x 4 bytes x parameters held: AdamW/Adam keep 2 fp32 moments
                    (exp_avg, exp_avg_sq); `optimizer=` takes a name or a number of states.
  activations       autograd's saved tensors, per layer per token (torchtune 0.6.1 qwen2/llama3
                    block, torch 2.13, counted storage by storage with saved_tensors_hooks):
                      two RMSNorms: fp32 input copy, x*rstd (4*2D each) and rstd (4)  16D + 8
                      their outputs, saved by the next linear                         2aD
                      q, K/V expanded to H heads (GQA copies), attention output      4aHd/tp
                      SDPA log-sum-exp                                                4H/tp
                      dense MLP: silu input, w3 output, silu output, their product     4aF/tp
                      (MoE MLP instead: k*(3aD + 4aM + 24) + 4E, + (4S + D + 2)a with S)
                      RoPE tables gathered at input_pos, q and k: qwen2/qwen3 4ad,
                        llama3/mistral 8d
                      qwen3's per-head q/k norms, as the block norms     (8(H+K)d + 4(H+K))/tp
                    fp32, dense qwen2: 4*(10D + 4F + H + 2 + 4d) bytes per token per layer,
                    times n blocks and B*ceil(T/sp) tokens (Ulysses: each sp rank runs the
                    blocks on its slice of the sequence, attention on H/sp heads of all of it);
                    the norm, RoPE and residual parts are replicated under TP (no sequence
                    parallelism in torchtune's TP plan). Plus the head: final norm
                    4*(2D + 1) + aD and int64 token ids and labels 16, per token.
                    With activation checkpointing a block keeps only its input (aD per token) and
                    rebuilds its full set (above) while it is back-propagated.
                    Pipeline: a stage keeps the activations of the micro-batches in flight:
                    GPipe all n_microbatches, 1F1B min(pp, n_microbatches) on stage 0; each is
                    ceil(B / n_microbatches) rows, plus the stage's received input and output
                    (2aD per token).
  logits            12 bytes x N x V, or with loss_chunk_tokens C about 12 x C x V
                    (memory_counts.loss_bytes: the copies, and the chunked head's). Not split by
                    tp or sp: the output projection stays replicated (tied) or is all-gathered,
                    and Ulysses gathers the logits of the whole sequence on every sp rank. On the
                    last pipeline stage: one micro-batch (1F1B) or all of them (GPipe).
  backward working  2aF/tp bytes per token: the two input gradients of the SwiGLU product of the
  set               block being back-propagated (MoE: k*M + S in place of F).
  FSDP gathered     with FSDP (dp_replicate x dp_shard x ep x sp > 1): the root group (embedding,
  root              final norm, output) stays gathered from forward to the end of backward, in
                    the compute dtype; its gradients stay unsharded until the end of backward and
                    are then copied into the reduce-scatter input (2 G_root for a moment). FSDP2
                    resizes the gathered parameters' storages in place: `TensorPeak` does not see
                    them, RSS does.
  FSDP buffers      with FSDP: 3 blocks gathered in backward (the current block, the prefetched
                    previous one, and the current block's unsharded gradients / reduce-scatter
                    buffer), in the compute dtype.
  tied embedding    with tied embeddings (pp = 1): the embedding's backward makes its own V x D
  gradients         gradient beside the head's, then their sum: 2 x p x V x D more than G_root
                    (measured with `TensorPeak`, tests/train/test_memory_plan_phases.py).
  optimizer step    CPU for-loop AdamW: 2 x the largest local tensor (sqrt and division
  temporaries       temporaries of the denominator); CUDA foreach AdamW: 1 x all local
                    parameters (the foreach sqrt of exp_avg_sq).
  model build       every rank builds the whole model in p bytes before `plan.parallelize`
                    shards it, plus, for a plan to apply, two buckets of the rank-0 broadcast
                    (`flat_collective` concatenates the next bucket while the previous one is
                    still referenced): 64 MiB each, but a tensor larger than a bucket goes alone
                    as its own flat copy (Qwen2.5-0.5B's embedding, 0.51 GiB).
  reference model,  what a phase holds beside training the policy: `posttrain.train.memory_phases`
  value head,       (the reference only where one is built: `reference=`; the rollout copy
  rollout copy, KV  under a plan in grpo and ppo).
  cache, prefill

How they add up (the "peak" row; each term enters where it is alive):

    held      = parameters + optimizer + reference + value head + rollout copy
    training  = held + max(
                  gradients + optimizer temporaries,                        # the update
                  acts + head + logits + root,                              # loss backward
                  acts + head + rebuilt + working + G_root + root + FSDP buffers,  # last block
                  block0 + rebuilt + working + (n-1) G_block + G_root + root + FSDP buffers,
                  n G_block + G_root + tied embedding gradients + root,     # embedding
                  n G_block + 2 G_root + root)             # root reduce-scatter (FSDP only)
    rollout   = held + KV cache + prefill
    refresh   = held + rollout copy                 # loading the gathered full state dict
    peak      = max(model build, training (not in phase rollout), rollout (grpo, ppo, rollout),
                    refresh (with a rollout copy))

root: the FSDP gathered root (0 without FSDP); rebuilt: one block's saved set under
activation checkpointing (else 0); G_root: the root's
gradients (unsharded under FSDP until the end of backward); G_block: one block's local
gradients. Validated against peak RSS on CPU (docs/benchmarks/parallel_memory.md); memory no term
holds (code pages, small allocations) is the `runtime_bytes` row, 0 unless given.

Example:
    >>> from posttrain.models import get_preset
    >>> from posttrain.train.parallel import ParallelPlan
    >>> batch = {"micro_batch_size": 1, "seq_len": 512}
    >>> df = plan_memory(get_preset("tiny-1m"), ParallelPlan(dp_shard=2), batch)
    >>> int(df.set_index("term").loc["optimizer state", "bytes"]) == 2 * 4 * 1_020_032 // 2
    True
    >>> check_plan_fits(  # doctest: +NORMALIZE_WHITESPACE
    ...     get_preset("llama3.2-1b"), ParallelPlan(), batch, device_type="cuda",
    ...     device_bytes=16 * 2**30)
    Traceback (most recent call last):
    ...
    ValueError: ParallelPlan(one rank) needs about 23.0 GiB per rank for phase 'sft' but the
    device has 16.0 GiB: optimizer state 9.2 GiB of 23.0 GiB per rank: raise dp_shard
    (optimizer state falls 1/dp_shard)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from posttrain.core import distributed
from posttrain.policy.chunked_ce import check_chunk_tokens
from posttrain.train.memory_counts import (
    DTYPE_BYTES,
    OPTIMIZER_STATES,
    MemoryBatch,
    activation_bytes_per_token,
    all_parameters,
    dtype_bytes,
    loss_bytes,
    model_counts,
    optimizer_states,
)
from posttrain.train.memory_fit import device_memory_bytes, refuse_over_device
from posttrain.train.memory_phases import axes, phase_terms
from posttrain.train.parallel import ParallelPlan
from posttrain.train.plan_checks import check_fits
from posttrain.train.plan_value import PlanFields

if TYPE_CHECKING:
    import pandas as pd

    from posttrain.models.specs import ModelSpec

__all__ = [
    "MemoryBatch",
    "PHASES",
    "OPTIMIZER_STATES",
    "plan_memory",
    "check_plan_fits",
    "device_memory_bytes",
]

PHASES = ("sft", "cpt", "dpo", "grpo", "ppo", "rollout")
"""Phases `plan_memory` knows: sft/cpt (policy training), dpo (+ reference), grpo (+ reference,
+ generation), ppo (+ value head), rollout (generation only)."""

_GIB = 2**30


def plan_memory(
    spec: ModelSpec,
    plan: PlanFields | None,
    batch: MemoryBatch | dict[str, Any],
    *,
    phase: str = "sft",
    optimizer: str | float = "adamw",
    model_dtype: str = "float32",
    reference_dtype: str | None = None,
    device_type: str | None = None,
    runtime_bytes: int = 0,
    loss_chunk_tokens: int | None = None,
    reference: bool | None = None,
) -> pd.DataFrame:
    """Per-rank memory of training (or generating with) `spec` under `plan` on `batch`.

    The formulas, the division rules and how the terms add up to the peak are in the module
    docstring.

    Args:
        spec: a `posttrain.models.ModelSpec`.
        plan: a `ParallelPlan` (None: one rank).
        batch: a `MemoryBatch` or a dict of its fields (micro_batch_size and seq_len per
            data-parallel rank; num_sequences, max_total_len, prompt_len for generation).
        phase: one of `PHASES`.
        optimizer: a name in `OPTIMIZER_STATES` or the number of fp32 states per parameter.
        model_dtype: the dtype the parameters are held in ("float32", "bfloat16", "float16").
        reference_dtype: the reference model's dtype (default: model_dtype).
        device_type: "cpu" or "cuda": which AdamW torch picks (for-loop on CPU, foreach on CUDA);
            default "cuda" if CUDA is available, else "cpu".
        runtime_bytes: memory no term holds (allocator, communication buffers), added as its
            own row.
        loss_chunk_tokens: the loss's chunk (`SFTCrossEntropy(loss_chunk_tokens=)`), or None.
        reference: whether the phase holds a reference model: None for dpo, grpo and ppo
            (held), False where the trainer builds none (`RLTrainer` builds one only when
            `posttrain.rl.parallel.uses_reference`: kl_coef > 0 and no LoRA adapters).

    Returns:
        A pandas DataFrame, one row per term: term, bytes, GiB, divided_by (the plan axes and
        their product), note; the last row, "peak", is the per-rank total by the rule above.
        `df.attrs` holds "peak_bytes", "dominant" (the largest term inside the peak), "moment"
        (when the peak happens) and "phase".

    Raises:
        ValueError: naming the argument and the allowed values, for an unknown phase, optimizer,
            dtype or device type, `reference` True outside dpo/grpo/ppo, a batch with a
            non-positive or unknown field, or a plan that does not fit the model
            (`ParallelPlan.validate`).
    """
    import pandas as pd

    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}; allowed: {', '.join(PHASES)}")
    plan = ParallelPlan() if plan is None else plan
    if not isinstance(plan, PlanFields):
        raise ValueError(f"plan={plan!r}; must be a ParallelPlan or None")
    check_fits(plan, spec=spec)
    batch = MemoryBatch.of(batch)
    states = optimizer_states(optimizer)
    p = dtype_bytes("model_dtype", model_dtype)
    ref_p = dtype_bytes("reference_dtype", reference_dtype or model_dtype)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r}; allowed: cpu, cuda")
    if isinstance(runtime_bytes, bool) or not isinstance(runtime_bytes, int) or runtime_bytes < 0:
        raise ValueError(f"runtime_bytes={runtime_bytes!r}; must be an integer >= 0")

    a = DTYPE_BYTES[plan.param_dtype] if plan.param_dtype else p
    c = model_counts(spec)
    D, V, F = spec.embed_dim, spec.vocab_size, spec.intermediate_dim
    tp, sp, pp, ep = plan.tp, plan.sp, plan.pp, plan.ep
    n = math.ceil(spec.num_layers / pp)
    shards = plan.dp_shard * ep * sp  # FSDP2's shard dimension (sharding.py: dp_shard, ep, sp)
    fsdp = plan.dp_replicate * shards > 1
    # parameters held by one rank: TP-local, then FSDP-sharded; experts split over ep only
    block_local = c.block_tp / tp + c.block_replicated
    experts_local = c.block_experts / ep
    # with pp > 1, the worst end stage: its blocks and one V x D matrix (embedding, or output /
    # tied copy on the last stage) and the final norm
    root_local = spec.vocab_size * D + D if pp > 1 else c.root_tp / tp + c.root_replicated
    held = n * (block_local / shards + experts_local) + root_local / shards
    rows: list[tuple[str, float, str, str]] = []

    def add(term: str, nbytes: float, divided_by: str, note: str) -> None:
        rows.append((term, float(nbytes), divided_by, note))

    param_axes = axes(plan, "dp_shard", "ep", "sp", "tp", "pp") + (
        f" (experts: {axes(plan, 'ep')})" if spec.is_moe else ""
    )
    param_bytes = held * p
    training = phase != "rollout"
    add("parameters", param_bytes, param_axes, f"{held:,.0f} parameters x {p} B")
    grad_bytes = held * p if training else 0.0
    optim_bytes = held * 4 * states if training else 0.0
    if training:
        add("gradients", grad_bytes, param_axes, "freed after every step (zero_grad set_to_none)")
        add(
            "optimizer state",
            optim_bytes,
            param_axes,
            f"{states:g} fp32 state(s) per parameter "
            f"({optimizer if isinstance(optimizer, str) else 'given'})",
        )
    # activations
    micro = math.ceil(batch.micro_batch_size / plan.microbatches)  # microbatches is 1 if pp == 1
    in_flight = plan.microbatches if plan.pp_schedule == "gpipe" else min(pp, plan.microbatches)
    tokens = micro * math.ceil(batch.seq_len / sp)  # this rank's slice of the padded sequence
    block = activation_bytes_per_token(spec, plan, a) * tokens  # full saved set
    kept = (a * D * tokens) if plan.activation_checkpointing else block  # per block, forward
    rebuilt = block if plan.activation_checkpointing else 0.0
    acts = n * kept * in_flight
    if pp > 1:  # the stage's received input and its output, per micro-batch in flight
        acts += 2 * a * D * tokens * in_flight
    head = (4 * (2 * D + 1) + a * D + 16) * tokens * in_flight
    last_mb = in_flight if plan.pp_schedule == "gpipe" and pp > 1 else 1
    chunk = check_chunk_tokens(loss_chunk_tokens)  # gathered whole on every sp rank:
    logits = loss_bytes(V, D, micro * batch.seq_len, a, p, chunk) * last_mb
    f_eff = (
        spec.experts_per_token * spec.moe_intermediate_dim + spec.shared_expert_dim
        if spec.is_moe
        else F / tp
    )
    working = 2 * a * f_eff * tokens
    fsdp_root = root_local * a if fsdp else 0.0
    fsdp_all = fsdp_root + (3 * block_local * a if fsdp else 0.0)
    g_root = root_local * p  # under FSDP the root's gradients stay unsharded until the end
    g_block = (block_local / shards + experts_local) * p
    # a tied embedding's backward makes its own V x D gradient beside the head's, then their sum
    tied = 2 * V * D * p if spec.tie_word_embeddings and pp == 1 else 0.0
    if training:
        ac = (
            "activation checkpointing: each block keeps its input"
            if plan.activation_checkpointing
            else "saved tensors of every block"
        )
        add(
            "activations",
            acts,
            axes(plan, "tp", "sp", "pp") + (" (norms, residual: not tp)" if tp > 1 else ""),
            f"{ac}; {n} block(s) x {in_flight} micro-batch(es) in flight",
        )
        add("activations (head)", head, axes(plan, "sp"), "final norm, ids and labels")
        add(
            "activations (rebuilt block)",
            rebuilt,
            axes(plan, "tp", "sp"),
            "one block recomputed in backward" if rebuilt else "no activation checkpointing",
        )
        add(
            "logits",
            logits,
            "1 (gathered whole under tp and sp)",
            f"fp32 logits, masked copy, log-softmax of {chunk or 'all'} tokens at a time",
        )
        add(
            "backward working set",
            working,
            axes(plan, "tp", "sp"),
            "gradients of the SwiGLU product in the block under backward",
        )
        add(
            "FSDP gathered root",
            fsdp_root,
            "gathered: not divided" if fsdp else "1",
            "embedding, final norm, output: gathered from forward to the end of backward"
            if fsdp
            else "no FSDP",
        )
        add(
            "FSDP buffers",
            fsdp_all - fsdp_root,
            "gathered: not divided" if fsdp else "1",
            "3 blocks gathered in backward" if fsdp else "no FSDP",
        )
        add(
            "tied embedding gradients",
            tied,
            "1 (whole on every rank)",
            "the embedding's own V x D gradient and its sum with the head's"
            if tied
            else "no tied embedding",
        )
        largest = max(
            c.largest_block / (tp * shards),
            c.largest_expert / ep,
            c.largest_root / (tp if c.root_tp else 1) / shards,
        )
        temps = (2 * largest * 4 if device_type == "cpu" else held * 4) if states else 0.0
        add(
            "optimizer step temporaries",
            temps,
            param_axes,
            "for-loop AdamW: 2 x largest tensor"
            if device_type == "cpu"
            else "foreach AdamW: 1 x local parameters",
        )
    whole = all_parameters(c, spec) * p
    applied = not plan.is_default  # plan.parallelize broadcasts from rank 0 first
    # the broadcast's flat copies: a bucket and the next one; a tensor larger than a bucket
    # goes alone (its own copy)
    largest = max(c.largest_root, c.largest_block, c.largest_expert) * p
    bucket = distributed._BUCKET_BYTES  # flat_collective's, read when planning
    buckets = min(max(largest, bucket) + bucket, whole) if applied else 0
    build = whole + buckets
    add(
        "model build",
        build,
        "1",
        "every rank builds the whole model before plan.parallelize"
        + (
            " (+ 2 broadcast buckets, or the largest tensor's copy and a bucket)" if applied else ""
        ),
    )
    extra = phase_terms(
        spec,
        plan,
        batch,
        phase,
        held=held,
        n=n,
        p=p,
        ref_p=ref_p,
        states=states,
        whole=whole,
        reference=reference,
    )
    rows.extend(extra.rows)
    ref, value, kv, prefill = extra.reference, extra.value_head, extra.kv_cache, extra.prefill
    copy = extra.rollout_copy
    if runtime_bytes:
        add("runtime", runtime_bytes, "1", "given: allocator, communication buffers")
    static = param_bytes + optim_bytes + ref + value + copy
    held_terms = ("parameters", "optimizer state", "reference model", "value head", "rollout copy")
    # moment -> (bytes, the terms that make it up)
    candidates: dict[str, tuple[float, tuple[str, ...]]] = {}
    if training:
        candidates = {
            "update": (grad_bytes + temps, ("gradients", "optimizer step temporaries")),
            "loss backward": (
                acts + head + logits + fsdp_root,
                ("activations", "activations (head)", "logits", "FSDP gathered root"),
            ),
            "last block backward": (
                acts + head + rebuilt + working + g_root + fsdp_all,
                (
                    "activations",
                    "activations (head)",
                    "activations (rebuilt block)",
                    "backward working set",
                    "FSDP gathered root",
                    "FSDP buffers",
                ),
            ),
            "block 0 backward": (
                kept * in_flight + rebuilt + working + (n - 1) * g_block + g_root + fsdp_all,
                (
                    "gradients",
                    "activations (rebuilt block)",
                    "backward working set",
                    "FSDP gathered root",
                    "FSDP buffers",
                ),
            ),
            # after block 0: every block's local gradients and the root's
            "embedding backward": (
                n * g_block + g_root + tied + fsdp_root,
                ("gradients", "tied embedding gradients", "FSDP gathered root"),
            ),
        }
        if fsdp:  # the root's gradients copied into the reduce-scatter input, still gathered
            candidates["root reduce-scatter"] = (
                n * g_block + 2 * g_root + fsdp_root,
                ("gradients", "FSDP gathered root"),
            )
    peaks: dict[str, tuple[float, tuple[str, ...]]] = {"model build": (build, ("model build",))}
    if training:
        moment, (dyn, terms) = max(candidates.items(), key=lambda kv_: kv_[1][0])
        peaks[f"training ({moment})"] = (static + dyn, held_terms + terms)
    if kv:
        peaks["generation"] = (static + kv + prefill, held_terms + ("KV cache", "prefill"))
    if copy:  # the rollout copy loads the gathered full state dict (RLTrainer, every step)
        peaks["rollout refresh"] = (static + whole, held_terms)
    when, (total, terms) = max(peaks.items(), key=lambda kv_: kv_[1][0])
    total += runtime_bytes
    df = pd.DataFrame(rows, columns=["term", "bytes", "divided_by", "note"])
    inside = df[df["term"].isin(terms + ("runtime",))]
    dominant = inside.loc[inside["bytes"].idxmax(), "term"]
    df = pd.concat(
        [df, pd.DataFrame([("peak", total, "", f"max over moments: {when}")], columns=df.columns)],
        ignore_index=True,
    )
    df["bytes"] = df["bytes"].round().astype("int64")
    df.insert(2, "GiB", df["bytes"] / _GIB)
    df.attrs.update(peak_bytes=int(round(total)), dominant=dominant, moment=when, phase=phase)
    return df


def check_plan_fits(
    spec: ModelSpec,
    plan: PlanFields | None,
    batch: MemoryBatch | dict[str, Any],
    *,
    phase: str = "sft",
    device_bytes: int | None = None,
    **options: Any,
) -> pd.DataFrame:
    """Refuse a plan whose per-rank peak (`plan_memory`) exceeds the device, before any work.

    Args:
        spec, plan, batch, phase: as `plan_memory`; `options` are its other keywords.
        device_bytes: memory of one rank's device (default `device_memory_bytes()`: the GPU's
            total if CUDA is available, else the machine's available RAM).

    Returns:
        The `plan_memory` DataFrame when the plan fits.

    Raises:
        ValueError: naming the peak, the device size, the dominant term and the plan axis that
            would lower it; or the errors of `plan_memory`.
    """
    df = plan_memory(spec, plan, batch, phase=phase, **options)
    return refuse_over_device(df, plan, phase, device_bytes)
