"""Tests for posttrain.core.run_permissions: the modes of run files and folders under each
setting (private, group, shared), whatever the umask, including checkpoints saved later.

Expected modes are the table in the module docstring, read back with os.stat.
"""

from __future__ import annotations

import doctest
import os
import stat

import pytest
import torch

from posttrain.core import checkpoint_files as cf
from posttrain.core import run_permissions as rp
from posttrain.core.checkpoint import save_checkpoint
from posttrain.core.run_lock import LOCK_FILE, claim_run_dir, release_run_dir

EXPECTED = {"private": (0o600, 0o700), "group": (0o640, 0o750), "shared": (0o660, 0o2770)}


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o077, 0o000], ids=["umask077", "umask000"])
def umask(request):
    before = os.umask(request.param)
    yield
    os.umask(before)


@pytest.mark.parametrize("setting", list(EXPECTED))
def test_files_and_folders_get_the_setting_modes(tmp_path, umask, setting, monkeypatch):
    monkeypatch.delenv(rp.ENV, raising=False)
    file_mode, dir_mode = EXPECTED[setting]
    with rp.run_permissions(setting):
        assert cf.make_private_dir(tmp_path / "run") is True
        cf.write_bytes(b"x", tmp_path / "run" / "a.bin")
        cf.write_text_atomic(tmp_path / "run" / "b.txt", "y")
        ckpt = save_checkpoint(
            tmp_path / "run", 1, model_state={"w": torch.zeros(1)}, train_state={}
        )
    assert mode(tmp_path / "run") == dir_mode
    assert mode(tmp_path / "run" / "a.bin") == file_mode
    assert mode(tmp_path / "run" / "b.txt") == file_mode
    assert mode(ckpt) == dir_mode and mode(ckpt.parent) == dir_mode
    assert {mode(p) for p in ckpt.iterdir()} == {file_mode}
    assert os.environ.get(rp.ENV) is None  # restored after the block


def test_checkpoint_saved_later_in_a_run_follows_the_environment(tmp_path, monkeypatch):
    # The setting travels in the environment: a process that inherits it (a spawned rank, a
    # Slurm job) writes a later checkpoint with the same modes, without the context manager.
    monkeypatch.setenv(rp.ENV, "group")
    claim_run_dir(tmp_path / "run")
    release_run_dir(tmp_path / "run")
    ckpt = save_checkpoint(tmp_path / "run", 7, model_state={"w": torch.ones(1)}, train_state={})
    assert mode(tmp_path / "run") == 0o750 and mode(ckpt) == 0o750
    assert mode(tmp_path / "run" / LOCK_FILE) == 0o640
    assert {mode(p) for p in ckpt.iterdir()} == {0o640}


def test_existing_folder_keeps_its_mode(tmp_path, monkeypatch):
    monkeypatch.delenv(rp.ENV, raising=False)
    cf.make_private_dir(tmp_path / "run")
    with rp.run_permissions("shared"):
        assert cf.make_private_dir(tmp_path / "run") is False
    assert mode(tmp_path / "run") == 0o700


def test_bad_settings_name_the_field_and_the_allowed_values(tmp_path, monkeypatch):
    bad = rp.run_permissions("world")
    with pytest.raises(ValueError, match=r"run.permissions='world'; allowed values: private, gr"):
        bad.__enter__()
    monkeypatch.setenv(rp.ENV, "public")
    with pytest.raises(ValueError, match=r"POSTTRAIN_RUN_PERMISSIONS='public'; allowed values"):
        cf.write_bytes(b"x", tmp_path / "a.bin")
    assert not (tmp_path / "a.bin").exists()  # refused before anything is written


def test_docstring_examples(monkeypatch):
    monkeypatch.delenv(rp.ENV, raising=False)
    assert doctest.testmod(rp).failed == 0
