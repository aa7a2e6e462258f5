"""Run lineage (`posttrain.workflows.lineage`): lineage.json of tiny runs started from the command
line, parent links (SFT -> GRPO sub-run, `model.init_from` of another run's policy, declared
parents), `runs_table` / `posttrain runs`, and `posttrain rerun` reproducing a run from its
folder (same results.json numbers and per-step losses, same config)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.workflows import RL_TINY, override
from posttrain.workflows.lineage import (LINEAGE_FILE, PACKAGES, SDK_RECIPES, code_version,
                                         package_versions, read_lineage, run_status, runs_table)

SFT_TINY = cli.load_recipe("sft").TINY
SDK = Path(cli.__file__).resolve().parent


def _args(tiny: dict) -> list[str]:
    return [f"{k}={v}" for k, v in tiny.items()]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "--no-optional-locks", *args], cwd=SDK, text=True,
                              capture_output=True, timeout=10)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny runs made once: SFT `a` (command line), its rerun `a-again`, SFT `b` starting from
    `a/policy`, and SFT -> GRPO `g` (sub-run `g/sft`)."""
    root = tmp_path_factory.mktemp("lineage") / "runs"
    cwd = os.getcwd()
    os.chdir(root.parent)
    try:
        assert cli.main(["run", "sft", *_args(SFT_TINY), "out_dir=runs/a"]) == 0
        assert cli.main(["rerun", "runs/a", "out_dir=runs/a-again"]) == 0
        assert cli.main(["run", "sft", *_args(SFT_TINY), "model.init_from=runs/a/policy",
                         "out_dir=runs/b"]) == 0
        chain_sum = str(cli.recipe_dirs()[1] / "presets" / "grpo_chain_sum.yaml")  # a's task
        assert cli.main(["run", "grpo", "--config", chain_sum, *_args(RL_TINY), "eval.samples=0",
                         "out_dir=runs/g"]) == 0
    finally:
        os.chdir(cwd)
    return root


def test_lineage_records_config_data_code_packages_and_command(runs):
    run = runs / "a"
    lineage = read_lineage(run)
    assert lineage["config"] == json.loads((run / "config.json").read_text())
    assert lineage["recipe"] == {"name": "sft", "file": str(cli.find_recipe("sft").resolve()),
                                 "config_class": "posttrain.workflows.sft.SFTConfig"}
    assert lineage["command"].startswith("posttrain run sft task.train_size=64")
    assert lineage["command"].endswith("out_dir=runs/a")
    assert lineage["hostname"] == socket.gethostname()
    assert lineage["python"] == ".".join(map(str, sys.version_info[:3]))
    started = datetime.fromisoformat(lineage["started"])
    assert started.tzinfo == timezone.utc and abs(datetime.now(timezone.utc) - started).days == 0
    assert lineage["packages"] == {n: importlib.metadata.version(n) for n in PACKAGES
                                   if n in package_versions([n])}
    assert {"torch", "numpy", "pandas", "reasoning_gym"} <= set(lineage["packages"])
    code = lineage["code"]
    assert code["version"] == importlib.metadata.version("posttrain")
    head = _git("rev-parse", "HEAD")
    if head is None:
        assert code["git_commit"] is None
    else:  # this checkout: its HEAD, dirty when git status lists anything
        assert code["git_commit"] == head
        assert code["git_dirty"] == bool(_git("status", "--porcelain"))
    data = lineage["data"]
    assert (data["kind"], data["task"], data["train_size"], data["train_seed"]) == (
        "reasoning_gym", "chain_sum", 64, 0)
    assert len(data["spec_sha256"]) == len(data["train_sha256"]) == 64
    assert lineage["parents"] == [] and lineage["rerun_of"] is None and lineage["resumes"] == []


def test_same_data_same_hashes_other_seed_other_hash(runs):
    a, again, g = (read_lineage(runs / n)["data"] for n in ("a", "a-again", "g/sft"))
    assert a == again
    assert (a["spec_sha256"], a["train_sha256"]) == (g["spec_sha256"], g["train_sha256"])
    from posttrain.workflows.lineage import data_lineage

    cfg = override(cli.load_recipe("sft").Config(), {**SFT_TINY, "seed": 1})
    other = data_lineage(cfg)
    assert other["train_sha256"] != a["train_sha256"] and other["spec_sha256"] != a["spec_sha256"]


def test_data_file_is_hashed(tmp_path):
    from posttrain.workflows.lineage import data_lineage

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    cfg = override(cli.load_recipe("sft").Config(), {"task.name": str(rows), "task.options": {},
                                                     "task.eval_size": 0})
    import hashlib

    assert data_lineage(cfg) == {"kind": "file", "path": str(rows.resolve()), "bytes": 38,
                                 "sha256": hashlib.sha256(rows.read_bytes()).hexdigest()}


def test_code_version_without_git_is_the_package_version(tmp_path):
    code = code_version(tmp_path)
    assert code["git_commit"] is None and code["git_dirty"] is None
    assert code["version"] == importlib.metadata.version("posttrain")


def test_sdk_config_classes_name_their_recipes():
    for config_class, name in SDK_RECIPES.items():  # the class itself, or the recipe's defaults
        cls = cli.load_recipe(name).Config            # over it (recipes/grpo.py)
        assert config_class in {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}


