"""RLAlgorithm (posttrain.rl.config): presets build and pickle, invalid combinations raise when
the config is made and naming the field, registered names refuse duplicates, and non-finite
scores or hyperparameters are rejected; the doctests of posttrain.rl.algorithms and
posttrain.rl.config."""

from __future__ import annotations

import doctest

import cloudpickle
import pytest

import posttrain.rl.algorithms as rl
import posttrain.rl.config as rl_config
from posttrain.rl import RLAlgorithm


def test_doctests():
    for module in (rl, rl_config):
        assert doctest.testmod(module).failed == 0


# --------------------------------------------------------------------------------------------
# RLAlgorithm
# --------------------------------------------------------------------------------------------


def test_presets_build_and_pickle():
    for name in RLAlgorithm.PRESETS:
        algo = RLAlgorithm.preset(name)
        assert cloudpickle.loads(cloudpickle.dumps(algo)) == algo
    assert RLAlgorithm.ppo().use_value_head and RLAlgorithm.ppo().advantage_estimator == "gae"
    assert RLAlgorithm.gspo().policy_loss == "gspo"
    assert RLAlgorithm.cispo().policy_loss == "cispo"
    assert RLAlgorithm.reinforce_plus_plus().group_size == 1
    assert RLAlgorithm.grpo(group_size=16).group_size == 16
    with pytest.raises(ValueError, match="valid: grpo, rloo"):
        RLAlgorithm.preset("dpo")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"advantage_estimator": "nope"}, "valid: .*grpo.*rloo"),
        ({"policy_loss": "nope"}, "valid: .*cispo.*gspo.*vanilla"),
        ({"loss_agg_mode": "mean"}, "valid: token-mean"),
        ({"kl_estimator": "k4"}, "valid: k1, k2, k3"),
        ({"group_size": 1}, "group_size must be at least 2"),
        ({"advantage_estimator": "rloo", "group_size": 1}, "group_size must be at least 2"),
        ({"advantage_estimator": "gae", "group_size": 1}, "use_value_head=True"),
        ({"use_value_head": True, "value_coef": 0.5}, "does not use values"),
        ({"advantage_estimator": "gae", "use_value_head": True}, "value_coef"),
        ({"policy_loss": "sapo"}, "always aggregates"),
        ({"policy_loss": "dro"}, "dro_beta"),
        ({"policy_loss_options": {"beta": 1}}, "unknown keys"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "loss_scale_factor"),
        ({"clip_ratio_low": 0.0}, "clip_ratio_low"),
        ({"clip_ratio_c": 1.0}, "clip_ratio_c"),
        ({"gamma": 1.5}, "gamma"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"minibatch_size": 0}, "minibatch_size"),
    ],
)
def test_invalid_configs_raise_at_config_time(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RLAlgorithm(**kwargs)


def test_valid_combinations():
    RLAlgorithm(advantage_estimator="reinforce_plus_plus", group_size=1)
    RLAlgorithm(advantage_estimator="gae", use_value_head=True, value_coef=1.0, group_size=1)
    RLAlgorithm(policy_loss="dro", policy_loss_options={"dro_beta": 0.1})
    RLAlgorithm(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=512)
    with pytest.raises(TypeError):
        RLAlgorithm("grpo")  # keyword-only


def test_register_refuses_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        rl.register_policy_loss("vanilla")
    with pytest.raises(ValueError, match="already registered"):
        rl.register_advantage_estimator("grpo")


def test_non_finite_scores_and_hyperparameters_are_rejected():
    import math

    import torch

    from posttrain.rl import RLAlgorithm, compute_advantages

    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match="NaN or inf"):
            compute_advantages(
                "grpo",
                response_mask_BT=torch.ones(4, 3),
                scores_B=torch.tensor([bad, 0.0, 0.0, 1.0]),
                group_ids=[0, 0, 1, 1],
            )
    for field in ("kl_coef", "clip_ratio_high", "clip_ratio_low"):
        with pytest.raises(ValueError, match=f"{field}=nan; must be a finite number"):
            RLAlgorithm(**{field: math.nan})


# --------------------------------------------------------------------------------------------
# RLConfig: the grpo and ppo recipes' `rl:` section
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["grpo", "gspo", "ppo"])
def test_the_rl_section_sets_the_clip_range_and_none_keeps_the_presets(algo):
    """gspo's preset clips at 3e-4 / 4e-4 (Zheng et al. 2025), grpo's and ppo's at 0.2: None
    keeps each; a value replaces that one field of the algorithm and nothing else."""
    import dataclasses

    from posttrain.workflows import RLConfig

    default = RLConfig(algo=algo).algorithm()
    preset = RLAlgorithm.preset(algo)
    assert (default.clip_ratio_low, default.clip_ratio_high) == (
        preset.clip_ratio_low,
        preset.clip_ratio_high,
    )
    assert RLConfig(algo=algo, clip_ratio_high=0.28).algorithm() == dataclasses.replace(
        default, clip_ratio_high=0.28
    )
    assert RLConfig(algo=algo, clip_ratio_low=0.1).algorithm() == dataclasses.replace(
        default, clip_ratio_low=0.1
    )


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("clip_ratio_high", 0.0, "> 0 or None"),
        ("clip_ratio_high", float("nan"), "> 0 or None"),
        ("clip_ratio_low", -0.1, "> 0 or None"),
        ("clip_ratio_low", 1.5, "<= 1.0"),
    ],
)
def test_a_bad_clip_ratio_in_the_rl_section_names_the_field(field, value, allowed):
    from posttrain.workflows import RLConfig
    from posttrain.workflows.rl_config import RLRunConfig

    with pytest.raises(ValueError, match=f"Config.rl.{field}={value}; must be .*{allowed}"):
        RLRunConfig(rl=RLConfig(**{field: value}))
