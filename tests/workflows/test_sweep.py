"""Sweeps (`posttrain.workflows.sweep`): arms x seeds through `launch_array`, the live table, per
arm t-intervals and paired differences against a baseline, no rerun of finished runs, a failed
arm that does not stop the others, and bad input refused before anything is submitted.

Most tests use a recipe file written here (its `main` writes the files a recipe run writes,
with correctness set by the test), so every statistic can be computed by hand; one runs the
real SFT recipe at tiny size as local processes."""

from __future__ import annotations

import json
import math
import re
import textwrap

import pytest
from _figure_helpers import pyplot_untouched
from _run_helpers import hold_run_dir

from posttrain.rewards.evaluation import paired_bootstrap_diff
from posttrain.workflows.recipes import load_recipe
from posttrain.workflows.sweep import Sweep, sweep, t_quantile

# Correct answers per (x, seed) out of 4 held-out items: item i is correct when i < score.
SCORES = {(1, 0): 1, (1, 1): 2, (2, 0): 3, (2, 1): 4, (3, 0): 2, (3, 1): 2}

RECIPE = textwrap.dedent("""
    import dataclasses, json
    from pathlib import Path

    from posttrain.core.run_lock import claim_run_dir

    SCORES = {scores!r}

    @dataclasses.dataclass(kw_only=True)
    class Config:
        out_dir: str = "runs/fake"
        seed: int = 0
        resume: bool = False
        progress: bool = True
        x: int = 1
        fail_at: int = 0
        interrupt_at: int = 0

    def main(cfg):
        out = Path(cfg.out_dir)
        claim_run_dir(out)   # as start_run does
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        with open(out.parent.parent / "calls.txt", "a") as f:
            f.write(f"{{cfg.x}} {{cfg.seed}} {{cfg.resume}}\\n")
        (out / "metrics.jsonl").write_text(json.dumps({{"step": 5}}) + "\\n")
        if cfg.x == cfg.fail_at:
            raise RuntimeError(f"arm x={{cfg.x}} diverged")
        if cfg.x == cfg.interrupt_at:
            raise KeyboardInterrupt
        score = SCORES[cfg.x, cfg.seed]
        rows = ["question,correct"] + [f"q{{i}},{{i < score}}" for i in range(4)]
        (out / "eval_after.csv").write_text("\\n".join(rows) + "\\n")
        (out / "results.json").write_text(json.dumps({{"after": {{"accuracy": score / 4}}}}))
        return score
""")


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "fake.py"
    path.write_text(RECIPE.format(scores=SCORES))
    return str(path)


def _calls(folder):
    return sorted((folder / "calls.txt").read_text().splitlines())


def test_t_quantile_matches_published_tables():
    # Student-t 0.975 quantiles from the standard tables (e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2)
    for df, value in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)):
        assert t_quantile(0.975, df) == pytest.approx(value, abs=6e-4)
    with pytest.raises(ValueError, match="df >= 1"):
        t_quantile(0.975, 0)


