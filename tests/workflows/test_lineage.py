"""Run lineage (`posttrain.workflows.lineage`): lineage.json of tiny runs started from the command
line, parent links (SFT -> GRPO sub-run, `model.init_from` of another run's policy, declared
parents), `runs_table` / `posttrain runs`, and `posttrain rerun` reproducing a run from its
folder (same results.json numbers and per-step losses, same config)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from _run_helpers import hold_run_dir
from _waits import wait_for

from posttrain import cli
from posttrain.workflows import RL_TINY, override
from posttrain.workflows.lineage import (
    PACKAGES,
    SDK_RECIPES,
    code_version,
    package_versions,
    read_lineage,
    run_status,
    runs_table,
)

SFT_TINY = cli.load_recipe("sft").TINY
SDK = Path(cli.__file__).resolve().parent


def _args(tiny: dict) -> list[str]:
    return [f"{k}={v}" for k, v in tiny.items()]


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "--no-optional-locks", *args],
            cwd=SDK,
            text=True,
            capture_output=True,
            timeout=10,
        )
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
        assert (
            cli.main(
                ["run", "sft", *_args(SFT_TINY), "model.init_from=runs/a/policy", "out_dir=runs/b"]
            )
            == 0
        )
        chain_sum = str(cli.recipe_dirs()[1] / "presets" / "grpo_chain_sum.yaml")  # a's task
        assert (
            cli.main(
                [
                    "run",
                    "grpo",
                    "--config",
                    chain_sum,
                    *_args(RL_TINY),
                    "eval.samples=0",
                    "out_dir=runs/g",
                ]
            )
            == 0
        )
    finally:
        os.chdir(cwd)
    return root


def test_lineage_records_config_data_code_packages_and_command(runs):
    run = runs / "a"
    lineage = read_lineage(run)
    assert lineage["config"] == json.loads((run / "config.json").read_text())
    assert lineage["recipe"] == {
        "name": "sft",
        "file": str(cli.find_recipe("sft").resolve()),
        "config_class": "posttrain.workflows.sft_config.SFTConfig",
    }
    assert lineage["command"].startswith("posttrain run sft task.train_size=64")
    assert lineage["command"].endswith("out_dir=runs/a")
    assert lineage["hostname"] == socket.gethostname()
    assert lineage["python"] == ".".join(map(str, sys.version_info[:3]))
    started = datetime.fromisoformat(lineage["started"])
    assert started.tzinfo == timezone.utc and abs(datetime.now(timezone.utc) - started).days == 0
    assert lineage["packages"] == {
        n: importlib.metadata.version(n) for n in PACKAGES if n in package_versions([n])
    }
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
        "reasoning_gym",
        "chain_sum",
        64,
        0,
    )
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
    cfg = override(
        cli.load_recipe("sft").Config(),
        {"task.name": str(rows), "task.options": {}, "task.eval_size": 0},
    )
    import hashlib

    assert data_lineage(cfg) == {
        "kind": "file",
        "path": str(rows.resolve()),
        "bytes": 38,
        "sha256": hashlib.sha256(rows.read_bytes()).hexdigest(),
    }


def test_code_version_without_git_is_the_package_version(tmp_path):
    code = code_version(tmp_path)
    assert code["git_commit"] is None and code["git_dirty"] is None
    assert code["version"] == importlib.metadata.version("posttrain")


def test_sdk_config_classes_name_their_recipes():
    for config_class, name in SDK_RECIPES.items():  # the class itself, or the recipe's defaults
        cls = cli.load_recipe(name).Config  # over it (recipes/grpo.py)
        assert config_class in {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}


def test_grpo_run_starts_from_its_sft_sub_run(runs):
    g, sft = read_lineage(runs / "g"), read_lineage(runs / "g" / "sft")
    assert g["recipe"]["name"] == "grpo" and sft["recipe"]["name"] == "sft"
    assert g["parents"] == [
        {"path": "sft", "abs": str((runs / "g" / "sft").resolve()), "via": "sub_run"}
    ]
    assert sft["parents"] == []
    assert sft["config"]["out_dir"] == "runs/g/sft"


def test_init_from_another_runs_policy_makes_it_the_parent(runs):
    b = read_lineage(runs / "b")
    assert b["parents"] == [
        {"path": "../a", "abs": str((runs / "a").resolve()), "via": "model.init_from"}
    ]


def test_a_missing_or_non_run_parent_fails_before_anything_is_written(
    tmp_path, monkeypatch, capsys
):
    """The command line's one-line error (exit code 2); the run's own `RunRefused` (a
    ValueError) from a call in Python."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    for parent, message in (
        ("nope", "parent run 'nope' does not exist"),
        ("empty", "parent run 'empty' is not a run folder"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["run", "sft", *_args(SFT_TINY), "--parent", parent, "out_dir=c"])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"posttrain run: error: {message}") and err.count("\n") == 1
        assert not (tmp_path / "c").exists()
    sft = cli.load_recipe("sft")
    cfg = override(
        sft.Config(),
        {**SFT_TINY, "task.name": "missing.jsonl", "task.options": {}, "task.eval_size": 0},
    )
    with pytest.raises(ValueError, match="Config.task.name='missing.jsonl': no such data file"):
        sft.main(dataclasses.replace(cfg, out_dir="c"))
    assert not (tmp_path / "c").exists()


