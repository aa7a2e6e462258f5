"""`optim.loss_chunk_tokens` (and the SFT warm start's `sft.loss_chunk_tokens`): one key in every
recipe, from the command line and from YAML, validated with its dotted name, refused where the
chunked loss cannot run (the reward model's scalar head, sequence or pipeline parallelism),
free to change on resume, and handed to the stage's loss or trainer."""

import pytest

from posttrain import cli
from posttrain.workflows.recipes import apply_overrides, load_config_file
from posttrain.workflows.reports import _check_resumed_config

CHUNKED = ("sft", "dpo", "grpo", "ppo")
WITH_WARM_START = ("dpo", "grpo", "ppo", "reward_model")


def _config(recipe: str, *overrides: str):
    module = cli.load_recipe(recipe)
    return apply_overrides(module.Config(), list(overrides))


@pytest.mark.parametrize("recipe", CHUNKED + ("reward_model",))
def test_one_key_in_every_recipe_from_the_command_line(recipe):
    default = _config(recipe)
    assert default.optim.loss_chunk_tokens is None
    if recipe in WITH_WARM_START:
        assert default.sft.loss_chunk_tokens is None
        warm = _config(recipe, "sft.loss_chunk_tokens=256")
        assert warm.sft.loss_chunk_tokens == 256 and warm.sft.optim().loss_chunk_tokens == 256
    if recipe == "reward_model":  # a scalar head on the final hidden state: no V to chunk
        with pytest.raises(
            ValueError, match=r"^Config\.optim\.loss_chunk_tokens=512; .*None: the reward model"
        ):
            _config(recipe, "optim.loss_chunk_tokens=512")
        return
    cfg = _config(recipe, "optim.loss_chunk_tokens=512")
    assert cfg.optim.loss_chunk_tokens == 512 and type(cfg.optim.loss_chunk_tokens) is int
    assert _config(recipe, "optim.loss_chunk_tokens=none").optim.loss_chunk_tokens is None


def test_a_preset_file_sets_it(tmp_path):
    preset = tmp_path / "chunked.yaml"
    preset.write_text("optim:\n  loss_chunk_tokens: 128\nsft:\n  loss_chunk_tokens: 64\n")
    cfg = load_config_file(cli.load_recipe("grpo").Config(), str(preset))
    assert (cfg.optim.loss_chunk_tokens, cfg.sft.loss_chunk_tokens) == (128, 64)


@pytest.mark.parametrize("bad", ["0", "-3", "1.5", "abc", "true"])
def test_a_bad_value_names_the_dotted_key(bad):
    with pytest.raises(ValueError, match=r"optim\.loss_chunk_tokens"):
        _config("sft", f"optim.loss_chunk_tokens={bad}")


@pytest.mark.parametrize(
    ("recipe", "key", "axis"),
    [
        ("sft", "optim", "parallel.sp=2"),
        ("sft", "optim", "parallel.pp=2"),
        ("dpo", "sft", "parallel.sp=2"),
    ],
)
def test_refused_under_sequence_or_pipeline_parallelism(recipe, key, axis):
    with pytest.raises(
        ValueError,
        match=rf"^Config\.{key}\.loss_chunk_tokens=8; .*None with Config\.{axis}",
    ):
        _config(recipe, f"{key}.loss_chunk_tokens=8", axis)


def test_it_may_change_on_resume_when_nothing_else_does(tmp_path):
    """A run saved before the key existed, or without chunks, resumes with its loss chunked;
    another change is still refused."""
    saved = {"optim": {"lr": 1e-4}, "sft": {"lr": 3e-3}, "out_dir": "runs/x"}
    chunked = {
        "optim": {"lr": 1e-4, "loss_chunk_tokens": 512},
        "sft": {"lr": 3e-3, "loss_chunk_tokens": 256},
        "out_dir": "runs/x",
    }
    _check_resumed_config(saved, chunked, tmp_path)
    with pytest.raises(ValueError, match=r"optim\.lr"):
        _check_resumed_config(saved, {**chunked, "optim": {"lr": 2e-4}}, tmp_path)


def test_the_dpo_family_builds_its_loss_with_the_chunks():
    for loss in ("dpo", "ipo", "simpo", "orpo", "kto"):
        cfg = _config("dpo", f"loss={loss}", "optim.loss_chunk_tokens=16")
        assert cfg.build_loss().loss_chunk_tokens == 16, loss
        assert _config("dpo", f"loss={loss}").build_loss().loss_chunk_tokens is None


class _Built(Exception):
    """Raised by a stand-in trainer with the keywords it was built with."""


def _stand_in(*args, **kwargs):
    raise _Built(kwargs)


def test_the_sft_recipe_trains_with_a_chunked_loss(tmp_path, monkeypatch):
    import posttrain.workflows.sft as sft

    monkeypatch.setattr(sft, "Trainer", _stand_in)
    module = cli.load_recipe("sft")
    cfg = apply_overrides(
        module.Config(),
        ["optim.loss_chunk_tokens=32", "task.eval_size=0", f"out_dir={tmp_path / 'sft'}"],
        defaults=module.TINY,
    )
    with pytest.raises(_Built) as built:
        module.main(cfg)
    assert repr(built.value.args[0]["loss"]) == (
        "SFTCrossEntropy(ignore_index=-100, loss_chunk_tokens=32)"
    )


def test_the_rl_recipes_hand_the_chunks_to_the_trainer(tmp_path, monkeypatch):
    """GRPO from a saved tiny policy (its SFT stage stood in for): the RLTrainer is built with
    optim.loss_chunk_tokens."""
    import posttrain.workflows.rl as rl
    import posttrain.workflows.rl_stage as rl_stage
    from posttrain.policy import Policy

    def warm_start(cfg, out):
        Policy.from_spec(cfg.model.name, seed=0).save(out / "sft" / "policy")
        return {}

    monkeypatch.setattr(rl, "warm_start", warm_start)
    monkeypatch.setattr(rl_stage, "RLTrainer", _stand_in)
    module = cli.load_recipe("grpo")
    cfg = apply_overrides(
        module.Config(),
        ["optim.loss_chunk_tokens=64", f"out_dir={tmp_path / 'grpo'}"],
        defaults=module.TINY,
    )
    with pytest.raises(_Built) as built:
        module.main(cfg)
    assert built.value.args[0]["loss_chunk_tokens"] == 64
