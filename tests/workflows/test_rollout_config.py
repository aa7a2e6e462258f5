"""The RL recipes' `rollout` section (`RolloutConfig`): the engine is chosen by name, bad values
and combinations the engine cannot score are refused naming the dotted field before anything
is written, and the section reaches `RLTrainer` (grpo and ppo share it)."""

import pytest

from posttrain import cli
from posttrain.workflows import override
from posttrain.workflows.rl_config import RolloutConfig


@pytest.mark.parametrize(
    "recipe, overrides, message",
    [
        ("grpo", {"rollout.engine": "vlm"}, r"Config\.rollout\.engine='vlm'; must be one of "
         r"builtin, vllm"),
        ("ppo", {"rollout.engine": "vlm"}, r"Config\.rollout\.engine='vlm'"),
        ("grpo", {"rollout.max_staleness": -1}, r"Config\.rollout\.max_staleness=-1"),
        ("grpo", {"rollout.kv_cache_gib": 0}, r"Config\.rollout\.kv_cache_gib=0"),
        ("grpo", {"rollout.startup_timeout_s": 0.0}, r"Config\.rollout\.startup_timeout_s=0"),
        (
            "grpo",
            {"rollout.engine": "vllm", "quantization.rollout": "int8"},
            r"Config\.rollout\.engine='vllm'; must be builtin with quantization\.rollout='int8'",
        ),
        (
            "ppo",
            {"rollout.engine": "vllm", "sampling.top_p": 0.9},
            r"Config\.rollout\.engine='vllm'; must be builtin with sampling\.top_p=0\.9",
        ),
    ],
)  # fmt: skip
def test_bad_rollout_settings_fail_by_dotted_name(recipe, overrides, message):
    with pytest.raises(ValueError, match=message):
        override(cli.load_recipe(recipe).Config(), overrides)


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_the_rollout_section_reaches_the_trainer(recipe):
    cfg = override(cli.load_recipe(recipe).Config(), {"rollout.engine": "vllm"})
    assert cfg.rollout.trainer_options() == {
        "rollout_engine": "vllm",
        "max_staleness": 0,
        "rollout_options": {"startup_timeout_s": 900.0, "kv_cache_gib": 1},
    }
    assert RolloutConfig().trainer_options()["rollout_engine"] == "builtin"
