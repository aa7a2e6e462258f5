"""The ranks of tests/policy/test_lowbit_rollout.py's plan test: 2 gloo ranks, dp_shard=2, GRPO with
an int8 rollout copy; each rank saves what the test compares to `OUT/plan-rank{rank}.pt`."""

import copy

import torch
from _rl_helpers import ToyTask, is_int8
from torch import nn

from posttrain.policy import Policy
from posttrain.rl import RLAlgorithm, RLTrainer, quantized_rollout_copy


def plan_rank(rank: int, world_size: int, out) -> None:
    """One rank of the plan test (run as `python tests/lowbit_rollout_run.py RANK WORLD OUT`)."""
    import datetime
    from pathlib import Path

    import torch.distributed as dist

    from posttrain.train.parallel import ParallelPlan

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90)
    )
    try:
        plan = ParallelPlan(dp_shard=2)
        policy = Policy.from_spec("tiny-1m", seed=0)
        plan.apply(policy.model, spec=policy.spec)
        algo = RLAlgorithm.grpo(group_size=4, kl_coef=0.05, rollout_correction="token_tis")
        trainer = RLTrainer(
            policy,
            torch.optim.SGD(policy.model.parameters(), lr=0.1),
            task=ToyTask(),
            algo=algo,
            prompts_per_step=4,
            max_new_tokens=3,
            progress=False,
            plan=plan,
            rollout_quantization="int8",
        )
        before = copy.deepcopy(trainer.gathered_policy().model)  # a collective
        row = trainer.step()
        rows = [t for g in trainer.last_groups for t in g]
        prompts, completions = [t.prompt_ids for t in rows], [t.completion_ids for t in rows]
        full = Policy(before, policy.tokenizer, policy.spec)
        low = Policy(quantized_rollout_copy(before, "int8")[0], policy.tokenizer, policy.spec)
        d = torch.cat(
            [
                a - b
                for a, b in zip(
                    full.logprobs(prompts, completions), low.logprobs(prompts, completions)
                )
            ]
        )
        gathered = trainer.rollout_policy.model.layers[0].attn.q_proj.weight
        torch.save(
            {
                "sampler_int8": is_int8(trainer.sampler_policy.model.layers[0].mlp.w1.weight),
                "gathered_plain": type(gathered) is nn.Parameter,
                "first_ratio_mean": row["first_ratio_mean"],
                "delta_max": row["rollout_logprob_delta_max"],
                "rollout_is_mean": row["rollout_is_mean"],
                "rescored_delta_max": d.abs().max().item(),
            },
            Path(out) / f"plan-rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    plan_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