def test_declared_parent_is_recorded(runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from posttrain.workflows.lineage import check_parents, run_origin

    cfg = override(cli.load_recipe("sft").Config(), {**SFT_TINY, "out_dir": "c"})
    with run_origin("c", parents=[runs / "a"]):
        assert check_parents(cfg, Path("c")) == [
            {
                "path": os.path.relpath(runs / "a", tmp_path / "c"),
                "abs": str(runs / "a"),
                "via": "declared",
            }
        ]
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
    assert list(table.columns) == [
        "run",
        "recipe",
        "started",
        "commit",
        "status",
        "error",
        "metric",
        "value",
        "parents",
    ]
    rows = table.set_index("run")
    assert set(rows.index) == {"runs/a", "runs/a-again", "runs/b", "runs/g", "runs/g/sft"}
    assert set(rows["status"]) == {"finished"}
    assert rows.loc["runs/g", "metric"] == "after_grpo.accuracy"
    assert rows.loc["runs/a", "metric"] == "after.accuracy"
    assert rows.loc["runs/g", "parents"] == "runs/g/sft"
    assert rows.loc["runs/b", "parents"] == "runs/a"
    assert rows.loc["runs/g", "recipe"] == "grpo"
    assert list(table["started"]) == sorted(table["started"])


def _ctrl_c_at_step(monkeypatch, at: int) -> None:
    """A real SIGINT, once, as the trainer starts step `at + 1`."""
    from posttrain.train import Trainer

    step, fired = Trainer.step, []

    def step_with_ctrl_c(self):
        if self.step_count == at and not fired:
            fired.append(True)
            signal.raise_signal(signal.SIGINT)
        return step(self)

    monkeypatch.setattr(Trainer, "step", step_with_ctrl_c)


def test_each_run_state_made_for_real_reads_the_same_in_every_view(
    runs, tmp_path, monkeypatch, capsys
):
    """finished (runs/a), failed (the SFT recipe raised in this process, which lives on),
    interrupted (Ctrl-C at step 2 of 3), running (a child holds the lock), dead (that child
    killed with SIGKILL, not yet reaped, then reaped): runs_table, `posttrain runs` and a
    sweep's table say the same."""
    import pandas as pd

    from posttrain.core.run_lock import lock_holder
    from posttrain.train import Trainer
    from posttrain.workflows.arms import Arm
    from posttrain.workflows.sweep import Sweep

    monkeypatch.chdir(tmp_path)
    shutil.copytree(runs / "a", "states/finished/seed0")
    args = [*_args(SFT_TINY), "eval.max_new_tokens=2"]

    def disk_on_fire(self):
        raise RuntimeError("disk on fire\nsecond line")

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "step", disk_on_fire)  # the run raises in its first step
        with pytest.raises(RuntimeError, match="disk on fire"):
            cli.main(["run", "sft", *args, "out_dir=states/failed/seed0"])
    assert lock_holder("states/failed/seed0") is None  # released; this process lives on
    with monkeypatch.context() as patch:
        _ctrl_c_at_step(patch, 2)
        assert cli.main(["run", "sft", *args, "out_dir=states/interrupted/seed0"]) == 130
    for name in ("running", "dead"):
        shutil.copytree(
            runs / "a",
            f"states/{name}/seed0",
            ignore=shutil.ignore_patterns("results.*", ".posttrain.lock"),
        )
    holder = hold_run_dir(tmp_path / "states" / "running" / "seed0")
    victim = hold_run_dir(tmp_path / "states" / "dead" / "seed0")
    try:
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(
            lambda: lock_holder("states/dead/seed0") is None,  # the kernel drops it
            what="the lock of the child killed with SIGKILL to be dropped",
        )
        expected = {
            "finished": "finished",
            "failed": "failed",
            "interrupted": "interrupted",
            "running": "running",
            "dead": "dead",
        }
        assert run_status("states/dead/seed0") == "dead"  # a zombie: pid there, no lock
        victim.wait(timeout=120)
        table = runs_table("states").set_index("run")
        assert {r.split("/")[1]: s for r, s in table["status"].items()} == expected
        errors = {
            r.split("/")[1]: None if pd.isna(e) else e  # pandas reads None as NaN
            for r, e in table["error"].items()
        }
        assert errors["failed"] == "RuntimeError: disk on fire"
        assert errors["interrupted"].startswith("posttrain.workflows.reports.RunInterrupted: ")
        assert "interrupted after step 2 of 3" in errors["interrupted"]
        assert errors["dead"].startswith("no results.json and no live process holds the run")
        assert errors["finished"] is None and errors["running"] is None
        stopped = json.loads((tmp_path / "states/failed/seed0/stopped.json").read_text())
        assert stopped["status"] == "failed" and stopped["pid"] == os.getpid()

        arms = [Arm(name, {}) for name in expected]
        sweep_table = (
            Sweep(tmp_path / "states", arms, [0], None, {(a.name, 0): None for a in arms})
            .table()
            .set_index("arm")
        )
        assert dict(sweep_table["status"]) == expected
        assert {a: None if pd.isna(e) else e for a, e in sweep_table["error"].items()} == errors

        capsys.readouterr()
        assert cli.main(["runs", "states"]) == 0
        lines = capsys.readouterr().out.splitlines()
        for name, status in expected.items():
            assert any(
                f"states/{name}/seed0" in line and f" {status} " in line for line in lines
            ), (name, lines)
    finally:
        for child in (holder, victim):
            child.kill()
            child.wait(timeout=120)
    assert run_status(runs / "a") == "finished"
    with pytest.raises(ValueError, match="runs folder 'nowhere' does not exist"):
        runs_table("nowhere")
    # `posttrain resume` continues the interrupted run with its own saved config, nothing
    # retyped: the same per-step losses as the uninterrupted runs/a (same config but eval)
    assert cli.main(["resume", "states/interrupted/seed0"]) == 0
    assert run_status("states/interrupted/seed0") == "finished"
    assert _losses(tmp_path / "states/interrupted/seed0") == _losses(runs / "a")
    resumes = read_lineage("states/interrupted/seed0")["resumes"]
    assert [r["command"] for r in resumes] == ["posttrain resume states/interrupted/seed0"]