def test_summary_intervals_and_paired_differences_by_hand(fake, tmp_path, capsys):
    s = sweep(
        fake,
        {"x": [1, 2, 3]},
        seeds=[0, 1],
        executor="debug",
        baseline={"x": 1},
        folder=tmp_path / "sw" / "a",
    )
    # the debug executor's cell output: one line per run, naming its log
    cell = capsys.readouterr().out.splitlines()
    assert len(cell) == 6 and all("-> COMPLETED: output in" in line for line in cell)
    table = s.table()
    assert list(table.arm) == ["x=1", "x=1", "x=2", "x=2", "x=3", "x=3"]
    assert set(table.status) == {"finished"} and set(table.step) == {5}
    assert list(table.value) == [0.25, 0.5, 0.75, 1.0, 0.5, 0.5]
    summary = s.summary().set_index("arm")
    # x=1: values 0.25, 0.5 -> mean 0.375; two seeds are too few for an interval over seeds
    # (the t-interval would be [-1.21, 1.96]): the item-level Wilson interval of 3 of 8 items,
    # Wilson 1927 with z = 1.96: (0.1368, 0.6943)
    assert summary.loc["x=1", "mean"] == pytest.approx(0.375)
    assert summary.loc["x=1", "ci_low"] == pytest.approx(0.13684, abs=1e-4)
    assert summary.loc["x=1", "ci_high"] == pytest.approx(0.69425, abs=1e-4)
    assert summary.loc["x=1", "interval"].startswith("item-level Wilson over 8 items")
    # x=3: 4 of 8 items -> Wilson (0.2152, 0.7848), symmetric about 0.5
    assert summary.loc["x=3", "ci_low"] == pytest.approx(1 - summary.loc["x=3", "ci_high"])
    assert summary.loc["x=3", "ci_low"] == pytest.approx(0.21521, abs=1e-4)
    # x=2 vs x=1, item for item: seed 0 correct 3 vs 1 of 4, seed 1 4 vs 2: +4 of 8 items
    assert summary.loc["x=2", "diff"] == pytest.approx(0.5)
    assert summary.loc["x=2", "paired_items"] == 8
    a = [True] * 3 + [False] + [True] * 4
    b = [True] + [False] * 3 + [True] * 2 + [False] * 2
    assert summary.loc["x=2", "diff_ci_low"] == paired_bootstrap_diff(a, b)["ci_low"]
    assert summary.loc["x=3", "diff"] == pytest.approx(0.5 * (1 / 4) + 0.5 * 0)
    assert summary.loc["x=1", "note"] == "baseline"
    with pyplot_untouched():  # the figure is made outside pyplot: notebook plots stay inline
        fig = s.plot()
    arms, diffs = fig.axes
    assert [list(line.get_xdata()) for line in arms.lines[:3]] == [
        [0.25, 0.5],
        [0.75, 1.0],
        [0.5, 0.5],
    ]
    assert list(arms.containers[0].lines[0].get_xdata()) == pytest.approx([0.375, 0.875, 0.5])
    diff_x = list(diffs.containers[0].lines[0].get_xdata())  # the baseline has no difference
    assert diff_x == pytest.approx([math.nan, 0.5, 0.125], nan_ok=True)


def test_a_debug_sweep_in_a_notebook_shows_its_table_as_each_run_starts_and_ends(
    fake, tmp_path, monkeypatch
):
    """In a Jupyter kernel a "debug" sweep runs its runs inside `sweep(...)`: its table shows
    when the first run starts and is refreshed in place (one output) as each run starts and
    ends, not once at the end. A Ctrl-C in the second run leaves it showing the first run
    finished, the second interrupted and the third not started."""
    import IPython
    import IPython.display

    class Shell:  # what the kernel checks read: an IPython shell with a kernel attached
        kernel, config = object(), {}

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    shown: list = []
    seen: list = []
    folder = tmp_path / "live"

    def snapshot(table_html):
        calls = folder / "calls.txt"
        ended = len(calls.read_text().splitlines()) if calls.exists() else 0
        status = r"<td>(pending|running|finished|failed|interrupted|not started)</td>"
        return ended, re.findall(status, table_html)

    def display(widget):
        shown.append(widget)
        seen.append(snapshot(widget.value))
        widget.observe(lambda change: seen.append(snapshot(change["new"])), "value")

    monkeypatch.setattr(IPython.display, "display", display)
    s = sweep(fake, {"x": [1, 2, 3]}, seeds=[0], executor="debug", folder=folder)
    assert len(shown) == 1  # one output, updated in place
    run, wait, done = "running", "pending", "finished"
    assert seen == [  # (runs that have started, the table's statuses) at each refresh
        (0, [run, wait, wait]),
        (1, [done, wait, wait]),
        (1, [done, run, wait]),
        (2, [done, done, wait]),
        (2, [done, done, run]),
        (3, [done, done, done]),
    ]
    assert s.done() and list(s.table().status) == [done] * 3

    seen.clear()
    folder = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        sweep(
            fake,
            {"x": [1, 2, 3]},
            seeds=[0],
            base={"interrupt_at": 2},
            executor="debug",
            folder=folder,
        )
    assert len(shown) == 2 and seen[-1] == (2, [done, "interrupted", "not started"])


