"""Every mistake the command line can meet is one line on stderr naming the field and the fix,
exit code 2, no traceback (`posttrain.cli`): in what was typed (unknown recipe, preset, run,
key; a bad value; a malformed override) and in what the run finds at its start (a missing data
file, a used out_dir, a resume whose config differs, a plan that needs a process group or more
ranks than launched: `RunRefused`). A malformed command line prints its subcommand's usage.
Run folders are written by hand where a real run adds nothing to the check."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.cli.listing import find_run, first_sentence, format_rows, preset_description

SFT_TINY = cli.load_recipe("sft").TINY
TINY = [f"{k}={v}" for k, v in SFT_TINY.items()]


def _one_line_error(capsys, argv: list[str]) -> str:
    """The error of `posttrain argv`: exit code 2 and a single stderr line, returned."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"posttrain {argv[0]}: error: "), err
    return lines[0]


def _saved_run(folder: Path, **changes) -> Path:
    """A run folder of the SFT recipe as a stopped run leaves it: config.json (the tiny config,
    out_dir = `folder`, `changes` applied), lineage.json naming the recipe, metrics.jsonl."""
    from posttrain.workflows import override

    cfg = override(cli.load_recipe("sft").Config(), {**SFT_TINY, "out_dir": str(folder)})
    config = dataclasses.asdict(cfg)
    for key, value in changes.items():
        config[key] = value
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "lineage.json").write_text(
        json.dumps({"recipe": {"name": "sft", "config_class": "posttrain.workflows.sft.SFTConfig"}})
    )
    (folder / "metrics.jsonl").write_text("")
    return folder


