"""Stage files a resumed run reads back (pairs and their stats, evaluation tables, a finished
stage's results.json, a saved evaluation suite) carry their size, sha256 and row count, and a
file cut or changed after its write is refused, named, by every reader.
"""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest

from posttrain.core.stage_files import (
    RECORD_FILE,
    StageFileError,
    read_stage_file,
    write_stage_file,
)
from posttrain.workflows.evaluation import SuiteResult
from posttrain.workflows.reports import cached_pairs, read_table, write_results, write_table
from posttrain.workflows.sft import _finished_results

PAIRS = [{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)} for i in range(5)]
STATS = {"pairs": 5, "prompts": 5}


def _make():
    return [dict(r) for r in PAIRS], dict(STATS)


def _must_not_run():
    raise AssertionError("the stage ran again although its files are whole")


def _cut_lines(path, keep: int) -> None:
    """Keep the first `keep` lines of `path` (another process truncating it)."""
    data = path.read_bytes()
    path.write_bytes(b"".join(data.splitlines(keepends=True)[:keep]))


# ------------------------------------------------------------------------------ the reported case


def test_a_resumed_run_refuses_pairs_that_lost_lines_while_their_stats_survived(tmp_path):
    """pairs.jsonl cut from 5 to 3 lines, pair_stats.json whole: the resume used to train on 3
    pairs and exit 0; now it names the file, the 5 rows written and the 3 found."""
    assert cached_pairs(tmp_path, resume=False, make=_make) == _make()
    _cut_lines(tmp_path / "pairs.jsonl", 3)
    with pytest.raises(StageFileError) as e:
        cached_pairs(tmp_path, resume=True, make=_must_not_run)
    message = str(e.value)
    assert str(tmp_path / "pairs.jsonl") in message
    assert "has 3 rows" in message and "recorded 5 rows" in message
    assert "Delete the file (its stage runs again) or use a new out_dir" in message


def test_whole_pairs_are_read_back_and_a_deleted_pairs_file_runs_the_stage_again(tmp_path):
    cached_pairs(tmp_path, resume=False, make=_make)
    assert cached_pairs(tmp_path, resume=True, make=_must_not_run) == _make()
    (tmp_path / "pairs.jsonl").unlink()  # what the error tells the user to do
    again = [{"prompt": "p", "chosen": "c", "rejected": "r"}], {"pairs": 1}
    assert cached_pairs(tmp_path, resume=True, make=lambda: again) == again
    assert cached_pairs(tmp_path, resume=True, make=_must_not_run) == again


# ---------------------------------------------------------------- every reader, every damage


def _table(n: int = 4) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "question": [f"q{i}" for i in range(n)],
            "completion": ["a\rb", 'say "hi",\r\nok', "x", "y"][:n],
            "correct": [True, False, True, False][:n],
        }
    )


def _pairs_file(folder):
    cached_pairs(folder, resume=False, make=_make)
    return folder / "pairs.jsonl", lambda: cached_pairs(folder, resume=True, make=_must_not_run)


def _stats_file(folder):
    cached_pairs(folder, resume=False, make=_make)
    return folder / "pair_stats.json", lambda: cached_pairs(folder, resume=True, make=_must_not_run)


def _eval_table(folder):
    write_table(_table(), folder / "eval_before.csv")
    return folder / "eval_before.csv", lambda: read_table(folder / "eval_before.csv")


def _required_eval_table(folder):  # the RL workflow reads the warm start's table this way
    write_table(_table(), folder / "eval_after.csv")
    return folder / "eval_after.csv", lambda: read_table(folder / "eval_after.csv", required=True)


def _finished_stage_results(folder):
    write_table(_table(), folder / "eval_after.csv")
    write_results(folder, {"after": {"accuracy": 0.5}, "steps": 3}, "# done\n")
    return folder / "results.json", lambda: _finished_results(folder)


def _finished_stage_table(folder):
    write_table(_table(), folder / "eval_after.csv")
    write_results(folder, {"after": {"accuracy": 0.5}, "steps": 3}, "# done\n")
    return folder / "eval_after.csv", lambda: _finished_results(folder)


def _suite_table(folder):
    suite = SuiteResult(pd.DataFrame(), {"s": _table()})
    suite.save(folder)
    return folder / "items_00_s.csv", lambda: SuiteResult.load(folder)


def _suite_doc(folder):
    suite = SuiteResult(pd.DataFrame(), {"s": _table()})
    suite.save(folder)
    return folder / "eval_suite.json", lambda: SuiteResult.load(folder)


READERS = [
    _pairs_file,
    _stats_file,
    _eval_table,
    _required_eval_table,
    _finished_stage_results,
    _finished_stage_table,
    _suite_table,
    _suite_doc,
]


def _drop_last_line(path):
    _cut_lines(path, len(path.read_bytes().splitlines()) - 1)


def _cut_mid_line(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])


def _append_line(path):
    path.write_bytes(path.read_bytes() + path.read_bytes().splitlines(keepends=True)[-1])


def _flip_a_byte(path):  # same size, same rows: only the sha256 tells
    data = bytearray(path.read_bytes())
    i = len(data) // 2
    data[i] = ord("0") if data[i] != ord("0") else ord("1")
    path.write_bytes(bytes(data))


def _empty(path):
    path.write_bytes(b"")


DAMAGE = [_drop_last_line, _cut_mid_line, _append_line, _flip_a_byte, _empty]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("reader", READERS, ids=lambda f: f.__name__.strip("_"))
def test_every_stage_file_reader_refuses_a_damaged_file_naming_it(reader, damage, tmp_path):
    path, read = reader(tmp_path)
    read()  # whole: read back without error
    damage(path)
    with pytest.raises(StageFileError) as e:
        read()
    message = str(e.value)
    assert str(path) in message and RECORD_FILE in message and "use a new out_dir" in message