def test_failed_arm_shown_others_finish_and_resubmit_reruns_only_it(fake, tmp_path):
    folder = tmp_path / "sw" / "b"
    s = sweep(fake, {"x": [1, 2]}, seeds=[0], base={"fail_at": 2}, executor="debug", folder=folder)
    t = s.table().set_index("arm")
    assert t.loc["x=1", "status"] == "finished"
    assert t.loc["x=2", "status"] == "failed"
    assert t.loc["x=2", "error"] == "RuntimeError: arm x=2 diverged"
    assert json.loads((folder / "sweep.json").read_text())["seeds"] == [0]
    # Resubmitted: the finished run is read, not run; the failed one resumes (and fails again).
    s2 = sweep(fake, {"x": [1, 2]}, seeds=[0], base={"fail_at": 2}, executor="debug", folder=folder)
    assert s2.runs[("x=1", 0)] is None and s2.runs[("x=2", 0)] is not None
    assert _calls(folder) == ["1 0 False", "2 0 False", "2 0 True"]
    assert list(s2.table().status) == ["finished", "failed"]
    # The same folder with another config for a finished run is refused.
    with pytest.raises(ValueError, match="fail_at"):
        sweep(fake, {"x": [1]}, seeds=[0], base={"fail_at": 3}, executor="debug", folder=folder)


def test_a_dead_run_is_shown_dead_as_everywhere_and_resubmitted(fake, tmp_path):
    """A resumed attempt killed with SIGKILL while it held the run: no results.json, no live
    owner. The table says dead, as runs_table does, and a resubmitted sweep resumes it."""
    import signal

    from posttrain.workflows.run_state import run_state

    folder = tmp_path / "sw" / "d"
    s = sweep(fake, {"x": [1]}, seeds=[0], base={"fail_at": 1}, executor="debug", folder=folder)
    assert s.table().loc[0, "status"] == "failed"
    out = s.out_dir("x=1", 0)
    child = hold_run_dir(out)  # the resumed attempt: its claim clears the failed record
    assert s.table().loc[0, "status"] == "running" == run_state(out).status
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=120)
    row = s.table().loc[0]
    assert row.status == "dead" == run_state(out).status
    assert row.error == run_state(out).detail and "no live process" in row.error
    s2 = sweep(fake, {"x": [1]}, seeds=[0], base={"fail_at": 1}, executor="debug", folder=folder)
    assert _calls(folder) == ["1 0 False", "1 0 True"]  # resumed (and it fails again)
    assert s2.table().loc[0, "status"] == "failed" == run_state(out).status


