"""Checkpoint files by fault class: loading never runs code, every file is verified against its
sha256 manifest (bit flip, truncation, empty file, no manifest, fallback to the previous good
checkpoint), and run folders are private (0600 files, 0700 folders).

Exact resume, atomicity and keep-last pruning are tested in tests/core/test_resume.py.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_helpers import sft_loader, tiny_model
from torch.serialization import get_unsafe_globals_in_checkpoint

from posttrain.core import (
    MANIFEST_FILE,
    CheckpointCorruptError,
    UnsafeCheckpointError,
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resolve_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)
from posttrain.core import checkpoint as ckpt_module
from posttrain.core.checkpoint_files import sha256_file, write_manifest
from posttrain.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _save(run_dir: Path, step: int) -> Path:
    return save_checkpoint(
        run_dir,
        step,
        model_state={"w": torch.arange(64.0)},
        train_state={"step": step, "rows": [{"loss": 1.5}]},
        keep_last=None,
    )


class _WritesMarker:
    """Unpickling this calls `Path.write_text(marker, "ran")`: code run by a load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


# ------------------------------------------------------------------------ loading never runs code


@pytest.mark.parametrize("manifest_rewritten", [True, False])
def test_a_train_state_whose_unpickling_runs_code_is_refused(tmp_path, manifest_rewritten):
    """The tampered train_state.pt is refused by the weights-only load even when the attacker
    also rewrote manifest.json to match (a checksum is no signature); without that, the checksum
    catches it first. Either way the payload never runs."""
    path = _save(tmp_path / "run", 1)
    marker = tmp_path / "marker"
    torch.save({"step": 1, "payload": _WritesMarker(marker)}, path / "train_state.pt")
    if manifest_rewritten:
        write_manifest(path, ["model.pt", "train_state.pt", "meta.json"])
        error, match = UnsafeCheckpointError, r"train_state\.pt .*will not unpickle it"
    else:
        error, match = CheckpointCorruptError, r"step_000001: train_state\.pt has \d+ bytes"
    with pytest.raises(error, match=match):
        load_checkpoint(path)
    assert not marker.exists()
    torch.load(path / "train_state.pt", weights_only=False)  # the payload is live: it does run
    assert marker.read_text() == "ran"


def test_state_that_could_not_be_loaded_safely_is_not_saved(tmp_path):
    with pytest.raises(TypeError, match=r"train_state holds .*numpy.*torch\.from_numpy"):
        save_checkpoint(tmp_path, 1, model_state={}, train_state={"keys": np.zeros(3)})
    assert list_checkpoints(tmp_path) == [] and os.listdir(tmp_path / "checkpoints") == []


