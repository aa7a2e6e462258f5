"""One rank of the trainer-under-a-plan runs of tests/rl/test_plans_trainers.py; run as a
subprocess.

    MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python tests/plans_trainers_run.py RANK WORLD OUT PHASE

PHASE "two" (2 ranks): DPO (policy and reference both split), the Bradley-Terry reward model,
GRPO (with a split reference) and PPO (value head, split reference) under `PLANS_2`, and the
sequence- and expert-parallel cases `CASES_SP_EP`; a PPO run under dp_shard=2 checkpointed after
step 2 and resumed to step 3 next to the uninterrupted run; DPO under dp_shard=2 with the policy as
its own reference, an eval_fn and a checkpoint every step; the reward model under dp_shard=2 after a
no-grad forward before its optimizer; the refusals of a misused plan; then the grpo, dpo (KTO) and
reward_model recipes at a size below TINY under a plan (`RECIPE_RUNS`, in OUT/<recipe>: these
ranks already hold the imports a recipe needs, most of a recipe process's cost). PHASE "four" (4
ranks): DPO and GRPO under `PLANS_4`. Results go to OUT/{PHASE}-rank{RANK}.pt. Each `run_*` with
plan=None is the one-process reference the test runs itself (for RL: `rollout_ranks` = the plan's
data-parallel size, so the one process samples the prompts in the same slices with the same seeds).
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from pathlib import Path
from typing import Any

import torch
from _train_helpers import TINY

from posttrain.data import PreferenceDataset
from posttrain.models import ByteTokenizer, build_model, get_preset
from posttrain.policy import Policy
from posttrain.preference import (
    BradleyTerryLoss,
    DPOLoss,
    ShardedPreferenceLoader,
    compute_reference_logps,
    parallelize_reward_model,
)
from posttrain.rewards import RewardModel, VerifierResult
from posttrain.rl import Group, RLAlgorithm, RLTrainer, StepResult, ValueHead, make_batch
from posttrain.rl.parallel import data_shares, frozen_reference, rollout_seed
from posttrain.rl.rollout import collect_groups
from posttrain.train import ParallelPlan, Runtime, Trainer, full_state_dict

PLANS_2 = {"dp_shard2": ParallelPlan(dp_shard=2), "tp2": ParallelPlan(tp=2)}
PLANS_4 = {"dp_shard2_tp2": ParallelPlan(dp_shard=2, tp=2)}
MOE = dataclasses.replace(get_preset("tiny-moe"), router_aux_loss_coef=0.0, max_seq_len=64)
"""The MoE model of the ep case. The router's load-balancing loss is per rank (each ep rank's own
tokens), so it is off here; the RL losses add none anyway."""
PLANS_SP_EP = {"sp2": ParallelPlan(sp=2), "ep2": ParallelPlan(ep=2)}
CASES_SP_EP = {
    ("dpo", "sp2"): TINY,
    ("reward_model", "sp2"): TINY,
    ("grpo", "sp2"): TINY,
    ("grpo", "ep2"): MOE,
    ("ppo", "ep2"): MOE,
}
"""The sequence- and expert-parallel cases of PHASE "two": (trainer, plan name) -> model spec.
Under sp=2 there is one data rank (both sp ranks train and sample the same rows); under ep=2
two. PPO under sp is refused (its value head reads a sequence-sliced hidden state: `misuse`)."""
PREF_STEPS, RL_STEPS, RESUME_STEPS = 2, 2, 3
TRAINERS = ("dpo", "reward_model", "grpo", "ppo")
TRAINERS_4 = ("dpo", "grpo")  # the 4-rank phase: a split reference in each, and RL rollouts


# ---------------------------------------------------------------------- preference
def preference_rows(n: int = 9) -> list[dict]:
    """Pairs whose lengths all differ; 9 of them in batches of 4 leave a last batch of one
    pair, so under dp_shard=2 the second data rank trains a padding batch there."""
    return [
        {
            "prompt": f"{3 + 7 * i}+{11 + 5 * i}=" + "?" * (i % 3),
            "chosen": f"{14 + 12 * i}" + " ok" * (i % 4),
            "rejected": f"{i}" + "x" * (1 + i % 5),
        }
        for i in range(n)
    ]


def _data_shard(runtime: Runtime | None) -> tuple[int, int]:
    return (0, 1) if runtime is None else (runtime.data_rank, runtime.data_size)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def run_dpo(
    plan: ParallelPlan | None, *, self_reference: bool = False, run_dir: Path | None = None
) -> dict[str, Any]:
    """DPO, batch 4 x accumulation 2, clipping at 1.0, SGD: the policy from seed 0, a separate
    frozen reference from seed 1, both split by `plan`; reference log-probs computed once on
    the split reference. `self_reference`: the policy is its own reference (as the DPO recipe
    does: scored before the optimizer is built), with an eval_fn and a checkpoint after every
    step in `run_dir` (a no-grad forward before a sharded save)."""
    dataset = PreferenceDataset(preference_rows(), ByteTokenizer(), max_seq_len=48)
    policy, reference = build_model(TINY, seed=0), build_model(TINY, seed=1)
    runtime = reference_runtime = None
    if plan is not None:
        runtime = plan.parallelize(policy, spec=TINY)
        reference_runtime = plan.parallelize(reference, spec=TINY)
    objective, options = DPOLoss(beta=0.1), {}
    reference.requires_grad_(False)
    scored = (runtime or policy) if self_reference else (reference_runtime or reference)
    compute_reference_logps(scored, dataset, batch_size=4)
    if self_reference:
        batch = dataset.collate(range(3))
        options = dict(
            eval_fn=lambda m: objective.metrics(m, batch),
            eval_every=1,
            run_dir=run_dir,
            checkpoint_every=1 if run_dir else 0,
        )
    rank, size = _data_shard(runtime)
    loader = ShardedPreferenceLoader(dataset, batch_size=4, seed=0, rank=rank, world_size=size)
    trainer = Trainer(
        policy,
        _sgd(policy.parameters()),
        data=loader,
        loss=objective,
        grad_accum_steps=2,
        max_grad_norm=1.0,
        progress=False,
        runtime=runtime,
        **options,
    )
    metrics = trainer.fit(PREF_STEPS)
    return {
        "losses": metrics["loss"].tolist(),
        "units": metrics["trained_tokens"].tolist(),
        "grad_norms": metrics["grad_norm"].tolist(),
        "params": full_state_dict(runtime or policy),
        "reference": dict(dataset.reference.values),
    }


def run_reward_model(plan: ParallelPlan | None, *, look_first: bool = False) -> dict[str, Any]:
    """The Bradley-Terry reward model (backbone from seed 0 + head), the same batches as DPO.
    `look_first`: rewards of two rows under torch.no_grad() before the optimizer is built (the
    RewardModel, not its backbone, is FSDP2's root then)."""
    dataset = PreferenceDataset(preference_rows(), ByteTokenizer(), max_seq_len=48)
    model = RewardModel.from_spec(TINY, seed=0)
    runtime = None if plan is None else parallelize_reward_model(plan, model)
    if look_first:
        with torch.no_grad():
            model(torch.arange(16).reshape(2, 8))
    rank, size = _data_shard(runtime)
    loader = ShardedPreferenceLoader(dataset, batch_size=4, seed=0, rank=rank, world_size=size)
    trainer = Trainer(
        model,
        _sgd(model.parameters()),
        data=loader,
        loss=BradleyTerryLoss(),
        grad_accum_steps=2,
        max_grad_norm=1.0,
        progress=False,
        runtime=runtime,
    )
    metrics = trainer.fit(PREF_STEPS)
    return {
        "losses": metrics["loss"].tolist(),
        "units": metrics["trained_tokens"].tolist(),
        "grad_norms": metrics["grad_norm"].tolist(),
        "params": full_state_dict(runtime or model),
    }


# ---------------------------------------------------------------------- RL
class ToyEnv:
    """Reward 1 when the completion starts with an ASCII character (about half of a random
    tiny policy's samples), else 0."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt

    def initial_messages(self):
        return [{"role": "user", "content": self.prompt}]

    def step(self, text):
        score = 1.0 if text and ord(text[0]) < 128 else 0.0
        return StepResult(done=True, reward=score, verifier_result=VerifierResult.from_score(score))


@dataclasses.dataclass(frozen=True)
class ToyBuilder:
    prompt: str

    def make_envs(self, group_size):
        return [ToyEnv(self.prompt) for _ in range(group_size)]


@dataclasses.dataclass
class ToyTask:
    def builders(self, batch_index, batch_size):
        return [ToyBuilder(f"q{batch_index * batch_size + j}") for j in range(batch_size)]

    def held_out(self, n):
        return []


class SlicedRollouts(RLTrainer):
    """One process that samples each step's prompts in `rollout_ranks` slices with the seeds a
    plan with that many data-parallel ranks uses: the global batch such a plan gathers."""

    rollout_ranks = 1

    def _collect(self, builders):
        step_seed = self.seed * 1_000_003 + self.step_count
        groups = []
        for r, share in enumerate(data_shares(len(builders), self.rollout_ranks)):
            local = collect_groups(
                self.policy,
                builders[share.start : share.stop],
                group_size=self.algo.group_size,
                max_new_tokens=self.max_new_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=rollout_seed(step_seed, r, self.rollout_ranks),
                policy_version=self.step_count,
            )
            groups += [
                Group([dataclasses.replace(t, group_id=share.start + i) for t in g])
                for i, g in enumerate(local)
            ]
        return groups


ALGOS = {
    "grpo": lambda: RLAlgorithm.grpo(group_size=4, kl_coef=0.05, minibatch_size=8),
    "ppo": lambda: RLAlgorithm.ppo(kl_coef=0.05, ppo_epochs=2, minibatch_size=3),
}
"""GRPO: 4 prompts x 4 samples, minibatches of 8 (2 optimizer steps per RL step). PPO: 4
prompts x 1 sample, 2 epochs of minibatches of 3 (3 + 1 rows: under dp_shard=2 the second data
rank of the last minibatch runs a padding micro-batch)."""


def _groups_record(groups) -> list[dict]:
    return [
        {
            "group_id": t.group_id,
            "completion_ids": list(t.completion_ids),
            "logprobs": list(t.logprobs),
            "reward": t.reward,
        }
        for g in groups
        for t in g
    ]


def run_rl(
    plan: ParallelPlan | None,
    algo_name: str,
    *,
    rollout_ranks: int = 1,
    steps: int = RL_STEPS,
    spec: Any = TINY,
    **trainer_kwargs,
) -> dict[str, Any]:
    """`steps` RL steps of `spec` (seed 0) with SGD, micro-batches of 2 rows, under `plan`.
    Returns the metrics rows, the rollouts of every step, the full policy and value-head
    weights, and max |sampler log-prob - training log-prob| on the first step's rollouts
    (before any update)."""
    algo = ALGOS[algo_name]()
    policy = Policy(build_model(spec, seed=0), ByteTokenizer(), spec)
    reference = None if plan is None else frozen_reference(policy)  # split as the policy is
    runtime = None if plan is None else plan.parallelize(policy.model, spec=spec)
    if plan is not None and runtime is not None:
        plan.parallelize(reference, spec=spec, mesh=runtime.mesh)
    head = ValueHead(spec.embed_dim) if algo.use_value_head else None
    params = list(policy.model.parameters()) + (list(head.parameters()) if head else [])
    cls = (
        type("Sliced", (SlicedRollouts,), {"rollout_ranks": rollout_ranks})
        if plan is None
        else RLTrainer
    )
    rollouts = []
    trainer = cls(
        policy,
        torch.optim.SGD(params, lr=0.1, momentum=0.9),
        task=ToyTask(),
        algo=algo,
        prompts_per_step=4,
        max_new_tokens=4,
        value_head=head,
        reference=reference,
        micro_batch_size=2,
        progress=False,
        runtime=runtime,
        callbacks=[lambda t, row: rollouts.append(_groups_record(t.last_groups))],
        **trainer_kwargs,
    )
    delta = None
    if trainer.step_count == 0:  # the contract on the first rollouts, under the split policy
        groups = trainer._collect(ToyTask().builders(0, 4))
        batch = make_batch(groups, ByteTokenizer().pad_id)
        with torch.no_grad():
            logprobs_BT, _, _ = trainer._forward(policy.model, batch, value_head=None)
        mask = batch["response_mask_BT"]
        delta = float((logprobs_BT - batch["old_logprobs_BT"])[mask].abs().max())
    metrics = trainer.fit(steps)
    rows = [
        {k: v for k, v in row.items() if not k.endswith("_s") and k != "mfu"}
        for row in metrics.to_dict("records")
    ]
    return {
        "rows": rows,
        "rollouts": rollouts,
        "params": full_state_dict(runtime or policy.model),
        "value_head": None
        if head is None
        else {k: v.detach().clone() for k, v in head.state_dict().items()},
        "delta_logp": delta,
    }


# ---------------------------------------------------------------------- phases
def run_all(plans: dict[str, ParallelPlan], trainers=TRAINERS) -> dict[str, Any]:
    runs = {
        "dpo": run_dpo,
        "reward_model": run_reward_model,
        "grpo": lambda p: run_rl(p, "grpo"),
        "ppo": lambda p: run_rl(p, "ppo"),
    }
    return {
        (trainer, name): runs[trainer](plan) for name, plan in plans.items() for trainer in trainers
    }


def sp_ep_runs() -> dict[tuple[str, str], Any]:
    """`CASES_SP_EP`, each under its plan of `PLANS_SP_EP`."""
    preference = {"dpo": run_dpo, "reward_model": run_reward_model}
    return {
        (trainer, name): (
            preference[trainer](PLANS_SP_EP[name])
            if trainer in preference
            else run_rl(PLANS_SP_EP[name], trainer, spec=spec)
        )
        for (trainer, name), spec in CASES_SP_EP.items()
    }


def self_reference_run(out: Path) -> dict[str, Any]:
    """DPO under dp_shard=2 with the policy as its own reference, an eval_fn and a sharded
    checkpoint after every step."""
    result = run_dpo(ParallelPlan(dp_shard=2), self_reference=True, run_dir=out / "dpo_self")
    result["found"] = sorted(p.name for p in (out / "dpo_self" / "checkpoints").iterdir())
    return result


def resume_runs(out: Path) -> dict[str, Any]:
    """PPO under dp_shard=2: checkpoint after step 2 of 2, resume to 3; uninterrupted to 3."""
    plan = ParallelPlan(dp_shard=2)
    run_dir = out / "rl_resume"
    first = run_rl(plan, "ppo", steps=2, run_dir=run_dir, checkpoint_every=2)
    resumed = run_rl(
        plan, "ppo", steps=RESUME_STEPS, run_dir=run_dir, checkpoint_every=2, resume=True
    )
    whole = run_rl(plan, "ppo", steps=RESUME_STEPS)
    return {
        "first": first,
        "resumed": resumed,
        "uninterrupted": whole,
        "found": sorted(p.name for p in (run_dir / "checkpoints").iterdir()),
    }


def misuse() -> dict[str, str]:
    """Errors of: an RL optimizer built before plan.parallelize; prompts_per_step not divisible by
    the data-parallel size; a value head under sp=2; a reference missing, plain or taken late."""
    errors = {}
    plan = ParallelPlan(dp_shard=2)

    def attempt(name, build):
        try:
            build()
        except ValueError as e:
            errors[name] = str(e)

    def before_apply():
        policy = Policy(build_model(TINY, seed=0), ByteTokenizer(), TINY)
        opt = torch.optim.SGD(policy.model.parameters(), lr=0.1)
        runtime = plan.parallelize(policy.model, spec=TINY)
        RLTrainer(
            policy,
            opt,
            task=ToyTask(),
            algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.0),  # no reference to give
            prompts_per_step=2,
            max_new_tokens=2,
            progress=False,
            runtime=runtime,
        )

    def indivisible():
        runtime = plan.parallelize(build_model(TINY, seed=0), spec=TINY)
        policy = Policy(runtime.model, ByteTokenizer(), TINY)
        RLTrainer(
            policy,
            torch.optim.SGD(policy.model.parameters(), lr=0.1),
            task=ToyTask(),
            algo=RLAlgorithm.grpo(group_size=2),
            prompts_per_step=3,
            max_new_tokens=2,
            progress=False,
            runtime=runtime,
        )

    def value_head_under_sp():
        runtime = ParallelPlan(sp=2).parallelize(build_model(TINY, seed=0), spec=TINY)
        policy = Policy(runtime.model, ByteTokenizer(), TINY)
        head = ValueHead(TINY.embed_dim)
        RLTrainer(
            policy,
            torch.optim.SGD([*policy.model.parameters(), *head.parameters()], lr=0.1),
            task=ToyTask(),
            algo=RLAlgorithm.ppo(),
            prompts_per_step=2,
            max_new_tokens=2,
            value_head=head,
            progress=False,
            runtime=runtime,
        )

    def reference(given: str):  # the plan splits the policy; the reference: none, or plain
        policy = Policy(build_model(TINY, seed=0), ByteTokenizer(), TINY)
        plain = frozen_reference(policy)
        runtime = plan.parallelize(policy.model, spec=TINY)
        if given == "taken_after_the_split":
            frozen_reference(policy)
        RLTrainer(
            policy,
            torch.optim.SGD(policy.model.parameters(), lr=0.1),
            task=ToyTask(),
            algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.1),
            prompts_per_step=2,
            max_new_tokens=2,
            reference=plain if given == "plain" else None,
            progress=False,
            runtime=runtime,
        )

    for given in ("plain", "none", "taken_after_the_split"):
        attempt(f"reference_{given}", lambda given=given: reference(given))
    attempt("optimizer_before_apply", before_apply)
    attempt("prompts_not_divisible", indivisible)
    attempt("value_head_under_sp", value_head_under_sp)
    return errors


SMALLER = {"sft.steps": 1, "task.eval_size": 1, "optim.steps": 1, "optim.warmup_steps": 0}
"""Each recipe's TINY at about half its work: one SFT step, one held-out item, one step."""
RECIPE_RUNS = {
    "grpo": {**SMALLER, "parallel.dp_shard": 2, "eval.every": 0, "baseline.steps": 0},
    "dpo": {**SMALLER, "parallel.dp_shard": 2, "loss": "kto"},
    "reward_model": {**SMALLER, "parallel.tp": 2, "pairs.num_prompts": 8, "optim.steps": 2},
}
"""The recipes PHASE "two" runs last, under a plan, to show they run there and rank 0 alone writes
(grpo: no held-out curve nor more-SFT baseline; reward_model evaluates and saves at step 2)."""


def recipe_runs(out: Path) -> dict[str, Any]:
    from posttrain import cli
    from posttrain.workflows import override

    results = {}
    for name, extra in RECIPE_RUNS.items():
        module = cli.load_recipe(name)
        cfg = override(module.Config(), {**module.TINY, "out_dir": str(out / name), **extra})
        results[name] = module.main(cfg)
    return results


def main() -> None:
    rank, world_size = int(sys.argv[1]), int(sys.argv[2])
    out, phase = Path(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90)
    )
    try:
        if phase == "two":
            results = {
                "runs": {**run_all(PLANS_2), **sp_ep_runs()},
                "resume": resume_runs(out),
                "errors": misuse(),
                "dpo_self_reference": self_reference_run(out),
                "reward_model_looked": run_reward_model(ParallelPlan(dp_shard=2), look_first=True),
                "ppo_tp2_chunked": run_rl(PLANS_2["tp2"], "ppo", loss_chunk_tokens=3),
                "recipes": recipe_runs(out),
            }
        else:
            results = {"runs": run_all(PLANS_4, TRAINERS_4)}
        torch.save(results, out / f"{phase}-rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
