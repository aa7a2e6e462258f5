"""DAPO dynamic sampling (`RLAlgorithm(filter_groups=True)`): a step trains exactly on the groups
with mixed rewards that the batches it sampled held, counts what it dropped, and equals the
plain training half run by hand on those groups; bad options are refused by name."""

import doctest
from dataclasses import dataclass, replace

import pytest
import torch

import posttrain.rl.rollout as rollout_module
from posttrain.policy import Policy
from posttrain.rewards import VerifierResult
from posttrain.rl import Group, RLAlgorithm, RLTrainer, StepResult, collect_groups


class Env:
    def __init__(self, prompt: str):
        self.prompt = prompt

    def initial_messages(self):
        return [{"role": "user", "content": self.prompt}]

    def step(self, text):
        # "const" prompts: reward 1 whatever is sampled (a group with no signal); the others:
        # 1 when the completion starts with an ASCII character (mixed in most groups)
        score = 1.0 if self.prompt.startswith("const") or (text and ord(text[0]) < 128) else 0.0
        return StepResult(done=True, reward=score, verifier_result=VerifierResult.from_score(score))


@dataclass(frozen=True)
class Builder:
    prompt: str

    def make_envs(self, group_size):
        return [Env(self.prompt) for _ in range(group_size)]


@dataclass
class Task:
    constant_every: int = 2  # every k-th prompt always scores 1 (1: all of them)

    def builders(self, batch_index, batch_size):
        ids = [batch_index * batch_size + j for j in range(batch_size)]
        return [Builder(f"{'const' if i % self.constant_every == 0 else 'q'}{i}") for i in ids]

    def held_out(self, n):
        return []


def _trainer(task, **algo_options):
    policy = Policy.from_spec("tiny-1m", seed=0)
    algo = RLAlgorithm.grpo(group_size=4, kl_coef=0.0, **algo_options)
    return RLTrainer(
        policy,
        torch.optim.SGD(policy.model.parameters(), lr=0.5),
        task=task,
        algo=algo,
        prompts_per_step=4,
        max_new_tokens=3,
        progress=False,
        seed=3,
    )


def test_filtered_step_equals_training_by_hand_on_the_mixed_groups(deterministic):
    task = Task()
    dynamic = _trainer(task, filter_groups=True, max_num_gen_batches=3)
    by_hand = _trainer(task)
    row = dynamic.step()

    # the slower path: sample the step's batches (0*3 + i) with the seeds the step uses, keep
    # the first 4 groups whose rewards are not all equal, renumber them, train on them
    kept, sampled = [], []
    for i in range(3):
        groups = collect_groups(
            by_hand.policy,
            task.builders(i, 4),
            group_size=4,
            max_new_tokens=3,
            seed=3 * 1_000_003 + i * 1_000_000_007,
        )
        sampled += groups
        kept += [g for g in groups if len(set(g.rewards)) > 1]
        if len(kept) >= 4:
            break
    kept = [Group([replace(t, group_id=k) for t in g]) for k, g in enumerate(kept[:4])]
    assert len(kept) == 4
    expected = by_hand.train_on_groups(kept, sampled=sampled)

    for p, q in zip(dynamic.policy.model.parameters(), by_hand.policy.model.parameters()):
        assert torch.equal(p, q)
    assert row["groups_kept"] == 4 and row["groups_zero_signal"] == 0
    assert row["groups_filtered"] == len(sampled) - 4 >= 2  # at least the "const" prompts
    assert row["gen_batches"] == len(sampled) // 4 >= 2
    rewards = [r for g in sampled for r in g.rewards]
    assert row["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert row["pg_loss"] == expected["pg_loss"]


def test_no_mixed_group_in_any_batch_trains_nothing_and_counts_it():
    trainer = _trainer(Task(constant_every=1), filter_groups=True, max_num_gen_batches=2)
    before = [p.detach().clone() for p in trainer.policy.model.parameters()]
    row = trainer.step()
    assert row["groups_kept"] == 0 and row["groups_filtered"] == 8 and row["gen_batches"] == 2
    assert row["reward_mean"] == 1.0 and trainer.step_count == 1
    for p, q in zip(before, trainer.policy.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"max_num_gen_batches": 0}, "max_num_gen_batches"),
        ({"filter_groups": "yes"}, "filter_groups"),
    ],
)
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        RLAlgorithm.grpo(**options)


def test_collect_filtered_doctest():
    assert doctest.testmod(rollout_module).failed == 0
