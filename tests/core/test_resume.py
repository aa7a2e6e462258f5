"""Checkpoints: atomic folders, keep-last-K, RNG capture, and exact (bitwise) resume, in process and
after a SIGKILL of a separate training process.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _ranks import ScriptProcess, start_script
from _run_helpers import finish, kill_after
from _train_helpers import assert_bitwise_equal, params_of, sft_loader, tiny_model

from posttrain.core import (
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_metrics,
    restore_rng_state,
    save_checkpoint,
)
from posttrain.core import checkpoint as ckpt_module
from posttrain.train import Trainer, warmup_cosine_schedule

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SCRIPT = Path(__file__).parents[1] / "sft_resume_run.py"


def _trainer(run_dir, **kwargs) -> Trainer:
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = warmup_cosine_schedule(opt, warmup_steps=1, total_steps=8)
    return Trainer(
        model,
        opt,
        data=sft_loader(10, batch_size=3),
        lr_scheduler=sched,
        grad_accum_steps=2,
        run_dir=run_dir,
        progress=False,
        **kwargs,
    )


# ------------------------------------------------------------------------------------ in process


def test_resume_in_process_continues_bitwise(tmp_path):
    reference = _trainer(tmp_path / "ref")
    reference.fit(8)

    first = _trainer(tmp_path / "run", checkpoint_every=3)
    first.fit(5)  # checkpoints after steps 3 and 5 (the end of fit)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_000003", "step_000005"]
    del first

    second = _trainer(tmp_path / "run", checkpoint_every=3, resume=True)
    assert second.step_count == 5 and second.metrics["step"].tolist() == [1, 2, 3, 4, 5]
    second.fit(8)
    assert_bitwise_equal(params_of(second.model), params_of(reference.model))
    assert second.optimizer.state_dict()["state"][0]["step"] == 8
    assert second.metrics["loss"].tolist() == reference.metrics["loss"].tolist()
    assert read_metrics(tmp_path / "run")["step"].tolist() == list(range(1, 9))


def test_resume_from_an_explicit_checkpoint_rewrites_later_metrics(tmp_path):
    trainer = _trainer(tmp_path, checkpoint_every=2, keep_last=None)
    trainer.fit(5)
    path = trainer.resume(tmp_path / "checkpoints" / "step_000002")
    assert path.name == "step_000002" and trainer.step_count == 2
    assert read_metrics(tmp_path)["step"].tolist() == [1, 2]
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_000002",
        "step_000004",
        "step_000005",
    ]


def test_resume_true_without_a_checkpoint_starts_fresh(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # killed before step 3
    trainer = _trainer(tmp_path, checkpoint_every=3, resume=True)
    assert trainer.step_count == 0 and trainer.metrics.empty
    trainer.fit(1)
    assert read_metrics(tmp_path)["loss"].tolist() == trainer.metrics["loss"].tolist()


def test_resume_refuses_a_missing_checkpoint_and_a_missing_scheduler(tmp_path):
    trainer = _trainer(tmp_path, checkpoint_every=1)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        trainer.resume()
    trainer.fit(1)
    model = tiny_model(0)
    plain = Trainer(
        model,
        torch.optim.AdamW(model.parameters()),
        data=sft_loader(10, batch_size=3),
        grad_accum_steps=2,
        run_dir=tmp_path / "other",
        progress=False,
    )
    with pytest.raises(ValueError, match="lr_scheduler"):
        plain.resume(tmp_path)


@pytest.mark.parametrize(
    "change, named", [({"grad_accum_steps": 1}, "grad_accum_steps=2"), ({"loss": "dpo"}, "loss=")]
)
def test_resume_refuses_a_setting_that_cannot_change(tmp_path, change, named):
    import posttrain.preference  # noqa: F401  registers "dpo"

    _trainer(tmp_path, checkpoint_every=1).fit(1)
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kwargs = dict(
        lr_scheduler=warmup_cosine_schedule(opt, warmup_steps=1, total_steps=8),
        grad_accum_steps=2,
        run_dir=tmp_path,
        progress=False,
        resume=True,
    )
    with pytest.raises(ValueError, match=f"saved with {named}.*cannot change on resume"):
        Trainer(model, opt, data=sft_loader(10, batch_size=3), **{**kwargs, **change})


def test_keep_last_keeps_the_newest_checkpoints(tmp_path):
    _trainer(tmp_path, checkpoint_every=1, keep_last=2).fit(5)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    meta = json.loads((latest_checkpoint(tmp_path) / "meta.json").read_text())
    assert meta["step"] == 5 and meta["grad_accum_steps"] == 2


def test_a_half_written_checkpoint_is_ignored_and_cleaned_up(tmp_path):
    """A crash during a save leaves a `.tmp-*` folder (and perhaps a partial file); a folder
    without meta.json is not a checkpoint either. Neither is ever `latest_checkpoint`."""
    save_checkpoint(tmp_path, 6, model_state={"w": torch.ones(2)}, train_state={"step": 6})
    root = tmp_path / "checkpoints"
    crashed = root / ".tmp-step_000009-abc123"
    crashed.mkdir()
    (crashed / "model.pt").write_bytes(b"\x80\x02 partial")
    (root / "step_000010").mkdir()  # no meta.json
    assert latest_checkpoint(tmp_path).name == "step_000006"
    assert load_checkpoint(latest_checkpoint(tmp_path))["train_state"] == {"step": 6}

    save_checkpoint(tmp_path, 7, model_state={"w": torch.ones(2)}, train_state={"step": 7})
    assert not crashed.exists()
    assert latest_checkpoint(tmp_path).name == "step_000007"


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 3, model_state={"w": torch.ones(2)}, train_state={"step": 3})
    real = ckpt_module._write_torch

    def crash_on_train_state(obj, path):
        if path.name == "train_state.pt":
            path.write_bytes(b"partial")
            raise OSError("disk full")
        real(obj, path)

    monkeypatch.setattr(ckpt_module, "_write_torch", crash_on_train_state)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 6, model_state={"w": torch.zeros(2)}, train_state={"step": 6})
    assert latest_checkpoint(tmp_path).name == "step_000003"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003"]


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 3, model_state={"w": torch.ones(2)}, train_state={"step": 3})
    save_checkpoint(tmp_path, 3, model_state={"w": torch.zeros(2)}, train_state={"step": 3})
    saved = load_checkpoint(latest_checkpoint(tmp_path))["model_state"]["w"]
    assert torch.equal(saved, torch.zeros(2))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000003"]


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.normal()  # leaves a cached Gaussian in numpy's state
    save_checkpoint(tmp_path, 1, model_state={}, train_state={"rng": capture_rng_state()})
    expected = (random.random(), np.random.normal(), torch.rand(2))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(load_checkpoint(latest_checkpoint(tmp_path))["train_state"]["rng"])
    got = (random.random(), np.random.normal(), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


# ------------------------------------------------------------------- SIGKILL and resume (process)


def _start(run_dir: Path, *args: str) -> ScriptProcess:
    """`python sft_resume_run.py RUN_DIR *args`, its output in RUN_DIR-<args>.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = run_dir.parent / "-".join([run_dir.name, *args, "log"])
    return start_script(SCRIPT, [str(run_dir), *args], env, os.getcwd(), log)


