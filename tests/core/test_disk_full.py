"""A full disk while saving: the run stops with OSError(ENOSPC) naming the folder, the bytes
the write needed and the bytes free (not torch's "enforce fail at inline_container.cc"), the
partial write is removed, the last good checkpoint stays whole, and after space is freed the run
resumes exactly. Tested on a real full file system: a 2 MiB tmpfs (needs root; skipped
otherwise).
"""

from __future__ import annotations

import errno
import re
import shutil
import subprocess
import warnings

import pytest
import torch
from _train_helpers import assert_bitwise_equal, params_of, sft_loader, tiny_model

from posttrain.core.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from posttrain.core.checkpoint_files import is_disk_full, write_text_atomic
from posttrain.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MIB = 2**20


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs mounted at tmp_path/fs, unmounted afterwards."""
    folder = tmp_path / "fs"
    folder.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs to fill: {e}")
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True, timeout=60).returncode:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=60)


def _grow(folder, size: str) -> None:
    """Free space: remount the tmpfs larger (what a user does by deleting files elsewhere)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True, timeout=60)


def _numbers(message: str) -> tuple[int, int]:
    """(bytes needed, bytes free) as the message states them."""
    match = re.search(r"\((?:about )?([\d,]+) bytes, [\d.]+ MiB\) into .*; ([\d,]+) bytes", message)
    assert match, message
    return int(match.group(1).replace(",", "")), int(match.group(2).replace(",", ""))


def _trainer(run_dir, **kwargs) -> Trainer:
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Trainer(
        model, opt, data=sft_loader(10, batch_size=3), run_dir=run_dir, progress=False, **kwargs
    )


def test_a_full_disk_stops_training_naming_the_folder_and_bytes_then_resume_is_exact(small_fs):
    """The tiny trainer's checkpoint is ~1.1 MiB: step 1's fits in 2 MiB, step 2's does not."""
    run = small_fs / "run"
    trainer = _trainer(run, checkpoint_every=1)
    with pytest.raises(OSError) as e:
        trainer.fit(3)
    message = str(e.value)
    assert e.value.errno == errno.ENOSPC and "inline_container" not in message
    assert message.startswith("[Errno 28] no space left on device: writing checkpoint step_000002")
    assert f"into {run / 'checkpoints'};" in message
    assert "the last checkpoint, step_000001, is untouched" in message
    needed, free = _numbers(message)
    assert free == shutil.disk_usage(small_fs).free  # measured after the partial write went
    last = run / "checkpoints" / "step_000001"
    written = sum(f.stat().st_size for f in last.glob("*.pt"))  # the same state, one step back
    assert abs(needed - written) < 0.05 * written and free < needed

    assert list_checkpoints(run) == [last]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]  # no partial
    verify_checkpoint(last)
    assert load_checkpoint(last)["train_state"]["step"] == 1

    _grow(small_fs, "16m")
    resumed = _trainer(run, checkpoint_every=1, resume=True)
    assert resumed.step_count == 1
    resumed.fit(3)
    reference = _trainer(None)
    reference.fit(3)
    assert_bitwise_equal(params_of(resumed.model), params_of(reference.model))


def test_a_text_file_on_a_full_disk_keeps_its_old_content_and_names_the_exact_bytes(small_fs):
    path = small_fs / "results.json"
    write_text_atomic(path, "old\n")
    text = "x" * (3 * MIB)
    with pytest.raises(OSError) as e:
        write_text_atomic(path, text)
    assert e.value.errno == errno.ENOSPC
    assert (
        f"no space left on device: writing results.json (3,145,728 bytes, 3.0 MiB) into "
        f"{small_fs};" in str(e.value)
    )
    assert _numbers(str(e.value))[1] == shutil.disk_usage(small_fs).free
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in small_fs.iterdir()) == ["results.json"]  # no temporary file


def test_a_file_system_out_of_inodes_says_so_not_only_the_bytes(small_fs):
    """Bytes to spare but no inode: "1 bytes needed, 2 MiB free" alone contradicted itself."""
    subprocess.run(["mount", "-o", "remount,nr_inodes=2", str(small_fs)], check=True, timeout=60)
    write_text_atomic(small_fs / "a.txt", "a")
    with pytest.raises(OSError) as e:
        write_text_atomic(small_fs / "b.txt", "b")
    assert e.value.errno == errno.ENOSPC and f"into {small_fs};" in str(e.value)
    assert "no file can be created there (0 inodes free)" in str(e.value), e.value


def test_a_stage_file_on_a_full_disk_leaves_no_record_to_trust(small_fs):
    import pandas as pd

    from posttrain.workflows.reports import read_table, write_table

    path = small_fs / "eval_curve.csv"
    write_table(pd.DataFrame({"step": [0], "accuracy": [0.5]}), path)
    with pytest.raises(OSError) as e:
        write_table(pd.DataFrame({"step": [1], "completion": ["x" * (3 * MIB)]}), path)
    assert e.value.errno == errno.ENOSPC and f"into {small_fs};" in str(e.value)
    with pytest.warns(UserWarning, match="no record"):  # the old table: its stage runs again
        assert read_table(path) is None


def test_a_sharded_checkpoint_on_a_full_disk_is_removed_and_names_the_rank(small_fs):
    from posttrain.train.sharded_checkpoint import save_sharded_checkpoint

    run = small_fs / "run"

    def save(step: int, width: int):
        model = torch.nn.Linear(width, width)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():  # DCP in one process without a process group
            warnings.simplefilter("ignore", UserWarning)
            return save_sharded_checkpoint(
                run,
                step,
                model=model,
                optimizer=opt,
                train_state={"step": step},
                meta={},
                keep_last=None,
                rank=0,
            )

    first = save(1, 8)
    with pytest.raises(OSError) as e:
        save(2, 1000)  # 1000 x 1000 fp32 weights: 4,000,000 bytes, the bias 4,000 more
    message = str(e.value)
    assert e.value.errno == errno.ENOSPC
    assert "writing rank 0's shards of checkpoint step_000002 (about 4,004,000 bytes" in message
    assert f"into {run / 'checkpoints'};" in message
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    assert list_checkpoints(run) == [first] and verify_checkpoint(first)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
        OSError(errno.EIO, "Input/output error"),
    ],
)
def test_other_write_failures_pass_through_unchanged(tmp_path, monkeypatch, error):
    """A torch writer failure with plenty of space left, or another errno, is not a full disk."""
    save_checkpoint(tmp_path, 1, model_state={"w": torch.ones(4)}, train_state={"step": 1})

    def failing_save(obj, f, *args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(type(error)) as e:
        save_checkpoint(tmp_path, 2, model_state={"w": torch.ones(4)}, train_state={"step": 2})
    assert e.value is error
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]


def _chained(inner: BaseException) -> RuntimeError:
    try:
        try:
            raise inner
        except BaseException as err:  # noqa: BLE001 (any inner error, as torch.save chains it)
            msg = "[enforce fail at inline_container.cc:672] . unexpected pos"
            raise RuntimeError(msg) from err
    except RuntimeError as e:
        return e


@pytest.mark.parametrize(
    "exc, full",
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (_chained(OSError(errno.ENOSPC, "No space left on device")), True),  # torch.save to a file
        (_chained(ValueError("x")), False),  # room to spare
        (OSError(errno.EACCES, "Permission denied"), False),
        (ValueError("no space"), False),
    ],
)
def test_a_full_disk_is_recognised_by_errno_anywhere_in_the_chain(tmp_path, exc, full):
    assert is_disk_full(exc, tmp_path, needed=1) is full