def test_a_resumed_run_is_running_whatever_an_earlier_attempt_left(tmp_path):
    """A claim removes the stopped.json of an attempt that failed; results.json marked
    interrupted does not hide a live owner; a run that raised before it claimed its folder
    leaves the folder as it was."""
    from posttrain.core.run_lock import claim_run_dir, read_stopped, release_run_dir, run_outcome

    folder = tmp_path / "run"
    claim_run_dir(folder)
    with pytest.raises(ValueError), run_outcome(folder):
        raise ValueError("bad batch")
    assert run_status(folder) == "failed" and read_stopped(folder)["error"] == (
        "ValueError: bad batch"
    )
    with pytest.raises(KeyError), run_outcome(folder):  # raised before claiming: no record
        raise KeyError("x")
    assert read_stopped(folder)["error"] == "ValueError: bad batch"
    (folder / "results.json").write_text('{"interrupted": true}')
    claim_run_dir(folder)
    assert run_status(folder) == "running" and read_stopped(folder) is None
    with pytest.raises(KeyboardInterrupt), run_outcome(folder):
        raise KeyboardInterrupt
    assert run_status(folder) == "interrupted" and read_stopped(folder)["status"] == ("interrupted")
    with pytest.raises(SystemExit), run_outcome(folder):  # a preempted job leaving: no record
        claim_run_dir(folder)  # removes the record of the interrupted attempt
        raise SystemExit(-1)
    assert read_stopped(folder) is None and run_status(folder) == "interrupted"
    assert not release_run_dir(folder)
    (folder / "results.json").write_text('{"after": {"accuracy": 0.5}}')
    assert run_status(folder) == "finished"


def test_runs_command_prints_the_table(runs, monkeypatch, capsys):
    monkeypatch.chdir(runs.parent)
    assert cli.main(["runs"]) == 0
    out = capsys.readouterr().out
    assert "runs/g/sft" in out and "after_grpo.accuracy" in out and "finished" in out
    assert cli.main(["runs", "runs/g"]) == 0
    assert "runs/a" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["runs", "nowhere"])