def test_sigkill_between_checkpoints_then_resume_is_bitwise_identical(tmp_path):
    """12 steps, checkpoint every 3, 6 steps per epoch. Killed after step 5: resume from step 3
    (mid-epoch) and cross the epoch boundary after resuming. Killed after step 7: resume from
    step 6, exactly on the epoch boundary, so epoch 1 must come with its own fresh order. Both
    end bitwise equal to an uninterrupted run: parameters, losses and eval values."""
    ref_dir, kill5_dir, kill7_dir = tmp_path / "ref", tmp_path / "kill5", tmp_path / "kill7"
    reference = _start(ref_dir)
    killed5 = _start(kill5_dir, "--pause-after", "5")
    killed7 = _start(kill7_dir, "--pause-after", "7")
    kill_after(killed5, kill5_dir, 5)
    kill_after(killed7, kill7_dir, 7)

    assert latest_checkpoint(kill5_dir).name == "step_000003"
    assert latest_checkpoint(kill7_dir).name == "step_000006"
    assert read_metrics(kill7_dir)["step"].tolist()[-1] == 7  # rows after the checkpoint exist
    data_state = load_checkpoint(latest_checkpoint(kill7_dir))["train_state"]["data"]
    assert (data_state["epoch"], data_state["offset"]) == (1, 0)  # on the epoch boundary

    resumed5 = _start(kill5_dir, "--resume")
    resumed7 = _start(kill7_dir, "--resume")
    finish(reference)
    assert "starting at step 3" in finish(resumed5)
    assert "starting at step 6" in finish(resumed7)

    expected = torch.load(ref_dir / "final.pt", weights_only=True)
    expected_rows = read_metrics(ref_dir)
    for run_dir in (kill5_dir, kill7_dir):
        assert_bitwise_equal(torch.load(run_dir / "final.pt", weights_only=True), expected)
        rows = read_metrics(run_dir)
        assert rows["step"].tolist() == list(range(1, 13))
        for column in ("loss", "lr", "grad_norm", "trained_tokens", "eval/noise"):
            assert rows[column].equals(expected_rows[column]), column


