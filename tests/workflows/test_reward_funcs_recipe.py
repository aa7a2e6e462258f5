"""The RL recipes' `rewards:` section (posttrain.workflows.rewards_config) refuses, before
anything runs, a reward function path that does not resolve, naming the key. A run with an
import-path reward: test_recipes.py::test_the_spell_backward_grpo_preset_runs_at_tiny_size."""

from __future__ import annotations

import pytest

from posttrain import cli
from posttrain.workflows import override
from posttrain.workflows.rl_config import RL_TINY


def test_a_reward_path_that_does_not_resolve_is_refused_by_name(tmp_path, capsys):
    args = [f"{k}={v}" for k, v in RL_TINY.items()]
    bad = [*args, f"out_dir={tmp_path / 'bad'}", "rewards.funcs=[no_such_pkg.rewards:fn]"]
    with pytest.raises(SystemExit) as refused:  # a one-line refusal before the recipe loads
        cli.main(["run", "grpo", *bad])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "Config.rewards.funcs[0]='no_such_pkg.rewards:fn'" in err and "does not import" in err
    assert not (tmp_path / "bad").exists()
    cfg = cli.load_recipe("grpo").Config()
    for changes, match in [
        (
            {"rewards.funcs": ["posttrain.rewards.outcome:FLOAT32_MAX"]},
            r"funcs\[0\].*not a callable",
        ),
        ({"rewards.funcs": ["posttrain.rewards.outcome:missing"]}, "has no attribute 'missing'"),
        (
            {
                "rewards.funcs": ["posttrain.rewards.outcome:check_reward"],
                "rewards.weights": [1, 2],
            },
            r"Config\.rewards\.weights=\[1, 2\]; must be \[\] or 1 numbers",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            override(cfg, changes)
