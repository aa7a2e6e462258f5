"""DAPO's soft overlong punishment (`RLAlgorithm(overlong_buffer_len=...)`): the penalty equals
what verl's DAPO reward manager adds, rollouts carry it on exactly their judged trajectories, a
trainer passes it to its rollouts, and bad settings are refused by name."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _rl_helpers import ToyBuilder, toy_trainer

from posttrain.policy import Policy
from posttrain.rl import RLAlgorithm, collect_groups
from posttrain.rl.rollout import overlong_penalty, rollout_metrics


def _verl_overlong(length: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """The reward verl's `DAPORewardManager` gives a response of `length` tokens when the task's
    own score is 0 (its overlong term alone)."""
    from verl import DataProto
    from verl.workers.reward_manager.dapo import DAPORewardManager

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "", eos_token="</s>")
    manager = DAPORewardManager(
        tokenizer,
        num_examine=0,
        compute_score=lambda **kwargs: 0.0,
        max_resp_len=max_new_tokens,
        overlong_buffer_cfg=SimpleNamespace(
            enable=True, len=buffer_len, penalty_factor=factor, log=False
        ),
    )
    response_mask = [1] * length + [0] * (max_new_tokens - length)
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([[5, 6]]),
            "responses": torch.full((1, max_new_tokens), 7),
            "attention_mask": torch.tensor([[1, 1, *response_mask]]),
        },
        non_tensors={
            "reward_model": np.array([{"ground_truth": ""}], dtype=object),
            "data_source": np.array(["task"], dtype=object),
        },
    )
    return float(manager(data).sum())


@pytest.mark.parametrize(
    "max_new_tokens, buffer_len, factor", [(8, 1, 1.0), (7, 3, 0.5), (4, 4, 2)]
)
def test_penalty_equals_verls_dapo_reward_manager(max_new_tokens, buffer_len, factor):
    for length in range(1, max_new_tokens + 1):
        expected = _verl_overlong(length, max_new_tokens, buffer_len, factor)
        assert overlong_penalty(length, max_new_tokens, buffer_len, factor) == pytest.approx(
            expected, abs=1e-7
        ), length


def test_rollouts_add_the_penalty_of_their_length_to_judged_trajectories_only():
    policy = Policy.from_spec("tiny-1m", seed=0)
    builders = [ToyBuilder("ab"), ToyBuilder("cd"), ToyBuilder("boom", raises=True)]
    options = dict(group_size=8, max_new_tokens=4, seed=1, temperature=1.5)
    plain = collect_groups(policy, builders, **options)
    punished = collect_groups(
        policy, builders, overlong_buffer_len=2, overlong_penalty_factor=0.5, **options
    )
    lengths, penalties = [], []
    for g_plain, g_punished in zip(plain, punished):
        for a, b in zip(g_plain, g_punished):
            assert a.completion_ids == b.completion_ids  # the same samples
            length = len(a.completion_ids)
            lengths.append(length)
            if a.outcome == "error":
                assert b.reward == a.reward == 0.0 and "overlong_penalty" not in b.info
                continue
            # by hand: 0 up to 4 - 2 tokens, then -0.25 per token past it
            expected = -0.25 * max(length - 2, 0)
            assert b.reward == pytest.approx(a.reward + expected)
            assert b.info["overlong_penalty"] == pytest.approx(expected)
            penalties.append(expected)
    assert {2, 3, 4} & set(lengths) and min(penalties) < 0  # the buffer was reached
    metrics = rollout_metrics(punished)
    assert metrics["overlong_penalty"] == pytest.approx(sum(penalties) / len(penalties))
    assert metrics["reward_mean"] == pytest.approx(
        rollout_metrics(plain)["reward_mean"] + sum(penalties) / len(penalties)
    )
    assert "overlong_penalty" not in rollout_metrics(plain)


def _algo(**options):
    return RLAlgorithm.grpo(group_size=4, kl_coef=0.0, **options)


def test_a_trainer_step_punishes_its_rollouts():
    trainer = toy_trainer(algo=_algo(overlong_buffer_len=3, overlong_penalty_factor=1.0))
    row = trainer.step()
    rows = [t for g in trainer.last_groups for t in g]
    expected = [-len(t.completion_ids) / 3 for t in rows]  # the buffer is the whole limit (3)
    assert [t.info["overlong_penalty"] for t in rows] == pytest.approx(expected)
    assert row["overlong_penalty"] == pytest.approx(sum(expected) / len(expected))


@pytest.mark.parametrize(
    "options, field",
    [
        ({"overlong_buffer_len": -1}, "overlong_buffer_len"),
        ({"overlong_buffer_len": 1.5}, "overlong_buffer_len"),
        ({"overlong_penalty_factor": float("nan")}, "overlong_penalty_factor"),
        ({"overlong_penalty_factor": -0.5}, "overlong_penalty_factor"),
    ],
)
def test_bad_settings_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        RLAlgorithm.grpo(**options)


def test_a_buffer_longer_than_the_limit_is_refused():
    with pytest.raises(ValueError, match="overlong_buffer_len=4 with max_new_tokens=3"):
        toy_trainer(algo=_algo(overlong_buffer_len=4))  # its max_new_tokens is 3
    policy = Policy.from_spec("tiny-1m", seed=0)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        collect_groups(
            policy, [ToyBuilder("a")], group_size=2, max_new_tokens=2, overlong_buffer_len=3
        )


def test_the_run_config_refuses_a_buffer_past_sampling_max_new_tokens():
    from posttrain.workflows import RLRunConfig, override

    with pytest.raises(ValueError, match=r"Config\.rl\.overlong_buffer_len=9.*max_new_tokens=8"):
        override(RLRunConfig(), {"rl.overlong_buffer_len": 9, "sampling.max_new_tokens": 8})
