"""A recipe's `checkpoint.permissions` sets the modes of its run folder's files
(`recorded_run` wraps the entry point in `posttrain.core.run_permissions.run_permissions`)."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest
import torch

from posttrain.core.checkpoint import save_checkpoint
from posttrain.core.run_lock import claim_run_dir
from posttrain.core.run_permissions import ENV
from posttrain.workflows.config import CheckpointConfig
from posttrain.workflows.run_state import recorded_run


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


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
    assert os.environ.get(ENV) is None


def test_bad_permissions_name_the_field():
    with pytest.raises(ValueError, match=r"checkpoint\.permissions.*world.*private"):
        CheckpointConfig(permissions="world").check("checkpoint")
