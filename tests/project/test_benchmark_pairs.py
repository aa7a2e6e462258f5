"""benchmarks/pairs.py: contenders run round-robin after a warm-up, each run's wall and CPU
seconds recorded, per-pair ratios by both clocks. Clocks are scripted here, so every ratio is
pinned by hand; one test runs real CPU work through the real clocks."""

import argparse
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import pairs  # noqa: E402


@pytest.fixture
def scripted(monkeypatch):
    """A wall clock and a CPU clock that only move when a contender says how much."""
    now = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(
        pairs,
        "time",
        argparse.Namespace(perf_counter=lambda: now["wall"], process_time=lambda: now["cpu"]),
    )

    def advance(wall: float, cpu: float) -> None:
        now["wall"] += wall
        now["cpu"] += cpu

    return advance


def test_contenders_alternate_after_a_warmup_and_pair_by_both_clocks(scripted):
    """a: 10 tokens per run in 1, 2, 1 wall s and 2 CPU s each; b: 20 tokens in 4, 2, 8 wall s
    and 2, 4, 1 CPU s (the warm-up runs take 100 s, untimed).
    Tokens per wall second: a 10, 5, 10; b 5, 10, 2.5 -> a/b 2, 0.5, 4 -> 2.00x [0.50, 4.00].
    Tokens per CPU second: a 5, 5, 5; b 10, 5, 20 -> 0.5, 1, 0.25 -> 0.50x [0.25, 1.00].
    Per run, whatever the tokens: wall b/a 4, 1, 8 -> 4.00x [1.00, 8.00]; CPU 1, 2, 0.5 ->
    1.00x [0.50, 2.00]."""
    calls = []
    a_s = {-1: (100, 100), 0: (1, 2), 1: (2, 2), 2: (1, 2)}
    b_s = {-1: (100, 100), 0: (4, 2), 1: (2, 4), 2: (8, 1)}

    def contender(name, secs, tokens):
        def fn(seed):
            calls.append((name, seed))
            scripted(*secs[seed])
            return tokens

        return fn

    runs = pairs.run_interleaved(
        {"a": contender("a", a_s, 10), "b": contender("b", b_s, 20)}, 3, log=None
    )
    assert calls == [
        ("a", -1),
        ("b", -1),
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
    ]
    assert runs["a"] == [(10, 1, 2), (10, 2, 2), (10, 1, 2)]
    assert runs["b"] == [(20, 4, 2), (20, 2, 4), (20, 8, 1)]
    assert pairs.paired_ratios(runs["a"], runs["b"]) == [2.0, 0.5, 4.0]
    assert pairs.paired_ratios(runs["a"], runs["b"], "cpu") == [0.5, 1.0, 0.25]
    assert pairs.ratio_cells(runs["a"], runs["b"]) == {
        "wall": "2.00x [0.50, 4.00]",
        "cpu": "0.50x [0.25, 1.00]",
    }
    assert pairs.ratio_cells(runs["a"], runs["b"], per_work=False) == {
        "wall": "4.00x [1.00, 8.00]",
        "cpu": "1.00x [0.50, 2.00]",
    }
    assert pairs.spread(pairs.rates(runs["b"])) == (5.0, 2.5, 10.0)
    assert pairs.fmt(1234.5, 1000, 20000) == "1,234 [1,000, 20,000]"


def test_a_server_clock_a_self_timed_block_and_fewer_runs(scripted):
    """The server's clock counts 3 CPU s per call of `served` (this process's clock would count
    0.5); `block` times itself (its run is kept as returned, whatever the clocks did); `once`
    runs in the first round only, and alone makes the untimed warm-up call (seed -1)."""
    server = {"cpu": 0.0}
    calls = []

    def served(seed):
        calls.append(("served", seed))
        scripted(1.0, 0.5)
        server["cpu"] += 3.0
        return 8

    def block(seed):
        calls.append(("block", seed))
        scripted(9.0, 9.0)
        return pairs.Run(4, 2.0, 1.5)

    def once(seed):
        calls.append(("once", seed))
        scripted(5.0, 5.0)
        return 1

    runs = pairs.run_interleaved(
        {"served": served, "block": block, "once": once},
        {"served": 2, "block": 2, "once": 1},
        {"served": lambda: server["cpu"]},
        warmup=["once"],
        log=None,
    )
    assert calls == [("once", -1)] + [
        ("served", 0), ("block", 0), ("once", 0), ("served", 1), ("block", 1)
    ]  # fmt: skip
    assert runs == {
        "served": [(8, 1.0, 3.0)] * 2,
        "block": [(4, 2.0, 1.5)] * 2,
        "once": [(1, 5.0, 5.0)],
    }
    # 8 / 3 tokens per CPU s against 4 / 1.5: 1.0x
    assert pairs.paired_ratios(runs["served"], runs["block"], "cpu") == [pytest.approx(1.0)] * 2


def test_bad_runs_are_refused_by_name():
    with pytest.raises(ValueError, match="reps for 'a' is 0"):
        pairs.run_interleaved({"a": lambda s: 1}, 0, log=None)
    with pytest.raises(ValueError, match=r"warmup names \['b'\]; not contenders"):
        pairs.run_interleaved({"a": lambda s: 1}, 1, warmup=["b"], log=None)
    with pytest.raises(ValueError, match="'a' run 0 did 0 work"):
        pairs.run_interleaved({"a": lambda s: 0}, 1, log=None)
    with pytest.raises(ValueError, match="pair runs of the same cell"):
        pairs.paired_ratios([(1, 1.0, 1.0)], [])
    with pytest.raises(ValueError, match="--reps must be >= 1"):
        pairs.spread([])
    with pytest.raises(ValueError, match="no CPU seconds"):
        pairs.paired_ratios([(1, 1.0)], [(1, 2.0)], "cpu")
    with pytest.raises(ValueError, match="clock 'gpu'; must be one of"):
        pairs.rates([(1, 1.0, 1.0)], "gpu")  # type: ignore[arg-type]
    assert pairs.paired_ratios([(1, 1.0)], [(1, 2.0)]) == [2.0]  # wall ratios need no CPU time


def test_real_clocks_record_the_cpu_work_of_each_run():
    """A contender summing squares for 200k and one for 400k iterations: each run records
    positive wall and CPU seconds and the work it returned (no timed assertion)."""

    def busy(n):
        return lambda seed: sum(i * i for i in range(n)) and n

    runs = pairs.run_interleaved({"short": busy(200_000), "long": busy(400_000)}, 2, log=None)
    assert [r.work for r in runs["short"] + runs["long"]] == [200_000] * 2 + [400_000] * 2
    assert all(r.wall_s > 0 and r.cpu_s > 0 for rs in runs.values() for r in rs)


def test_a_process_groups_cpu_time_is_read_from_proc():
    """This process's CPU time (getrusage, via time.process_time) is part of its process group's
    (/proc); a group with no process has used none."""
    import time

    sum(i * i for i in range(200_000))  # some CPU time of our own
    own = time.process_time()
    assert pairs.group_cpu_s(os.getpgid(0)) >= own - 0.02
    assert pairs.group_cpu_s(2**22 + 12345) == 0.0
