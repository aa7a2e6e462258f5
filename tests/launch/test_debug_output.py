"""The "debug" executor keeps a run's printed report out of the cell: what the target writes to
stdout or stderr goes to <out_dir>/launch/debug.log, `Run.logs()` reads it back, and the cell
gets one line per run naming that file."""

from __future__ import annotations

import sys

import pytest

from posttrain.launch import launch_array


def _chatty(cfg):
    for i in range(40):
        print(f"report line {i}")
    print("a warning line", file=sys.stderr)
    if cfg.get("fail"):
        raise RuntimeError("diverged")
    return cfg["x"]


def test_debug_runs_print_one_line_each_and_their_output_goes_to_the_log(tmp_path, capsys):
    cfgs = [{"x": 1, "out_dir": str(tmp_path / "a")}, {"x": 2, "out_dir": str(tmp_path / "b")}]
    runs = launch_array(_chatty, cfgs, executor="debug")
    cell = capsys.readouterr()
    assert cell.err == ""
    assert cell.out.splitlines() == [
        f"test_debug_output._chatty -> COMPLETED: output in {tmp_path / d / 'launch' / 'debug.log'}"
        for d in ("a", "b")
    ]
    assert [r.result() for r in runs] == [1, 2]
    log = (tmp_path / "a" / "launch" / "debug.log").read_text().splitlines()
    assert log == [f"report line {i}" for i in range(40)] + ["a warning line"]
    assert runs[0].logs(tail=2).splitlines() == ["report line 39", "a warning line"]


def test_a_failed_debug_run_also_keeps_its_output_in_the_log(tmp_path, capsys):
    out = tmp_path / "f"
    (run,) = launch_array(_chatty, [{"x": 1, "fail": True, "out_dir": str(out)}], executor="debug")
    cell = capsys.readouterr()
    assert len(cell.out.splitlines()) == 1 and "-> FAILED" in cell.out and cell.err == ""
    assert run.status() == "FAILED"
    assert "report line 39" in (out / "launch" / "debug.log").read_text()
    # a second attempt in the same folder appends, so the first attempt's output is kept
    launch_array(_chatty, [{"x": 3, "out_dir": str(out)}], executor="debug")
    assert (out / "launch" / "debug.log").read_text().count("report line 0") == 2


def test_without_an_out_dir_the_output_stays_in_this_process(capsys):
    (run,) = launch_array(_chatty, [{"x": 5}], executor="debug")
    assert capsys.readouterr().out.splitlines()[-1] == "report line 39"
    assert run.result() == 5 and run.logs() == ""


def test_on_run_hears_of_each_debug_run_as_it_starts_and_as_it_ends():
    """`launch_array(..., on_run=f)`: f(i, None) before run i starts in this process, f(i, run)
    once it has ended (what a notebook's sweep table refreshes on); checked before any run."""
    events = []

    def on_run(i, run):
        events.append((i, None if run is None else (run.status(), run.result())))

    launch_array(abs, [-1, 2], executor="debug", on_run=on_run)
    assert events == [(0, None), (0, ("COMPLETED", 1)), (1, None), (1, ("COMPLETED", 2))]
    with pytest.raises(TypeError, match="on_run=3 is not callable"):
        launch_array(_chatty, [{"x": 1}], executor="debug", on_run=3)
