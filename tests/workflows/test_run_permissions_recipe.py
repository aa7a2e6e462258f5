"""A recipe's `checkpoint.permissions` sets the modes of its run folder's files
(`recorded_run` wraps the entry point in `posttrain.core.run_permissions.run_permissions`),
also of files that other libraries write with plain `open()` (DCP shards here; the walk of a
whole SFT run folder with a checkpoint, TensorBoard, W&B and MLflow files is in
test_trackers_run.py). The tests start from umask 022, under which such files were 0644."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _file_modes import wrong_modes

from posttrain.core.checkpoint import save_checkpoint
from posttrain.core.run_lock import claim_run_dir
from posttrain.core.run_permissions import (
    ENV,
    apply_run_modes,
    current_umask,
    run_permissions,
)
from posttrain.train.sharded_checkpoint import save_sharded_checkpoint
from posttrain.workflows.config import CheckpointConfig
from posttrain.workflows.run_state import recorded_run


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(autouse=True)
def umask_022():
    """The usual umask (files 0644), whatever the test process had; restored after."""
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


@pytest.mark.parametrize("setting,modes", [(None, (0o600, 0o700)), ("group", (0o640, 0o750))])
def test_recipe_setting_gives_the_run_folder_modes(tmp_path, monkeypatch, setting, modes):
    monkeypatch.delenv(ENV, raising=False)

    @recorded_run
    def entry(cfg):
        claim_run_dir(cfg.out_dir)
        return save_checkpoint(cfg.out_dir, 1, model_state={"w": torch.zeros(1)}, train_state={})

    cfg = SimpleNamespace(
        out_dir=str(tmp_path / "run"), checkpoint=CheckpointConfig(permissions=setting)
    )
    ckpt = entry(cfg)
    assert mode(tmp_path / "run") == modes[1] and mode(ckpt) == modes[1]
    assert {mode(p) for p in ckpt.iterdir()} == {modes[0]}
    assert os.environ.get(ENV) is None and current_umask() == 0o022


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_shards_written_with_plain_open_get_the_settings_modes(tmp_path, monkeypatch):
    """torch.distributed.checkpoint writes `sharded/.metadata` and `__0_0.distcp` with plain
    `open()` (0666 minus the umask: 0644 here); under `shared` every file must be 0660 and
    every folder 2770. One process, no process group: DCP saves without one."""
    monkeypatch.delenv(ENV, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    with run_permissions("shared"):
        ckpt = save_sharded_checkpoint(
            tmp_path / "run",
            1,
            model=model,
            optimizer=optimizer,
            train_state={},
            meta={},
            keep_last=None,
            rank=0,
        )
    shards = sorted(p.name for p in (ckpt / "sharded").iterdir())
    assert ".metadata" in shards and any(n.endswith(".distcp") for n in shards), shards
    assert wrong_modes(tmp_path / "run", 0o660, 0o2770) == []
    assert current_umask() == 0o022 and os.environ.get(ENV) is None


def test_bad_permissions_name_the_field():
    with pytest.raises(ValueError, match=r"checkpoint\.permissions.*world.*private"):
        CheckpointConfig(permissions="world").check("checkpoint")


def test_files_libraries_make_with_their_own_modes_get_the_settings_modes_at_the_end(
    tmp_path, monkeypatch
):
    """What the umask cannot widen (a 0600 file as safetensors writes, a 0700 folder as
    `tempfile.mkdtemp` makes, a 0644 file as SQLite makes) is set when the run ends; an
    executable keeps x for those who may read it; a link is not followed."""
    monkeypatch.delenv(ENV, raising=False)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's")
    os.chmod(outside, 0o604)

    @recorded_run
    def entry(cfg):
        run = Path(cfg.out_dir)
        claim_run_dir(run)
        os.close(os.open(run / "weights.safetensors", os.O_WRONLY | os.O_CREAT, 0o600))
        os.close(os.open(run / "mlflow.db", os.O_WRONLY | os.O_CREAT, 0o644))
        os.mkdir(run / "policy", 0o700)
        os.close(os.open(run / "policy" / "run.sh", os.O_WRONLY | os.O_CREAT, 0o755))
        os.symlink(outside, run / "latest")

    entry(
        SimpleNamespace(
            out_dir=str(tmp_path / "run"), checkpoint=CheckpointConfig(permissions="group")
        )
    )
    run = tmp_path / "run"
    assert wrong_modes(run, 0o640, 0o750) == ["policy/run.sh: 0o750, wants 0o640"]
    assert mode(outside) == 0o604  # the link's target, outside the run, is left alone


def test_a_run_that_never_claimed_its_folder_changes_no_mode_there(tmp_path, monkeypatch):
    """A run refused before it starts (a taken folder, a config error) must not touch the files
    of the folder it named: they may be another run's or not a run's at all."""
    monkeypatch.delenv(ENV, raising=False)
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "table.csv").write_text("a,b\n")  # 0644 under umask 022

    @recorded_run
    def entry(cfg):
        raise ValueError("out_dir is not a run folder")

    with pytest.raises(ValueError, match="not a run folder"):
        entry(SimpleNamespace(out_dir=str(folder), checkpoint=CheckpointConfig()))
    assert mode(folder / "table.csv") == 0o644 and mode(folder) == 0o755


def test_apply_run_modes_counts_what_it_changed(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    (tmp_path / "a").write_text("x")  # 0644
    (tmp_path / "b").mkdir(mode=0o700)
    with run_permissions("shared"):
        assert apply_run_modes(tmp_path) == 2
        assert apply_run_modes(tmp_path) == 0
        assert apply_run_modes(tmp_path / "missing") == 0
    assert mode(tmp_path / "a") == 0o660 and mode(tmp_path / "b") == 0o2770