@pytest.mark.parametrize(
    "grid, options, match",
    [
        ({"lr": [1e-3]}, {}, "unknown config key 'lr'; valid keys: .*optim"),
        ({}, {}, "grid must be a non-empty mapping"),
        ({"optim.lr": []}, {}, r"grid\['optim.lr'\] must be a non-empty list"),
        ({"optim.lr": 1e-3}, {}, r"grid\['optim.lr'\] must be a non-empty list"),
        ({"optim.lr": [1e-3, 1e-3]}, {}, "lists a value twice"),
        ({"seed": [0, 1]}, {}, "set by the sweep itself .pass seeds"),
        (
            {"optim.lr": [1e-3]},
            {"baseline": "optim.lr=0.1"},
            "baseline 'optim.lr=0.1' is not an arm",
        ),
        ({"optim.lr": [1e-3]}, {"seeds": []}, "seeds must be distinct integers"),
        ({"optim.lr": [1e-3]}, {"seeds": [0, 0]}, "seeds must be distinct integers"),
        ({"optim.lr": [-1.0]}, {}, "arm optim.lr=-1.0: .*optim.lr"),
        ({"optim.lr": [1e-3]}, {"base": 3}, "base must be a SFTConfig or a mapping"),
        # found by probing: these used to pass, crash outside sweep, or write the folder first
        ({"optim.lr": [1e-3]}, {"seeds": [True]}, "seeds must be distinct integers .*not bools"),
        ({"optim.lr": [1e-3]}, {"seeds": 0}, "seeds must be distinct integers"),
        ({"optim.lr": [1, 1.0]}, {}, r"lists a value twice: \[1, 1.0\] are one value"),
        ({1: [1e-3]}, {}, "grid key 1 must be a dotted config key"),
        (
            {"optim.lr": [1e-3]},
            {"executor": "bogus"},
            "executor='bogus'; allowed: local, slurm, debug",
        ),
        ({"optim.lr": [1e-3]}, {"timeout_min": -1}, "timeout_min=-1"),
        ({"optim.lr": [1e-3]}, {"baseline": {"optim.lr": True}}, "baseline .* is not an arm"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, grid, options, match):
    folder = tmp_path / "never"
    with pytest.raises(ValueError, match=match):
        sweep("sft", grid, folder=folder, **options)
    assert not folder.exists()


def test_a_grid_key_named_like_a_table_column_is_refused(tmp_path):
    """A recipe field called like a column of `Sweep.table()` (here `status`) cannot be a grid
    key: the table would show one of the two under that name."""
    import dataclasses
    import types

    @dataclasses.dataclass
    class Config:
        status: int = 0
        out_dir: str = "runs/x"
        seed: int = 0
        resume: bool = False

    module = types.ModuleType("status_recipe")
    module.Config, module.main = Config, lambda cfg: {}
    with pytest.raises(ValueError, match="grid key 'status' would hide the sweep table's column"):
        sweep(module, {"status": [1, 2]}, folder=tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_arms_doctests():
    import doctest

    import posttrain.workflows.arms as arms

    assert doctest.testmod(arms).failed == 0


def test_odd_grid_values_get_distinct_valid_folders(fake, tmp_path):
    """Strings with slashes, spaces, commas or that read as JSON, None, bools, dicts and lists:
    each arm its own folder (names written out by hand: percent-encoding of / space , = %, and
    a string that reads as JSON is quoted). The runs fail (the fake recipe knows only ints)."""
    values = [
        "a/b",
        "a_b",
        "a b",
        "ab",
        None,
        "null",
        True,
        "true",
        "1",
        1,
        {"k": "v w"},
        [1, 2],
        "x,fail_at=3",
        "50%",
    ]
    want = [
        "x=a%2Fb",
        "x=a_b",
        "x=a%20b",
        "x=ab",
        "x=null",
        'x="null"',
        "x=true",
        'x="true"',
        'x="1"',
        "x=1",
        'x={"k":"v%20w"}',
        "x=[1%2C2]",
        "x=x%2Cfail_at%3D3",
        "x=50%25",
    ]
    s = sweep(fake, {"x": values}, seeds=[0], executor="debug", folder=tmp_path / "odd")
    table = s.table()
    assert list(table.arm) == want
    assert sorted(p.name for p in (tmp_path / "odd").iterdir() if p.is_dir()) == sorted(want)
    # x=1 and x=true (True == 1 for the fake's lookup) finish with score 1 of 4
    assert table.set_index("arm").loc[["x=1", "x=true"], "value"].tolist() == [0.25, 0.25]
    # two keys: a comma or "=" inside a value must not make two arms one folder
    s = sweep(
        fake,
        {"x": ["a,fail_at=b", "a"], "fail_at": ["c", "b,fail_at=c"]},
        seeds=[0],
        executor="debug",
        folder=tmp_path / "two",
    )
    assert len(set(s.table().out_dir)) == 4


def test_numpy_seeds_and_values_and_a_baseline_of_another_number_type(fake, tmp_path):
    np = pytest.importorskip("numpy")
    s = sweep(
        fake,
        {"x": [np.int64(1), 2]},
        seeds=[np.int64(0)],
        executor="debug",
        baseline={"x": 1.0},
        folder=tmp_path / "np",
    )
    assert s.baseline.name == "x=1" and s.seeds == [0]
    table = s.table()
    assert list(table.arm) == ["x=1", "x=2"] and list(table.value) == [0.25, 0.75]
    assert json.loads((tmp_path / "np" / "sweep.json").read_text())["grid"] == {"x": [1, 2]}
    # True is not the arm x=1, even though True == 1
    with pytest.raises(ValueError, match="baseline {'x': True} is not an arm"):
        sweep(fake, {"x": [1, 2]}, baseline={"x": True}, executor="debug", folder=tmp_path / "b")


def test_paired_difference_says_which_seeds_the_baseline_lacks(fake, tmp_path):
    s = sweep(
        fake, {"x": [1, 2]}, seeds=[0, 1], executor="debug", baseline="x=1", folder=tmp_path / "p"
    )
    (tmp_path / "p" / "x=1" / "seed1" / "results.json").unlink()  # the baseline's seed 1 is lost
    row = s.summary().set_index("arm").loc["x=2"]
    # seed 0 only: x=2 right on 3 of 4 items, x=1 on 1 of 4 -> +0.5 over 4 pairs
    assert (row["diff"], row["paired_items"]) == (0.5, 4)
    assert row["note"] == "seeds [1] left out: the baseline did not finish them"
    assert row["mean"] == pytest.approx((0.75 + 1.0) / 2)


def test_bad_recipe_or_folder_is_a_value_error(fake, tmp_path):
    with pytest.raises(ValueError, match="recipe=3; must be a recipe name or file, or a module"):
        sweep(3, {"x": [1]}, executor="debug", folder=tmp_path / "r")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="folder=.*file'\\); must be the path of a folder"):
        sweep(fake, {"x": [1]}, executor="debug", folder=tmp_path / "file")
    with pytest.raises(ValueError, match="folder=3; must be the path of a folder"):
        sweep(fake, {"x": [1]}, executor="debug", folder=3)
    assert not (tmp_path / "r").exists() and not (tmp_path / "calls.txt").exists()


def test_real_sft_recipe_as_local_processes(tmp_path):
    """Two arms of the real SFT recipe at tiny size, one seed, as local jobs: each arm's row is
    its own run folder's results, and the paired difference is the one recomputed from the two
    eval_after.csv tables."""
    import pandas as pd

    s = sweep(
        "sft",
        {"optim.lr": [1e-3, 1e-2]},
        seeds=[0],
        base=load_recipe("sft").TINY,
        baseline="optim.lr=0.001",
        executor="local",
        folder=tmp_path / "sft",
        timeout_min=10,
    )
    assert isinstance(s, Sweep)
    table = s.wait(timeout=300)
    assert list(table.status) == ["finished", "finished"], table.error.tolist()
    for row in table.itertuples():
        results = json.loads((tmp_path / "sft" / row.arm / "seed0" / "results.json").read_text())
        assert row.value == results["after"]["accuracy"]
        assert (
            json.loads((tmp_path / "sft" / row.arm / "seed0" / "config.json").read_text())["optim"][
                "lr"
            ]
            == row._2
        )
    a, b = (
        pd.read_csv(tmp_path / "sft" / arm / "seed0" / "eval_after.csv")
        for arm in ("optim.lr=0.01", "optim.lr=0.001")
    )
    summary = s.summary().set_index("arm")
    assert summary.loc["optim.lr=0.01", "diff"] == pytest.approx(
        a.correct.mean() - b.correct.mean()
    )
    assert summary.loc["optim.lr=0.01", "paired_items"] == len(a) == 8
    # one seed: the item-level Wilson interval, inside [0, 1]
    assert (
        0 <= summary.loc["optim.lr=0.01", "ci_low"] <= summary.loc["optim.lr=0.01", "ci_high"] <= 1
    )
