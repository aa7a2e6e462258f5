"""The RL loop: rollout -> score -> exclude -> advantages -> minibatch updates -> metrics.

Notation: B = trajectories in a (mini)batch, T = padded tokens per row (prompt + completion),
G = group size.

`RLTrainer.step` is the whole algorithm in one screen; everything it calls is either a pure
function over tensors (`posttrain.rl.algorithms`: verl's estimators and losses chosen by name
through `RLAlgorithm`) or a small helper below (the minibatch updates: `posttrain.rl.update`).
One step:

    builders  = task.builders(step, prompts_per_step)           # deterministic per step
    groups    = collect_groups(policy, builders, G, ...)        # rollout + verifier outcomes
    (DAPO dynamic sampling, algo.filter_groups: only groups with mixed rewards, more batches
     sampled until prompts_per_step of them; counted: groups_filtered, gen_batches)
    kept      = groups without an "error"/"timeout" trajectory  # counted: groups_excluded_error
    batch     = right-padded tensors; old logprobs = the sampler's own (same temperature/top-p)
    adv, ret  = compute_advantages(algo.advantage_estimator, ...)  # all-equal group -> 0,
                                                                   # counted: groups_zero_signal
    for epoch in range(algo.ppo_epochs):                       # shuffled minibatches, one
        for minibatch: loss = policy_loss(+ value_loss)         # optimizer step each; each loss
                       normalised by step_units of its minibatch   # normalised over that step

Exclusion rule (explicit, counted): a group with any trajectory whose outcome is "error" or
"timeout" is dropped whole (its advantages would compare a real reward with a placeholder 0.0).
"format_error" and "wrong" are ordinary low rewards and are trained on.

Reference model (when `algo.kl_coef > 0`): the frozen model given as `reference=`, or a copy of
the policy taken here; for a LoRA policy its own base, adapters disabled (no copy). Value head
(PPO + GAE): `ValueHead`, an `nn.Linear(embed_dim, 1)` on `model.norm`'s output (a forward hook).

The loop around the step is the training engine's (`posttrain.train.engine.Engine`, shared with
the SFT/DPO `Trainer`): `fit`, metrics, checkpoints (policy, value head and reference weights;
optimizer, scheduler, buffer state, RNG states, step and metrics rows; a resumed run continues
bit for bit on CPU with fixed threads), preemption at step boundaries, one live process per
run folder. Ctrl-C during the rollout rolls the step back (nothing of it was applied); during
the update it is held until the step is done. Either way `fit` stops at a whole step, saves a
checkpoint there when checkpointing is on and sets `interrupted`. With several ranks and no
plan, rank 0 alone writes; the ranks sample the same groups and train identical replicas.

Under a `ParallelPlan` the caller splits the policy and the reference (the trainer applies no
plan; the optimizer is built after): `reference = frozen_reference(policy)`
(`posttrain.rl.parallel`), `runtime = plan.parallelize(policy.model, spec=policy.spec)`,
`plan.parallelize(reference, spec=policy.spec, mesh=runtime.mesh)`, then `RLTrainer(...,
runtime=runtime, reference=reference)`. Each data-parallel rank samples its share of the prompts
with a plain copy of the policy that receives the full weights once per step, the groups are
gathered so that every rank holds the step's global batch, the reference and the value head (a
replicated `nn.Linear` whose gradients are summed over the data ranks) score and train it, each
data rank its share of every minibatch (`posttrain.rl.parallel` has the whole design). The step
is the same code with or without a plan: what differs is the trainer's `runtime`. Checkpoints
are then DCP shards of policy, value head and reference with the optimizer.

Low-bit rollout (`rollout_quantization="int8"`): a quantised copy samples, the full-precision
policy trains and rescores the rollouts (`posttrain.rl.lowbit_rollout` has the design).
Rollout engines ("builtin", "vllm"; weight versions checked): `posttrain.rl.engine_rollout`.

Example:
    >>> import torch
    >>> from posttrain.envs import chain_sum_task
    >>> from posttrain.policy import Policy
    >>> from posttrain.rl.algorithms import RLAlgorithm
    >>> policy = Policy.from_spec("tiny-1m", seed=0)
    >>> trainer = RLTrainer(policy, torch.optim.AdamW(policy.model.parameters(), lr=1e-4),
    ...                     task=chain_sum_task(size=16, held_out_size=2),
    ...                     algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.0), prompts_per_step=2,
    ...                     max_new_tokens=2, progress=False)
    >>> sorted(k for k in trainer.step() if k.startswith("groups_"))
    ['groups_excluded_empty', 'groups_excluded_error', 'groups_kept', 'groups_zero_signal']
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from posttrain.core.checkpoint import capture_rng_state, restore_rng_state
from posttrain.core.preemption import sigint_held
from posttrain.models.conversion import ConversionReport
from posttrain.policy.chunked_ce import check_chunk_tokens, check_chunkable_head
from posttrain.policy.policy import Policy
from posttrain.policy.rollout_engine import RolloutEngine
from posttrain.rl.algorithms import (
    compute_advantages,
    sequence_advantages,
)
from posttrain.rl.batch import make_batch, split_groups
from posttrain.rl.buffer import ReplayBuffer
from posttrain.rl.config import RLAlgorithm
from posttrain.rl.engine_hooks import RLEngineHooks
from posttrain.rl.engine_rollout import ManagedEngine
from posttrain.rl.environment import EnvDataset, Group
from posttrain.rl.lowbit_rollout import (
    check_rollout_quantization,
    decouple_sampler,
    quantized_sampler,
)
from posttrain.rl.parallel import (
    checked_reference,
    data_shares,
    gather_groups,
    plan_rollout_parts,
    rollout_seed,
    uses_reference,
)
from posttrain.rl.rollout import (
    EXCLUDED_OUTCOMES,
    collect_filtered,
    collect_groups,
    rollout_metrics,
)
from posttrain.rl.scoring import ValueHead
from posttrain.rl.step_timing import TimedGeneration, new_step_timer, timing_row
from posttrain.train.parallel import ParallelPlan
from posttrain.train.plan_compat import resolve_runtime
from posttrain.train.runtime import PlanRuntime, Runtime

__all__ = ["RLTrainer", "ValueHead", "EXCLUDED_OUTCOMES", "split_groups", "make_batch"]


class RLTrainer(RLEngineHooks):
    """Runs RL steps on built parts (policy, optimizer, task, algorithm), on the training engine
    (`posttrain.train.engine.Engine`: fit, checkpoints, resume, preemption, Ctrl-C, rank 0
    writes) with the update half of a step (`posttrain.rl.update.RLUpdateEngine`) and the
    engine's hooks (checkpoint contents, resume settings: `posttrain.rl.engine_hooks`).

    Args:
        policy: the `Policy` to train (sampled with `generate`, scored with `token_logprobs`).
        optimizer: over exactly the trainable parameters of the policy and of the value head,
            when there is one (built after `plan.parallelize` and any converter; checked by
            identity).
        task: an `EnvDataset`; step i trains on `task.builders(i, prompts_per_step)`.
        algo: every algorithmic choice (`RLAlgorithm.grpo()`, `.ppo()`, ...).
        prompts_per_step: groups per step (B = prompts_per_step x algo.group_size).
        max_new_tokens, temperature, top_p: sampling settings, also used to score (the
            importance ratio compares log-probs of the same distribution).
        value_head: a `ValueHead` when `algo.use_value_head` (built here if None).
        reference: the frozen reference (KL > 0, no LoRA), or None for a copy of the policy;
            under a plan that splits the policy, required and split by the same plan (module
            docstring), a plain one refused (`posttrain.rl.parallel.checked_reference`).
        micro_batch_size: rows per forward/backward inside a minibatch (gradient accumulation;
            the loss is normalised over the minibatch, so the result does not depend on it);
            under a plan, rows per forward of each data rank's share of the minibatch.
        lr_scheduler, max_grad_norm: as in `posttrain.train.trainer.Trainer`.
        run_dir, checkpoint_every, keep_last, progress, seed, resume: as in `Trainer`.
        verifier_timeout_s: passed to `collect_groups`.
        callbacks: `callback(trainer, row)` after every step.
        runtime: the `PlanRuntime` of `policy.model` under a plan (`runtime =
            plan.parallelize(policy.model, spec=policy.spec)`, before the optimizer was built),
            or None (a `LocalRuntime`: without a plan, ranks of a process group repeat the same
            work). The value head stays a plain module (not split), and `prompts_per_step` must
            be divisible by `runtime.data_size`.
        plan: deprecated (one release): the `ParallelPlan` applied to `policy.model` by the
            deprecated `plan.apply`; checked against the applied plan.
        rollout_quantization: None, or a `posttrain.rl.lowbit_rollout.ROLLOUT_QUANTIZATIONS`
            name: the rollouts sample from a weight-only quantised copy of the current weights;
            the old log-probs are the policy's, recomputed; needs top_p == 1.
        share_prefix: score a group's rows in one packed sequence per prompt (the prompt's
            forward and backward once, not G times; `posttrain.policy.shared_prefix`) when
            that saves work; equal to the unpacked scoring up to float rounding.
        loss_chunk_tokens: None (full [B, T, V] logits), or response tokens per chunk of the
            output projection and log-softmax in every scoring of the rows (the policy's
            log-probs, entropy and values, the reference's and the policy's frozen log-probs;
            `posttrain.policy.chunked_ce`): the loss's peak memory falls from O(B x T x V) to
            O(loss_chunk_tokens x V), equal up to float rounding (fp32: ~1e-7).
        rollout_engine, max_staleness, rollout_options: what samples ("builtin", "vllm" or a
            `RolloutEngine`), how many weight versions behind a sample may be, the engine's
            start options; `posttrain.rl.engine_rollout.ManagedEngine` has the rules.

    Attributes:
        rollout_policy: under a plan, the plain `Policy` copy the rollouts sample from (full
            weights, refreshed at the start of every step); `policy` itself without one.
        sampler_policy, rollout_report: the quantised copy of `rollout_policy` the last
            rollout sampled with, and its `ConversionReport` (`rollout_policy` and None
            without `rollout_quantization`).
        reference: the frozen reference model; None without KL or for a LoRA policy.

    Raises:
        ValueError: for bad options (`loss_chunk_tokens` not None or an int >= 1,
            `algo.overlong_buffer_len` above `max_new_tokens`), a run_dir
            that holds a run while resume is False, or an optimizer that does not hold exactly
            the trainable parameters of the policy and the value head (named;
            `posttrain.train.optimizer_check`); under a plan, a plan not applied to the policy,
            a runtime of another model, a split value head, a missing or plain reference,
            prompts_per_step not divisible by the data-parallel size, or `loss_chunk_tokens`
            with sequence parallelism (sp > 1: the head sees a slice of each sequence) or a
            float8-converted head (`posttrain.policy.chunked_ce.check_chunkable_head`).
    """

    progress_desc = "rl"

    def __init__(
        self,
        policy: Policy,
        optimizer: torch.optim.Optimizer,
        *,
        task: EnvDataset,
        algo: RLAlgorithm,
        prompts_per_step: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        value_head: ValueHead | None = None,
        reference: nn.Module | None = None,
        micro_batch_size: int | None = None,
        lr_scheduler: Any = None,
        max_grad_norm: float | None = 1.0,
        run_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 0,
        keep_last: int | None = 2,
        progress: bool = True,
        seed: int = 0,
        verifier_timeout_s: float | None = None,
        callbacks: Sequence[Callable[[RLTrainer, dict], None]] = (),
        resume: bool | str | os.PathLike = False,
        runtime: Runtime | None = None,
        plan: ParallelPlan | None = None,
        rollout_quantization: str | None = None,
        share_prefix: bool = True,
        loss_chunk_tokens: int | None = None,
        rollout_engine: str | RolloutEngine = "builtin",
        max_staleness: int = 0,
        rollout_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(prompts_per_step, int) or prompts_per_step < 1:
            raise ValueError(f"prompts_per_step={prompts_per_step!r}; must be an integer >= 1")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature!r}; RL samples, so it must be > 0")
        if algo.overlong_buffer_len > max_new_tokens:
            raise ValueError(
                f"algo.overlong_buffer_len={algo.overlong_buffer_len} with max_new_tokens="
                f"{max_new_tokens}: the overlong buffer is the last tokens before the length "
                f"limit, so it must be <= max_new_tokens"
            )
        check_rollout_quantization(rollout_quantization, top_p=top_p)
        self.loss_chunk_tokens = check_chunk_tokens(loss_chunk_tokens)
        if self.loss_chunk_tokens is not None:  # a float8 head: refused before any work
            check_chunkable_head(getattr(policy.model, "output", None))
        runtime = resolve_runtime(
            policy.model, runtime=runtime, plan=plan, replicas=False, argument="policy.model"
        )
        if self.loss_chunk_tokens is not None and runtime.plan is not None and runtime.plan.sp > 1:
            raise ValueError(
                f"loss_chunk_tokens={loss_chunk_tokens} with {runtime.plan}: under sequence "
                "parallelism each rank's head sees a slice of every row (Ulysses gathers the "
                "logits, not the hidden states); allowed: loss_chunk_tokens=None, or sp=1"
            )
        self.rollout = ManagedEngine(
            rollout_engine,
            max_staleness=max_staleness,
            run_dir=run_dir,
            options=rollout_options,
            rollout_quantization=rollout_quantization,
            top_p=top_p,
            runtime=runtime,
        )
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
        )
        if algo.use_value_head and value_head is None:
            value_head = ValueHead(policy.spec.embed_dim)
        if value_head is not None and not algo.use_value_head:
            raise ValueError("a value_head was given but algo.use_value_head is False")
        self.policy, self.task, self.algo = policy, task, algo
        self.prompts_per_step, self.max_new_tokens = prompts_per_step, max_new_tokens
        self.temperature, self.top_p = temperature, top_p
        self.value_head, self.micro_batch_size = value_head, micro_batch_size
        self.share_prefix = share_prefix
        self.seed, self.verifier_timeout_s = seed, verifier_timeout_s
        self.reference: nn.Module | None = None
        self.rollout_report: ConversionReport | None = None
        self.rollout_quantization = rollout_quantization
        self.rollout_policy = self.sampler_policy = policy
        if isinstance(runtime, PlanRuntime):  # a plain copy of the split policy samples
            self.rollout_policy = self.sampler_policy = plan_rollout_parts(
                runtime, policy, value_head=value_head, prompts_per_step=prompts_per_step
            )
        self.reference = checked_reference(
            reference,
            policy,
            runtime=runtime,
            needed=uses_reference(algo, policy.model),
            deprecated_start=self.rollout_policy if plan is not None else None,
        )
        self.buffer = ReplayBuffer(mode="on_policy", seed=seed)
        self.last_groups: list[Group] | None = None
        self.last_builders: Sequence | None = None
        # Rollouts sampled ahead of the update by `posttrain.rl.async_rl.AsyncRLTrainer`: it sets
        # `ahead_state` (their plain state, saved with every checkpoint); a resumed checkpoint's
        # waits in `resumed_ahead` until one is built on this trainer (`step` samples anew).
        self.ahead_state: Callable[[], dict] | None = None
        self.resumed_ahead: dict | None = None
        self._start(resume)

    def _refresh_rollout_policy(self) -> None:
        """Load the policy's full weights into the rollout copy (a collective under a plan); a
        no-op when the policy samples itself."""
        if self.rollout_policy is not self.policy:
            self.rollout_policy.model.load_state_dict(self.runtime.full_state_dict())

    def gathered_policy(self) -> Policy:
        """A `Policy` with the current full weights that runs without collectives: under a plan
        the refreshed rollout copy (a collective: every rank calls it), else `policy` itself.
        Use it to evaluate or save a sharded run (rank 0)."""
        self._refresh_rollout_policy()
        return self.rollout_policy

    def _sampler(self) -> RolloutEngine:
        """The rollout engine holding the weights this step's rollouts sample with: the
        refreshed rollout copy, or with `rollout_quantization` a new quantised copy of it
        (`sampler_policy`, its report in `rollout_report`)."""
        self._refresh_rollout_policy()
        if self.rollout_quantization is not None:
            self.sampler_policy, self.rollout_report = quantized_sampler(
                self.rollout_policy, self.rollout_quantization
            )
        return self.rollout.sampler(self.sampler_policy, self.step_count)

    # ------------------------------------------------------------------ the step
    def step(self) -> dict[str, float]:
        """One RL step (see the module docstring). Returns its metrics row (the time split,
        tokens/s and MFU columns: `posttrain.rl.step_timing`)."""
        start, algo = time.perf_counter(), self.algo
        self._rolled_back, self._timer = False, new_step_timer(self.policy.model)
        rng_state = capture_rng_state()
        P, M = self.prompts_per_step, algo.max_num_gen_batches
        try:  # nothing of the step is applied yet: an interrupt or error here rolls it back
            if algo.filter_groups:  # DAPO dynamic sampling: batches step*M .. step*M + M-1
                builders, groups, sampled = collect_filtered(
                    self._collect,
                    lambda i: self.task.builders(self.step_count * M + i, P),
                    target=P,
                    max_batches=M,
                )
            else:
                builders = self.task.builders(self.step_count, P)
                groups = sampled = self._collect(builders)
        except BaseException:
            restore_rng_state(rng_state)
            self._rolled_back = True
            raise
        return self.train_on_groups(
            groups,
            builders=builders,
            start=start,
            rollout_s=time.perf_counter() - start,
            sampled=sampled,
        )

    def _collect(self, builders: Sequence, gen_batch: int = 0) -> list[Group]:
        """The step's rollout groups (of its `gen_batch`-th batch under dynamic sampling): this
        data rank's slice of `builders` (all of them with one data rank) sampled with seed
        `rollout_seed`, then every data rank's groups (a collective under a plan)."""
        step_seed = self.seed * 1_000_003 + self.step_count + gen_batch * 1_000_000_007
        rank, ranks = self.data_rank_and_size
        mine = data_shares(len(builders), ranks)[rank]
        sampler, timer = self._sampler(), self.__dict__.get("_timer")  # (a step's timer)
        local = collect_groups(
            sampler if timer is None else TimedGeneration(sampler, timer),
            builders[mine.start : mine.stop],
            seed=rollout_seed(step_seed, rank, ranks),
            policy_version=self.step_count,
            **self.collect_options(),
        )
        groups = gather_groups(local, offset=mine.start, runtime=self.runtime)
        self.rollout.check(groups, self.step_count)  # a stale sample: refused, step rolled back
        return groups

    def collect_options(self) -> dict[str, Any]:
        """The sampling and reward settings every rollout of this trainer passes to
        `collect_groups` (its own, and an async trainer's workers')."""
        algo = self.algo
        return {
            "group_size": algo.group_size,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "verifier_timeout_s": self.verifier_timeout_s,
            "overlong_buffer_len": algo.overlong_buffer_len,
            "overlong_penalty_factor": algo.overlong_penalty_factor,
        }

    def fit(self, num_steps: int, *, budget_s: float | None = None) -> Any:
        """`Engine.fit`; the rollout engine is closed however it ends (a new one next time)."""
        try:
            return super().fit(num_steps, budget_s=budget_s)
        finally:
            self.rollout.close()

    def train_on_groups(
        self,
        groups: Sequence[Group],
        *,
        builders: Sequence | None = None,
        start: float | None = None,
        rollout_s: float = 0.0,
        sampled: Sequence[Group] | None = None,
    ) -> dict[str, float]:
        """The training half of a step on given rollout groups (what `step` does after
        sampling): exclusion of failed groups, advantages, buffer, update, scheduler, metrics,
        callbacks, checkpoint. `posttrain.notebook.replay.replay_step` feeds saved rollouts here to
        debug one step. The groups and builders stay readable as `last_groups` /
        `last_builders` (the live dashboard's rollout table). `sampled`: every group the step
        sampled when `groups` is a filtered part of them (dynamic sampling); the rollout
        metrics and token counts are over those. Returns the step's metrics row.

        A Ctrl-C during this half is held until the step is done and recorded (its updates
        cannot be half applied), then raised as KeyboardInterrupt. Under a plan every rank
        passes the same (global) groups; each data rank trains its share of them."""
        with sigint_held() as interrupt:
            row = self._train_on_groups(
                groups, builders, start, rollout_s, groups if sampled is None else sampled
            )
        return self._complete_step(row, interrupted=interrupt.received)

    def _train_on_groups(
        self,
        groups: Sequence[Group],
        builders: Sequence | None,
        start: float | None,
        rollout_s: float,
        sampled: Sequence[Group],
    ) -> dict[str, float]:
        algo = self.algo
        start = time.perf_counter() if start is None else start
        timer = self.__dict__.pop("_timer", None) or new_step_timer(self.policy.model)
        self.last_groups, self.last_builders = list(groups), builders
        kept, counts = split_groups(groups)
        row: dict[str, Any] = {**rollout_metrics(sampled), **counts, "groups_kept": len(kept)}
        if algo.filter_groups:
            row.update(
                groups_filtered=len(sampled) - len(groups),
                gen_batches=-(-len(sampled) // self.prompts_per_step),
            )
        update: dict[str, float] = {}
        batch, frozen = None, {}
        if kept:
            batch = make_batch(kept, self.policy.tokenizer.pad_id)
            with timer.phase("logprobs"):
                frozen = self._frozen_forward(batch)  # ref_logprobs_BT, old_values_BT, ...
            batch.update(frozen)
            sampler_metrics = decouple_sampler(batch, algo)  # {} when the sampler is the policy
            adv_BT, ret_BT = compute_advantages(
                algo.advantage_estimator,
                response_mask_BT=batch["response_mask_BT"],
                scores_B=batch["scores_B"],
                group_ids=batch["group_ids_B"],
                values_BT=batch.get("old_values_BT"),
                gamma=algo.gamma,
                lam=algo.lam,
                norm_adv_by_std_in_grpo=algo.norm_adv_by_std,
            )
            batch.update(advantages_BT=adv_BT, returns_BT=ret_BT)
            mask_BT = batch["response_mask_BT"]
            self.buffer.add(kept, advantages=sequence_advantages(adv_BT, mask_BT))
            self.buffer.drain()  # on-policy: trained on once, in this step
            with timer.phase("update"):
                update = {**self._update(batch), **sampler_metrics}
        self._step_schedule()  # once per RL step, even when no group was kept
        self.step_count += 1
        self.buffer.set_policy_version(self.step_count)
        elapsed = time.perf_counter() - start
        row.update(update, step=self.step_count, rollout_s=rollout_s, step_time_s=elapsed)
        row.update(self.rollout.sync_metrics())  # weight_sync_s (a part of the rollout's time)
        row.update(
            timing_row(
                timer,
                model=self.policy.model,
                groups=sampled,
                batch=batch,
                frozen_passes=len(frozen),
                ppo_epochs=algo.ppo_epochs,
                collect_s=rollout_s,
                step_s=elapsed,
                planned=self.runtime.plan is not None,
            )
        )
        return row
