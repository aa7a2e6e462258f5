"""The one start-and-end of every recipe's run (`posttrain.workflows.RecipeRun`) and the thin
recipes that stand on it.

Ranks are checked with a fake process group (the rank and a recorder of barriers): rank 0 of a
shared run writes and releases the others; ranks > 0 wait and return; a run that is not shared
(no plan, no data parallelism) writes on every process and waits for no one. The multi-process runs
themselves are tests/rl/test_plans_trainers.py's.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.core.run_lock import read_stopped
from posttrain.train import ParallelPlan
from posttrain.workflows import RecipeRun, override, run_state
from posttrain.workflows import recipe_run as recipe_run_module

TRAINING_RECIPES = ["dpo", "grpo", "ppo", "reward_model", "rft", "sft"]


@pytest.fixture
def rank(monkeypatch):
    """Set this process's (fake) rank in a group of 2; returns the barriers it passed."""
    barriers = []

    def set_rank(r: int) -> list:
        monkeypatch.setattr(recipe_run_module, "rank_and_world_size", lambda: (r, 2))
        monkeypatch.setattr(recipe_run_module, "barrier", lambda: barriers.append(r))
        return barriers

    return set_rank


def _run(tmp_path, *, plan=None, shared=None) -> RecipeRun:
    return RecipeRun(
        cfg=None,
        out=tmp_path,
        plan=plan,
        shared=plan is not None if shared is None else shared,
        started=0.0,
    )


def test_rank_zero_of_a_shared_run_writes_then_releases_the_others(tmp_path, rank):
    barriers = rank(0)
    run = _run(tmp_path, plan=ParallelPlan(dp_shard=2))
    assert run.writes and not run.others_return() and barriers == []
    run.write({"steps": 1}, "# done\n")
    assert json.loads((tmp_path / "results.json").read_text()) == {"steps": 1}
    assert (tmp_path / "results.md").read_text() == "# done\n"
    assert run.done({"steps": 1}) == {"steps": 1} and barriers == [0]


def test_the_other_ranks_of_a_shared_run_wait_for_rank_zero_and_return(tmp_path, rank):
    barriers = rank(1)
    for run in (_run(tmp_path, plan=ParallelPlan(dp_shard=2)), _run(tmp_path, shared=True)):
        assert not run.writes
        assert run.others_return() is True
    assert barriers == [1, 1]
    assert not (tmp_path / "results.json").exists()


def test_a_run_that_is_not_shared_writes_on_every_process_and_waits_for_none(tmp_path, rank):
    barriers = rank(1)
    run = _run(tmp_path)
    assert run.writes and not run.others_return()
    assert run.done({}) == {} and barriers == []


def test_start_checks_the_data_before_it_claims_the_folder(tmp_path):
    sft = cli.load_recipe("sft")
    cfg = override(sft.Config(), {**sft.TINY, "out_dir": str(tmp_path / "run"), "max_seq_len": 8})
    with pytest.raises(ValueError, match=r"Config\.max_seq_len=8; must be larger"):
        RecipeRun.start(cfg)
    assert not (tmp_path / "run").exists()
    run = RecipeRun.start(override(cfg, {"max_seq_len": 128}), data_parallel=True)
    assert (run.out, run.plan, run.shared, run.writes) == (tmp_path / "run", None, True, True)
    assert json.loads((run.out / "config.json").read_text())["max_seq_len"] == 128
    assert (run.out / "lineage.json").is_file() and run_state(run.out).status == "running"


@pytest.mark.parametrize(
    "name, overrides, error",
    [
        # three usable pairs, all of them asked for as validation pairs
        ("dpo", {"pairs.num_prompts": 4, "val_pairs": 3}, "rejection sampling gave 3 usable pairs"),
        # every pair from one question: nothing to hold out by question
        ("reward_model", {"pairs.num_prompts": 4}, "3 pairs from 1 prompt(s): too few to split"),
    ],
)
def test_a_run_that_fails_after_its_start_is_recorded_failed(
    name, overrides, error, tmp_path, monkeypatch
):
    """A failure in a stage after the start (too few pairs) leaves the run folder marked
    failed with the exception line (stopped.json), whichever recipe ran."""
    from posttrain.workflows import pairs as pairs_module

    monkeypatch.chdir(tmp_path)
    module = cli.load_recipe(name)
    cfg = override(module.Config(), {**module.TINY, **overrides, "out_dir": str(tmp_path / "run")})
    real = pairs_module.sampled_pairs

    def few(*args, **kwargs):  # three pairs on one question, whatever was sampled
        rows, stats, unusable = real(*args, **kwargs)
        one = {"prompt": "1 + 1 =", "chosen": "2", "rejected": "3"}
        return [one] * 3, stats, unusable

    monkeypatch.setattr(
        f"posttrain.workflows.{'preference' if name == 'dpo' else name}.sampled_pairs", few
    )
    with pytest.raises(ValueError, match=re.escape(error)):
        module.main(cfg)
    state = run_state(tmp_path / "run")
    assert state.status == "failed" and error in state.detail
    assert read_stopped(tmp_path / "run")["status"] == "failed"


@pytest.mark.parametrize("name", TRAINING_RECIPES)
def test_a_training_recipe_is_a_config_and_one_call(name):
    """Every training recipe file holds its `Config`, its `TINY` overrides and a `main` that
    returns one call of a `posttrain.workflows` run: the stages live in the SDK. `main` may
    import that run first (so that building the config, as `posttrain run` does before any
    run, does not load the training stack)."""
    path = cli.find_recipe(name)
    tree = ast.parse(Path(path).read_text())
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert [f.name for f in functions] == ["main"], f"{name}: functions besides main"
    body = [
        n
        for n in functions[0].body
        if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
    ]
    source = ""
    if body and isinstance(body[0], ast.ImportFrom):
        imported = body.pop(0)
        source = imported.module or ""
        assert (imported.module or "").startswith("posttrain.workflows"), ast.dump(imported)
        assert [a.name for a in imported.names] == [body[0].value.func.id], ast.dump(imported)
    assert (
        len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call)
    ), f"{name}.main is more than one call"
    module = cli.load_recipe(name)
    run_name = body[0].value.func.id
    run = getattr(module, run_name, None) or getattr(importlib.import_module(source), run_name)
    assert run.__module__.startswith("posttrain.workflows."), run.__module__
    assert len(Path(path).read_text().splitlines()) <= 80