# ------------------------------------------- a recipe run resumed under another plan, or moved

import plan_resume_run as plan_worker  # noqa: E402
from _ranks import run_ranks  # noqa: E402

# Tolerances against one process (tests/train/test_parallel_plans.py): per-step losses 2e-6 (the
# float rounding of a 2-rank sum; seen at most 4.8e-7), weights after AdamW steps 1e-4 (Adam's
# first steps divide by |g| and scale that rounding up on near-zero gradients; seen 3.1e-6).
LOSS_ATOL, ADAMW_WEIGHT_ATOL = 2e-6, 1e-4


def _cut_back(run: Path, step: int) -> None:
    """Leave `run` as a SIGKILL during step `step + 2` leaves a run that checkpoints every
    step: checkpoints up to `step`, metrics rows up to `step + 1`, no results and no policy."""
    import shutil

    for path in list_checkpoints(run):
        if int(path.name.removeprefix("step_")) > step:
            shutil.rmtree(path)
    for name in ("results.json", "results.md", "eval_after.csv", "loss.png"):
        (run / name).unlink(missing_ok=True)
    shutil.rmtree(run / "policy")
    rows = [
        line
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["step"] <= step + 1
    ]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in rows))


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "policy" / "model.safetensors")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def replanned(tmp_path_factory) -> Path:
    """Both runs of tests/plan_resume_run.py: started under one plan, cut back to step 2,
    resumed under the other."""
    out = tmp_path_factory.mktemp("replanned")
    run_ranks(plan_worker.__file__, 2, out, str(out), "first", log_prefix="first")
    for name in plan_worker.RUNS:
        _cut_back(out / name, plan_worker.RESUME_FROM)
    run_ranks(plan_worker.__file__, 2, out, str(out), "resume", log_prefix="resume")
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The same SFT run in one process, uninterrupted."""
    out = tmp_path_factory.mktemp("single") / "run"
    sft, cfg = plan_worker.config(out)
    sft.main(cfg)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(plan_worker.RUNS))
def test_recipe_resumes_under_another_plan(replanned, single, name):
    """dp_shard=2 (sharded checkpoint) -> dp_shard=1, and two plain replicas (full checkpoint)
    -> dp_shard=2, both on 2 gloo ranks: the resumed run restarts from step 2, its config.json
    records the new plan, and it ends as the uninterrupted one-process run does."""
    run = replanned / name
    first, resumed = plan_worker.RUNS[name]
    saved = json.loads((run / "config.json").read_text())
    assert saved["parallel"]["dp_shard"] == resumed["parallel.dp_shard"]
    lineage = json.loads((run / "lineage.json").read_text())
    assert lineage["config"]["parallel"]["dp_shard"] == first["parallel.dp_shard"]
    assert len(lineage["resumes"]) == 1
    rows, expected = read_metrics(run), read_metrics(single)
    assert rows["step"].tolist() == list(range(1, plan_worker.STEPS + 1))
    worst = float((rows["loss"] - expected["loss"]).abs().max())
    assert worst <= LOSS_ATOL, f"losses differ by {worst:.3g}"
    assert _max_diff(_weights(run), _weights(single)) <= ADAMW_WEIGHT_ATOL
    assert json.loads((run / "results.json").read_text())["steps"] == plan_worker.STEPS


def test_a_moved_run_folder_resumes_in_its_new_place(single, tmp_path):
    """A run cut back to step 2 (a SIGKILL during step 4), then moved: `resume=true` with the
    new out_dir continues from step 2 and ends bitwise equal to the uninterrupted run; its
    config.json and lineage name the new folder."""
    import shutil

    old, new = tmp_path / "old", tmp_path / "elsewhere" / "new"
    sft, cfg = plan_worker.config(old)
    sft.main(cfg)
    _cut_back(old, plan_worker.RESUME_FROM)
    new.parent.mkdir()
    shutil.move(old, new)
    sft, cfg = plan_worker.config(new, resume=True)
    sft.main(cfg)
    assert read_metrics(new)["loss"].tolist() == read_metrics(single)["loss"].tolist()
    assert_bitwise_equal(_weights(new), _weights(single))
    assert json.loads((new / "config.json").read_text())["out_dir"] == str(new)
    lineage = json.loads((new / "lineage.json").read_text())
    assert (lineage["run"], lineage["resumes"][-1]["run"]) == (str(old), str(new))


def test_a_moved_run_with_sub_runs_resumes_and_other_changes_are_still_refused(tmp_path):
    """The GRPO recipe's more-SFT stage starts from `<out_dir>/sft/policy`, so its config.json
    holds a path inside the run folder: after a move it is compared as the same path inside the
    new folder. A setting that cannot change (the learning rate) is still refused, naming the
    key; the plan and out_dir may change."""
    import shutil

    from posttrain import cli
    from posttrain.workflows import override

    grpo = cli.load_recipe("grpo")
    old, new = tmp_path / "old", tmp_path / "new"
    tiny = {**grpo.TINY, "eval.every": 0, "baseline.steps": 1, "eval.samples": 0}
    first = grpo.main(override(grpo.Config(), {**tiny, "out_dir": str(old)}))
    (old / "more_sft" / "results.json").unlink()  # the baseline stage must run again
    shutil.rmtree(old / "more_sft" / "policy")
    shutil.move(old, new)
    sub = json.loads((new / "more_sft" / "config.json").read_text())
    assert sub["model"]["init_from"] == str(old / "sft" / "policy")
    with pytest.raises(
        ValueError,
        match=r"optim\.lr=0\.0002, this run has optim\.lr=0\.001;"
        r" only resume, progress, checkpoint\.\*, parallel\.\*, "
        r"out_dir, optim\.loss_chunk_tokens, sft\.loss_chunk_tokens may change",
    ):
        grpo.main(
            override(grpo.Config(), {**tiny, "out_dir": str(new), "resume": True, "optim.lr": 1e-3})
        )
    again = grpo.main(override(grpo.Config(), {**tiny, "out_dir": str(new), "resume": True}))
    assert again["more_sft"]["accuracy"] == first["more_sft"]["accuracy"]
    assert (new / "more_sft" / "policy").is_dir()