@pytest.mark.parametrize(
    "argv, names",
    [
        (["run", "nope"], ["unknown recipe 'nope'", "sft"]),
        (["run", "sft", "--config", "nope"], ["unknown preset 'nope'", "sft_lora"]),
        (["run", "sft", "--config", "missing.yaml"], ["missing.yaml", "No such file"]),
        (["run", "sft", "optim.steps"], ["'optim.steps' is not of the form key=value"]),
        (["run", "sft", "optim.stepz=3"], ["unknown config key 'optim.stepz'", "steps"]),
        (["run", "sft", "optim.steps=many"], ["'optim.steps'", "invalid literal"]),
        (["run", "sft", "optim.steps=0"], ["Config.optim.steps=0", ">= 1"]),
        (["resume", "nope"], ["unknown run 'nope'"]),
        (["rerun", "nope"], ["unknown run 'nope'"]),
    ],
)
def test_a_mistake_in_what_was_typed_is_one_line_naming_it(
    argv, names, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    line = _one_line_error(capsys, argv)
    for name in names:
        assert name in line, line
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_refusals_at_the_run_start_are_one_line_naming_the_field(tmp_path, monkeypatch, capsys):
    """A missing data file, a used out_dir (the fix: `posttrain resume`), a resume whose saved
    config differs (by `posttrain resume` and by resume=true), a plan without a process group:
    each refused before anything is written."""
    monkeypatch.chdir(tmp_path)
    data = ["task.name=rows.jsonl", "task.options={}", "task.eval_size=0"]
    line = _one_line_error(capsys, ["run", "sft", *TINY, *data, "out_dir=new"])
    assert "Config.task.name='rows.jsonl': no such data file" in line
    used = _saved_run(tmp_path / "runs" / "used")
    line = _one_line_error(capsys, ["run", "sft", *TINY, f"out_dir={used}"])
    assert f"Config.out_dir={str(used)!r} already holds a run" in line
    assert f"posttrain resume {used}" in line
    line = _one_line_error(capsys, ["resume", "used", "optim.lr=0.5"])
    assert "resume: " in line and "optim.lr=0.5" in line and "only resume, progress" in line
    _saved_run(tmp_path / "runs" / "old", seed=7)
    line = _one_line_error(capsys, ["run", "sft", *TINY, "out_dir=runs/old", "resume=true"])
    assert "has seed=7, this run has seed=0" in line
    line = _one_line_error(capsys, ["run", "sft", *TINY, "out_dir=plan", "parallel.dp_shard=2"])
    assert "Config.parallel asks for ParallelPlan(dp_shard=2) on 2 ranks" in line
    assert "no torch.distributed process group" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing else written


def test_a_plan_needing_more_ranks_than_launched_is_one_line(tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    monkeypatch.chdir(tmp_path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        line = _one_line_error(capsys, ["run", "sft", *TINY, "out_dir=r", "parallel.dp_shard=2"])
    finally:
        dist.destroy_process_group()
    assert "Config.parallel" in line and "dp_shard=2" in line and "1" in line, line
    assert list(tmp_path.iterdir()) == []


def test_a_malformed_command_line_prints_its_subcommands_usage(capsys):
    for argv, usage in (
        (["runs", "--bogus"], "usage: posttrain runs"),
        (["resume"], "usage: posttrain resume"),
        (["run", "sft", "--bogus"], "usage: posttrain run"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(usage), err
        assert "Traceback" not in err


def test_a_run_is_found_by_its_folder_or_its_name_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    assert find_run("runs/a") == "runs/a"
    assert find_run("a") == "runs/a"
    assert find_run(str(tmp_path / "runs" / "a")) == str(tmp_path / "runs" / "a")
    with pytest.raises(ValueError, match="unknown run 'b': no such folder, and no runs"):
        find_run("b")


def test_descriptions_and_the_runs_table_are_plain_text(tmp_path):
    assert first_sentence("LoRA SFT (Hu et al. 2021) of tiny-1m. The base frozen.") == (
        "LoRA SFT (Hu et al. 2021) of tiny-1m."
    )
    assert first_sentence("x" * 150, limit=10) == "xxxxxxx..."
    preset = tmp_path / "p.yaml"
    preset.write_text("# recipe: dpo\n# IPO on\n# pairs. More.\nloss: ipo\n# not this\n")
    assert preset_description(preset) == ("dpo", "IPO on pairs.")
    preset.write_text("loss: ipo\n")
    assert preset_description(preset) == (None, "")
    rows = [{"run": "runs/a", "value": 0.123456, "error": None}, {"run": "b", "value": 2.0}]
    assert format_rows(rows, ["run", "value", "error"]).splitlines() == [
        "run     value   error",
        "runs/a  0.1235  -",
        "b       2       -",
    ]


def test_ls_lists_every_recipe_and_preset_with_its_description(capsys):
    assert cli.main(["ls"]) == 0
    out = capsys.readouterr().out.splitlines()
    split = next(i for i, line in enumerate(out) if line.startswith("presets"))
    assert out[0].startswith("recipes")
    recipes = {line.split()[0] for line in out[1:split]}
    presets = {line.split()[0] for line in out[split + 1 :]}
    assert {"demo", "dpo", "grpo", "ppo", "reward_model", "sft"} <= recipes
    assert recipes == {p.stem for p in (cli.recipe_dirs()[1]).glob("*.py")}
    assert presets == {p.stem for p in (cli.recipe_dirs()[1] / "presets").glob("*.yaml")}
    sft = next(line for line in out if line.split()[0] == "sft")
    assert "SFT and continued pretraining (CPT) of a policy" in sft
    lora = next(line for line in out if line.split()[0] == "sft_lora")
    assert lora.split()[1] == "sft" and "LoRA SFT (Hu et al. 2021) of tiny-1m" in lora


def test_a_reward_module_in_the_working_folder_imports_by_name(tmp_path):
    """`posttrain run grpo rewards.funcs=[my_rewards:...]` next to `my_rewards.py` finds the
    module, as `python -m` would (the console script's sys.path held only its own folder: the
    answer was "module 'my_rewards' does not import"), and passes the folder on to the
    processes it starts (PYTHONPATH)."""
    import subprocess
    import sys

    (tmp_path / "my_rewards.py").write_text("def brevity(completions, **kw):\n    return [0.0]\n")
    command = Path(sys.executable).parent / "posttrain"
    out = subprocess.run(
        [str(command), "run", "grpo", "rewards.funcs=[my_rewards:missing]"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "has no attribute 'missing'" in out.stderr, out.stderr[-2000:]
    code = "import os; from posttrain.cli import _import_from_cwd; _import_from_cwd(); "
    code += "print(os.environ['PYTHONPATH'].split(os.pathsep)[0])"
    env_out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert env_out.stdout.strip() == str(tmp_path), env_out.stderr[-2000:]
