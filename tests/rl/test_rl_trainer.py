"""RLTrainer: exclusion and zero-signal counts, on-policy ratio 1, a GRPO step moves log-probs the
right way, PPO with a value head runs, micro-batching is invariant, checkpoint/resume is bitwise
equal to an uninterrupted run."""

import math

import pytest
import torch
from _rl_helpers import ToyTask, toy_trainer

from posttrain.policy import Policy
from posttrain.rewards import paired_bootstrap_diff
from posttrain.rl import (
    Group,
    RLAlgorithm,
    RLTrainer,
    Trajectory,
    compute_advantages,
    make_batch,
    split_groups,
)
from posttrain.train import warmup_cosine_schedule


def _traj(group_id, reward, outcome="wrong"):
    return Trajectory(
        group_id=group_id,
        prompt_ids=[1, 2],
        completion_ids=[3, 4],
        logprobs=[-1.0, -1.0],
        reward=reward,
        outcome=outcome,
        finish_reason="stop",
        text="",
    )


def test_all_equal_rewards_give_zero_advantages_and_are_counted():
    groups = [
        Group([_traj(0, 1.0, "ok"), _traj(0, 1.0, "ok")]),
        Group([_traj(1, 0.0), _traj(1, 0.0)]),
        Group([_traj(2, 1.0, "ok"), _traj(2, 0.0)]),
    ]
    kept, counts = split_groups(groups)
    assert len(kept) == 3 and counts["groups_zero_signal"] == 2
    batch = make_batch(kept, pad_id=0)
    adv_BT, _ = compute_advantages(
        "grpo",
        response_mask_BT=batch["response_mask_BT"],
        scores_B=batch["scores_B"],
        group_ids=batch["group_ids_B"],
    )
    assert adv_BT.shape == batch["input_ids_BT"].shape == (6, 4)
    assert not torch.isnan(adv_BT).any()
    assert (adv_BT[:4] == 0).all() and adv_BT[4, 2] > 0 > adv_BT[5, 2]


def test_reward_mean_leaves_out_failed_verifications():
    """Rewards 1 (ok), 0 (wrong), and two failures stored with reward 0.0: the mean is over the
    two judged samples, 1/2, not 1/4; accuracy is over all four samples, 1/4."""
    from posttrain.rl.rollout import rollout_metrics as _rollout_metrics

    groups = [
        Group([_traj(0, 1.0, "ok"), _traj(0, 0.0, "wrong")]),
        Group([_traj(1, 0.0, "error"), _traj(1, 0.0, "timeout")]),
    ]
    row = _rollout_metrics(groups)
    assert row["reward_mean"] == 0.5 and row["accuracy"] == 0.25
    assert row["outcome_error"] == 1 and row["outcome_timeout"] == 1
    assert math.isnan(_rollout_metrics(groups[1:])["reward_mean"])


def test_environment_failures_exclude_groups_and_first_ratio_is_one():
    trainer = toy_trainer(task=ToyTask(broken_every=2))
    row = trainer.step()
    assert row["groups_excluded_error"] == 2 and row["groups_kept"] == 2
    assert row["outcome_error"] == 8
    assert row["first_clipfrac"] == 0.0
    assert abs(row["first_ratio_mean"] - 1.0) < 1e-6


def test_grpo_step_raises_logprob_of_rewarded_completions():
    torch.manual_seed(0)
    trainer = toy_trainer(lr=3e-3)
    policy = trainer.policy
    from posttrain.rl import collect_groups

    groups = collect_groups(
        policy, ToyTask().builders(0, 4), group_size=4, max_new_tokens=3, seed=0
    )  # the same seed the trainer's first step samples with
    rewarded = [t for g in groups for t in g if t.reward == 1.0]
    assert 0 < len(rewarded) < 16

    def mean_logprob():
        lps = policy.logprobs(
            [t.prompt_ids for t in rewarded], [t.completion_ids for t in rewarded]
        )
        return float(torch.stack([lp.sum() for lp in lps]).mean())

    before = mean_logprob()
    row = trainer.step()
    assert row["groups_zero_signal"] < 4 and row["grad_norm"] > 0
    assert mean_logprob() > before + 0.05


def test_ppo_with_value_head_trains_the_head():
    algo = RLAlgorithm.ppo(minibatch_size=4, ppo_epochs=2, group_size=1)
    trainer = toy_trainer(algo=algo)
    head_before = trainer.value_head.proj.bias.detach().clone()
    rows = [trainer.step() for _ in range(2)]
    assert all(r["vf_loss"] >= 0 for r in rows)
    assert not torch.equal(trainer.value_head.proj.bias, head_before)


def test_micro_batches_give_the_same_update_as_one_batch():
    """The loss of each minibatch is normalised over the whole minibatch (step_units), so
    gradient accumulation over micro-batches of 3 rows equals one batch of 16 (SGD, so that the
    update is proportional to the gradient; Adam would magnify float rounding of ~0 gradients)."""
    a = toy_trainer(lr=1.0, optimizer=torch.optim.SGD)
    b = toy_trainer(lr=1.0, optimizer=torch.optim.SGD, micro_batch_size=3)
    row_a, row_b = a.step(), b.step()
    assert row_a["groups_zero_signal"] < 4
    assert abs(row_a["pg_loss"] - row_b["pg_loss"]) < 1e-6
    for p, q in zip(a.policy.model.parameters(), b.policy.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)


def _run(run_dir, steps, resume=False):
    policy = Policy.from_spec("tiny-1m", seed=0)
    algo = RLAlgorithm.grpo(group_size=4, kl_coef=0.04, minibatch_size=8)
    opt = torch.optim.AdamW(policy.model.parameters(), lr=1e-3)
    sched = warmup_cosine_schedule(opt, warmup_steps=1, total_steps=4)
    trainer = RLTrainer(
        policy,
        opt,
        task=ToyTask(),
        algo=algo,
        prompts_per_step=4,
        max_new_tokens=3,
        lr_scheduler=sched,
        run_dir=run_dir,
        checkpoint_every=1,
        keep_last=None,
        progress=False,
        seed=7,
        resume=resume,
    )
    trainer.fit(steps)
    return trainer


def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, deterministic):
    full = _run(tmp_path / "full", 3)
    _run(tmp_path / "cut", 2)
    resumed = _run(tmp_path / "cut", 3, resume=True)
    for (name, a), b in zip(
        full.policy.model.state_dict().items(), resumed.policy.model.state_dict().values()
    ):
        assert torch.equal(a, b), name
    assert full.metrics["reward_mean"].tolist() == resumed.metrics["reward_mean"].tolist()
    assert len(resumed.metrics) == 3


def test_doctests():
    import doctest

    import posttrain.rl.trainer as module

    assert doctest.testmod(module).failed == 0


def test_paired_bootstrap_difference_of_the_main_job():
    """A = [1, 1, 0, 0], B = [0, 1, 0, 0]: difference 1/4; every resample lies in [0, 1]."""
    diff = paired_bootstrap_diff([1, 1, 0, 0], [0, 1, 0, 0], seed=0)
    assert diff["difference"] == 0.25 and diff["num_items"] == 4
    assert 0.0 <= diff["ci_low"] <= 0.25 <= diff["ci_high"] <= 1.0
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap_diff([1, 0], [1])