def test_the_message_counts_the_rows_of_a_table_as_written_and_as_found(tmp_path):
    """4 rows written (two completions hold line breaks, so lines are not rows); the last
    row cut off: 3 rows found."""
    path = tmp_path / "eval_before.csv"
    write_table(_table(), path)
    data = path.read_bytes()
    path.write_bytes(data[: data.rindex(b"q3")])
    with pytest.raises(
        StageFileError,
        match=r"has 3 rows \(\d+ bytes\) where stage_files.json "
        r"recorded 4 rows",
    ):
        read_table(path)
    path.write_bytes(data[: data.index(b"hi")])  # inside a quoted field: pandas gives up
    with pytest.raises(StageFileError, match=r"has unreadable rows .* recorded 4 rows"):
        read_table(path)


# ------------------------------------------------------------------------ what a read returns


def test_a_table_reads_back_as_pandas_reads_the_file(tmp_path):
    path = tmp_path / "t.csv"
    write_table(_table(), path)
    expected = pd.read_csv(path, keep_default_na=False)
    pd.testing.assert_frame_equal(read_table(path, keep_default_na=False), expected)
    assert read_table(path)["completion"].tolist() == ["a\rb", 'say "hi",\r\nok', "x", "y"]


def test_a_missing_file_is_a_stage_not_finished_unless_required(tmp_path):
    assert read_table(tmp_path / "eval_before.csv") is None
    assert cached_pairs(tmp_path, resume=True, make=_make) == _make()
    with pytest.raises(FileNotFoundError, match="eval_after.csv is missing"):
        read_table(tmp_path / "eval_after.csv", required=True)


def test_a_file_without_a_record_runs_its_stage_again_or_is_read_unverified_if_required(tmp_path):
    """A file written before stage files carried records (or whose write stopped between the
    file and its record) cannot be verified: a stage that can run again does; a stage already
    done is read, with a warning naming the file."""
    _table().to_csv(tmp_path / "eval_before.csv", index=False, lineterminator="\r\n")
    with pytest.warns(UserWarning, match=r"eval_before.csv has no record .* its stage runs again"):
        assert read_table(tmp_path / "eval_before.csv") is None
    with pytest.warns(UserWarning, match=r"eval_before.csv has no record .* read unverified"):
        assert len(read_table(tmp_path / "eval_before.csv", required=True)) == 4
    write_table(_table(2), tmp_path / "eval_before.csv")  # the stage ran again: recorded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(read_table(tmp_path / "eval_before.csv")) == 2


def test_a_rewrite_interrupted_before_the_new_file_is_whole_is_not_trusted(tmp_path, monkeypatch):
    """The held-out curve rewrites its table at each point. A crash after the old record is
    dropped and before the new file lands leaves the old file without a record: the stage runs
    again, rather than an old file passing as new or a whole file being called corrupt."""
    from posttrain.core import stage_files

    path = tmp_path / "eval_curve.csv"
    write_table(_table(2), path)
    real = stage_files.write_text_atomic

    def crash_on_the_table(target, text):
        if target == path:
            raise KeyboardInterrupt
        real(target, text)

    monkeypatch.setattr(stage_files, "write_text_atomic", crash_on_the_table)
    with pytest.raises(KeyboardInterrupt):
        write_table(_table(3), path)
    monkeypatch.undo()
    assert len(pd.read_csv(path)) == 2  # the old file, whole
    with pytest.warns(UserWarning, match="no record"):
        assert read_table(path) is None


def test_a_rewritten_file_is_recorded_anew_and_other_records_are_kept(tmp_path):
    write_table(_table(2), tmp_path / "eval_curve.csv")
    write_table(_table(4), tmp_path / "eval_after.csv")
    write_table(_table(3), tmp_path / "eval_curve.csv")
    assert len(read_table(tmp_path / "eval_curve.csv")) == 3
    assert len(read_table(tmp_path / "eval_after.csv")) == 4
    files = json.loads((tmp_path / RECORD_FILE).read_text())["files"]
    assert {k: v["rows"] for k, v in files.items()} == {"eval_after.csv": 4, "eval_curve.csv": 3}


def test_a_finished_stage_whose_table_was_deleted_runs_again(tmp_path):
    write_table(_table(), tmp_path / "eval_after.csv")
    write_results(tmp_path, {"after": {"accuracy": 0.5}}, "# done\n")
    assert _finished_results(tmp_path) == {"after": {"accuracy": 0.5}}
    (tmp_path / "eval_after.csv").unlink()
    assert _finished_results(tmp_path) is None


@pytest.mark.parametrize("record", ["{not json", '{"files": {"a.csv": {"bytes": "9"}}}', "[]"])
def test_an_unreadable_record_file_is_named(tmp_path, record):
    write_stage_file(tmp_path / "a.csv", "x\r\n1\r\n", rows=1)
    (tmp_path / RECORD_FILE).write_text(record)
    with pytest.raises(StageFileError, match=rf"{RECORD_FILE} is (unreadable|malformed)"):
        read_stage_file(tmp_path / "a.csv")


@pytest.mark.parametrize("rows", [-1, 1.0, True, "3"])
def test_a_bad_row_count_is_refused_before_writing(tmp_path, rows):
    with pytest.raises(ValueError, match=r"rows=.*; must be a non-negative int"):
        write_stage_file(tmp_path / "a.csv", "x\r\n", rows=rows)
    assert not (tmp_path / "a.csv").exists()