def test_rng_states_are_tensors_and_ints_and_restore_exactly(tmp_path):
    """Python's cached Gaussian (gauss_next) and numpy's are part of the state: both set here."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.normal()
    state = capture_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    assert get_unsafe_globals_in_checkpoint(tmp_path / "rng.pt") == []
    assert state["python"]["state"].shape == (625,) and state["numpy"]["keys"].shape == (624,)
    expected = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert random.getstate() == expected[0]
    got_np = np.random.get_state()
    assert got_np[0] == expected[1][0] and np.array_equal(got_np[1], expected[1][1])
    assert got_np[1].dtype == np.uint32 and got_np[2:] == expected[1][2:]
    assert torch.equal(torch.get_rng_state(), expected[2])


# ----------------------------------------------------------------------- checkpoints are verified


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


FAULTS = {
    "bit flip": ("model.pt", _flip_a_bit, r"model\.pt does not match its sha256"),
    "truncation": (
        "model.pt",
        lambda p: p.write_bytes(p.read_bytes()[:-100]),
        r"model\.pt has \d+ bytes where manifest\.json recorded \d+ \(truncated",
    ),
    "zero bytes": (
        "train_state.pt",
        lambda p: p.write_bytes(b""),
        r"train_state\.pt has 0 bytes where manifest\.json recorded",
    ),
    "missing file": ("train_state.pt", Path.unlink, r"train_state\.pt is missing"),
    "meta edited": (
        "meta.json",
        lambda p: p.write_text(p.read_text().replace('"step": 1', '"step": 7')),
        r"meta\.json does not match its sha256",
    ),
    "manifest garbled": (
        "manifest.json",
        lambda p: p.write_bytes(b"\xff{"),
        r"manifest\.json is unreadable",
    ),
    "no manifest (older format)": (
        "manifest.json",
        Path.unlink,
        r"has no manifest\.json.*written before checkpoints carried",
    ),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_corrupt_checkpoint_raises_naming_the_checkpoint_and_the_file(tmp_path, fault):
    name, damage, match = FAULTS[fault]
    path = _save(tmp_path, 1)
    assert load_checkpoint(path)["train_state"]["step"] == 1
    damage(path / name)
    with pytest.raises(CheckpointCorruptError, match=rf"checkpoint \S*step_000001.*{match}"):
        load_checkpoint(path)
    with pytest.raises(CheckpointCorruptError, match=match):
        verify_checkpoint(path)


def test_the_manifest_records_size_and_sha256_of_every_file(tmp_path):
    path = _save(tmp_path, 1)
    files = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == ["meta.json", "model.pt", "train_state.pt"]
    for name, entry in files.items():
        assert entry == {"bytes": (path / name).stat().st_size, "sha256": sha256_file(path / name)}
    assert json.loads((path / "meta.json").read_text())["format_version"] == 2


def test_resume_from_a_run_folder_falls_back_to_the_previous_good_checkpoint(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    _flip_a_bit(tmp_path / "checkpoints" / "step_000003" / "model.pt")
    (tmp_path / "checkpoints" / "step_000002" / "train_state.pt").write_bytes(b"")
    assert latest_checkpoint(tmp_path).name == "step_000003"  # not verified: cheap
    with pytest.warns(
        UserWarning,
        match=r"(?s)2 corrupt.*step_000003: model\.pt.*step_000002: "
        r"train_state\.pt.*Using \S*step_000001",
    ):
        assert resolve_checkpoint(tmp_path).name == "step_000001"
    with pytest.raises(CheckpointCorruptError, match="step_000003"):
        load_checkpoint(resolve_checkpoint(tmp_path / "checkpoints" / "step_000003"))  # no fallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the good one alone: no warning
        assert resolve_checkpoint(tmp_path / "checkpoints" / "step_000001").name == "step_000001"

    (tmp_path / "checkpoints" / "step_000001" / MANIFEST_FILE).unlink()
    with pytest.raises(
        CheckpointCorruptError,
        match=r"(?s)every checkpoint of .*step_000003.*"
        r"step_000002.*step_000001",
    ):
        resolve_checkpoint(tmp_path)


def test_a_trainer_resumed_with_resume_true_continues_from_the_last_good_checkpoint(tmp_path):
    def trainer(**kwargs) -> Trainer:
        model = tiny_model(0)
        return Trainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            data=sft_loader(10, batch_size=3),
            run_dir=tmp_path,
            progress=False,
            checkpoint_every=2,
            **kwargs,
        )

    trainer().fit(4)
    _flip_a_bit(tmp_path / "checkpoints" / "step_000004" / "train_state.pt")
    with pytest.warns(UserWarning, match=r"step_000004: train_state\.pt.*Using \S*step_000002"):
        resumed = trainer(resume=True)
    assert resumed.step_count == 2 and resumed.metrics["step"].tolist() == [1, 2]


def test_a_save_that_fails_writing_the_manifest_leaves_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    _save(tmp_path, 1)

    def disk_full(folder, names):
        (folder / MANIFEST_FILE).write_bytes(b"{")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_module, "write_manifest", disk_full)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]


# ------------------------------------------------------------------------ run folders are private


def test_checkpoint_files_are_0600_and_folders_0700_whatever_the_umask(tmp_path):
    previous = os.umask(0o002)  # permissive: group and others would be let in by default
    try:
        run_dir = tmp_path / "new" / "run"
        path = _save(run_dir, 1)
        _save(run_dir, 1)  # replacing a step keeps the modes
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        _save(shared, 1)
    finally:
        os.umask(previous)

    def mode(p: Path) -> int:
        return p.stat().st_mode & 0o777

    assert [mode(p) for p in (run_dir, run_dir / "checkpoints", path)] == [0o700] * 3
    assert {p.name: mode(p) for p in path.iterdir()} == {
        name: 0o600 for name in ("model.pt", "train_state.pt", "meta.json", MANIFEST_FILE)
    }
    assert mode(shared) == 0o755  # a run folder it did not create keeps its mode
    assert mode(shared / "checkpoints") == 0o700
