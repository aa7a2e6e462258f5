"""Every recipe runs at tiny size (a recipe may define TINY: dict of Config overrides for tests)."""

import dataclasses

import pytest

from posttrain import cli

RECIPES = sorted(p.stem for p in cli.recipe_dirs()[1].glob("*.py") if not p.name.startswith("_"))


def test_recipes_are_found():
    assert "demo" in RECIPES


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_at_tiny_size(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = cli.load_recipe(name)
    cfg = dataclasses.replace(module.Config(), **getattr(module, "TINY", {}))
    if any(f.name == "out_dir" for f in dataclasses.fields(cfg)):
        cfg = dataclasses.replace(cfg, out_dir=str(tmp_path / "run"))
    module.main(cfg)


def test_demo_via_cli_writes_a_hf_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "demo", "max_new_tokens=8", f"out_dir={tmp_path / 'd'}"]) == 0
    assert (tmp_path / "d" / "policy" / "config.json").is_file()
    assert "reloaded greedy output identical: True" in capsys.readouterr().out


PRESETS = sorted((cli.recipe_dirs()[1] / "presets").glob("*.yaml"))


def _preset_recipe(path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# recipe: "), f"{path.name} must start with '# recipe: NAME'"
    return first.removeprefix("# recipe: ").strip()


def test_presets_are_found():
    assert {"sft_chain_sum", "cpt_chain_sum"} <= {p.stem for p in PRESETS}


# Every preset also runs at tiny size in tests/test_refactor_guard.py, which pins its whole run
# (metrics, saved weights, evaluation tables, results.json) bitwise.


def test_recipe_refuses_a_used_run_dir_before_writing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sft = cli.load_recipe("sft")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "config.json").write_text("{}")
    cfg = dataclasses.replace(sft.Config(), **sft.TINY, out_dir=str(run))
    with pytest.raises(ValueError, match="already holds a run"):
        sft.main(cfg)
    assert (run / "config.json").read_text() == "{}"
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl"]


def test_sft_config_rejects_warmup_longer_than_training():
    sft = cli.load_recipe("sft")
    with pytest.raises(ValueError, match="warmup_steps=20 exceeds num_steps=5"):
        sft.Config(num_steps=5, warmup_steps=20)


@pytest.mark.parametrize("name, overrides, field", [
    ("dpo", {"max_grad_norm": -1.0}, "max_grad_norm"),
    ("dpo", {"lr": float("inf")}, "lr"),
    ("dpo", {"sample_temperature": float("inf")}, "sample_temperature"),
    ("dpo", {"init_from": "/nonexistent/policy"}, "init_from"),
    ("dpo", {"num_prompts": 8, "val_pairs": 50}, "val_pairs"),
    ("dpo", {"loss": "ipo", "label_smoothing": 0.3}, "label_smoothing"),
    ("reward_model", {"margin": float("nan")}, "margin"),
    ("reward_model", {"num_prompts": 1}, "num_prompts"),
    ("sft", {"lr": float("nan")}, "lr"),
    ("sft", {"init_from": "/nonexistent/policy"}, "init_from"),
    ("grpo", {"kl_coef": -1.0}, "kl_coef"),
    ("grpo", {"rl_lr": float("inf")}, "rl_lr"),
])
def test_bad_config_values_fail_before_any_stage_runs(name, overrides, field):
    """Values that used to pass `__post_init__` and fail minutes later (after SFT and sampling
    had written into the run folder) now fail at construction, naming the field."""
    module = cli.load_recipe(name)
    with pytest.raises(ValueError, match=rf"Config\.{field}="):
        module.Config(**overrides)