def test_grpo_run_starts_from_its_sft_sub_run(runs):
    g, sft = read_lineage(runs / "g"), read_lineage(runs / "g" / "sft")
    assert g["recipe"]["name"] == "grpo" and sft["recipe"]["name"] == "sft"
    assert g["parents"] == [{"path": "sft", "abs": str((runs / "g" / "sft").resolve()),
                             "via": "sub_run"}]
    assert sft["parents"] == []
    assert sft["config"]["out_dir"] == "runs/g/sft"


def test_init_from_another_runs_policy_makes_it_the_parent(runs):
    b = read_lineage(runs / "b")
    assert b["parents"] == [{"path": "../a", "abs": str((runs / "a").resolve()),
                             "via": "model.init_from"}]


def test_a_missing_or_non_run_parent_fails_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    for parent, message in (("nope", "parent run 'nope' does not exist"),
                            ("empty", "parent run 'empty' is not a run folder")):
        with pytest.raises(ValueError, match=message):
            cli.main(["run", "sft", *_args(SFT_TINY), "--parent", parent, "out_dir=c"])
        assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match="Config.task.name='missing.jsonl': no such data file"):
        cli.main(["run", "sft", *_args(SFT_TINY), "task.name=missing.jsonl", "task.options={}",
                  "task.eval_size=0", "out_dir=c"])
    assert not (tmp_path / "c").exists()


def test_declared_parent_is_recorded(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from posttrain.workflows.lineage import check_parents, run_origin

    cfg = override(cli.load_recipe("sft").Config(), {**SFT_TINY, "out_dir": "c"})
    with run_origin("c", parents=[runs / "a"]):
        assert check_parents(cfg, Path("c")) == [
            {"path": os.path.relpath(runs / "a", tmp_path / "c"), "abs": str(runs / "a"),
             "via": "declared"}]
    assert check_parents(cfg, Path("c")) == []  # only inside the block, only for that folder


def test_rerun_from_the_folder_gives_the_same_run(runs):
    a, again = runs / "a", runs / "a-again"
    name, cfg = cli.load_run_config(str(a))
    assert name == "sft"
    assert cfg == override(cli.load_recipe("sft").Config(), {**SFT_TINY, "out_dir": "runs/a"})
    got, want = (json.loads((r / "results.json").read_text()) for r in (again, a))
    for key in ("data", "before", "after", "final_loss", "steps"):
        assert got[key] == want[key], key
    assert _losses(again) == _losses(a) and len(_losses(a)) == SFT_TINY["optim.steps"]
    la, lb = read_lineage(a), read_lineage(again)
    assert {**lb["config"], "out_dir": "runs/a"} == la["config"]
    assert lb["config"]["out_dir"] == "runs/a-again"
    assert lb["rerun_of"] == str(a.resolve()) and lb["recipe"] == la["recipe"]
    assert lb["command"] == "posttrain rerun runs/a out_dir=runs/a-again"


def test_load_run_config_needs_a_lineage(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        cli.load_run_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no lineage.json"):
        cli.load_run_config(str(tmp_path))


def test_runs_table_lists_runs_with_status_metric_and_parents(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(runs.parent)
    table = runs_table("runs")
    assert list(table.columns) == ["run", "recipe", "started", "commit", "status", "metric",
                                   "value", "parents"]
    rows = table.set_index("run")
    assert set(rows.index) == {"runs/a", "runs/a-again", "runs/b", "runs/g", "runs/g/sft"}
    assert set(rows["status"]) == {"finished"}
    assert rows.loc["runs/g", "metric"] == "after_grpo.accuracy"
    assert rows.loc["runs/a", "metric"] == "after.accuracy"
    assert rows.loc["runs/g", "parents"] == "runs/g/sft"
    assert rows.loc["runs/b", "parents"] == "runs/a"
    assert rows.loc["runs/g", "recipe"] == "grpo"
    assert list(table["started"]) == sorted(table["started"])


def test_run_status_from_results_and_lock(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("failed", "interrupted", "running"):
        (tmp_path / "two" / name).mkdir(parents=True)
        for f in ("config.json", LINEAGE_FILE):
            shutil.copy(runs / "a" / f, tmp_path / "two" / name / f)
    (tmp_path / "two" / "interrupted" / "results.json").write_text('{"interrupted": true}')
    (tmp_path / "two" / "running" / ".posttrain.lock").write_text(
        f"pid {os.getpid()} on host {socket.gethostname()}\n")
    (tmp_path / "two" / "failed" / ".posttrain.lock").write_text("pid 999999999 on host x\n")
    table = runs_table("two").set_index("run")
    assert dict(table["status"]) == {"two/failed": "failed", "two/interrupted": "interrupted",
                                     "two/running": "running"}
    assert table["metric"].isna().all()
    assert run_status(runs / "a") == "finished"
    with pytest.raises(ValueError, match="runs folder 'nowhere' does not exist"):
        runs_table("nowhere")


def test_runs_command_prints_the_table(runs, monkeypatch, capsys):
    monkeypatch.chdir(runs.parent)
    assert cli.main(["runs"]) == 0
    out = capsys.readouterr().out
    assert "runs/g/sft" in out and "after_grpo.accuracy" in out and "finished" in out
    assert cli.main(["runs", "runs/g"]) == 0
    assert "runs/a" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["runs", "nowhere"])
