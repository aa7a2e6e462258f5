"""Verifier time budgets that hold for CPU-bound checks: a budgeted call runs in a worker process
that is killed (with everything it started) when the call runs past its budget, so CPU-bound
checks stop (`1e999999999` through math_answer, a catastrophic regex), later calls are not
slowed, Ctrl-C kills the calls in flight, no process a call started outlives it, a huge reason is
cut, and budgets are finite. (What workers accept and report:
tests/rewards/test_verifier_workers.py; linear parsers: tests/verifiers/test_linear_parsers.py; the
reward range rule: tests/rl/test_reward_rule.py.)

On a loaded machine a call cut at its budget returns late by up to `_waits.LATE_S`, so the work
a budget must cut runs far longer (it spins, or sleeps 600 s) and calls expected to finish get
budgets of seconds; how late a cut call returns on a quiet machine is for benchmarks
(`KILL_MARGIN_S` documents it)."""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from _waits import LATE_S, WAIT_S, wait_for
from _worker_helpers import cpu_seconds, gone, live_in_groups, note_pid_then_spin, quick, timed

from posttrain.rewards.verifier import Outcome, VerifierResult, run_verifier, score_batch
from posttrain.rewards.verifier_pool import verifier_pool
from posttrain.rewards.verifier_threads import MAX_TIMEOUT_S
from posttrain.rewards.verifier_worker import MAX_REASON_CHARS
from posttrain.verifiers.basic import RegexVerifier
from posttrain.verifiers.math_answer import MathAnswerVerifier

# The verifiers below travel to the workers by value, as notebook functions do. By reference (the
# default for a module's functions) a worker would import this module, and torch with it: ~3 s
# for every new worker.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_a_huge_exponent_through_math_answer_ends_within_its_budget():
    """`1e999999999` made the thread-budgeted math verifier run for minutes (sympy / Fraction
    expand the power); in a worker it is cut at 1 s."""
    verify = MathAnswerVerifier()
    assert run_verifier(verify, "The answer is 2", {"answer": "2"}, timeout_s=30).ok  # loaded
    result, elapsed = timed(
        lambda: run_verifier(verify, "The answer is 1e999999999", {"answer": "2"}, timeout_s=1.0)
    )
    assert isinstance(result.outcome, Outcome) and elapsed < 1.0 + LATE_S, (result, elapsed)


def test_a_catastrophic_regex_times_out_and_its_worker_is_killed():
    """`^(a+)+$` on 34 a's and a b backtracks ~2**34 times inside `re` (which holds the
    interpreter lock: a thread budget could not even abandon it cleanly)."""
    verify = RegexVerifier(r"^(a+)+$")
    assert run_verifier(verify, "aaa", {}, timeout_s=30).ok
    pool = verifier_pool()
    before = set(pool.pids())
    result, elapsed = timed(lambda: run_verifier(verify, "a" * 34 + "b", {}, timeout_s=0.5))
    assert result.outcome is Outcome.TIMEOUT and result.score == 0.0
    assert result.reason == "verifier ran past 0.5 s (worker process killed)"
    assert 0.5 <= elapsed < 0.5 + LATE_S, elapsed  # the backtracking takes hours
    killed = before - set(pool.pids())
    assert len(killed) == 1
    wait_for(lambda: all(gone(p) for p in killed), what=f"the killed worker {killed} to end")


def test_abandoned_work_leaves_nothing_spinning_and_no_process(tmp_path):
    """Threads that ran past their budget kept spinning and made every later call ~8x slower.
    After 4 timeouts of a spinning verifier: the process groups of the 4 killed workers are
    empty, this process has no more threads than before, the pool is back to its size, and no
    pool worker burns CPU while idle (a spinning one takes ~0.5 s of CPU per 0.5 s; an idle one
    ~0). Counted, not timed, so a busy machine cannot make it fail."""
    pool = verifier_pool()
    run_verifier(quick, "x", {}, timeout_s=30)

    threads, workers = threading.active_count(), len(pool.pids())
    item = {"pids": str(tmp_path / "pids")}
    for _ in range(4):
        assert run_verifier(note_pid_then_spin, "x", item, timeout_s=0.2).outcome is Outcome.TIMEOUT
    killed = {int(line) for line in (tmp_path / "pids").read_text().split()}
    assert len(killed) == 4 and not killed & set(pool.pids())
    wait_for(
        lambda: len(pool.pids()) == workers,
        what=f"the pool to be back to {workers} workers",
        detail=lambda: f"it has {pool.pids()}",
    )
    assert run_verifier(quick, "x", {}, timeout_s=30).outcome is not Outcome.TIMEOUT
    wait_for(
        lambda: not live_in_groups(killed),
        what="the killed workers' groups to empty",
        detail=lambda: f"live: {live_in_groups(killed)}",
    )
    assert threading.active_count() <= threads
    pids = pool.pids()
    burnt: dict[int, float] = {}

    def idle() -> bool:
        # A replacement worker still starting up burns CPU for a moment (0.11 s of a window
        # was seen on a loaded machine); a spinning one never stops, so this never comes true.
        start = {pid: cpu_seconds(pid) for pid in pids}
        time.sleep(0.5)
        burnt.update({pid: cpu_seconds(pid) - start[pid] for pid in pids})
        return all(cpu < 0.1 for cpu in burnt.values())

    wait_for(idle, what="every pool worker to idle", detail=lambda: f"CPU s per 0.5 s: {burnt}")
    assert len(pool.pids()) <= pool.max_processes


def _meet(completion, item):
    """Notes its arrival in item["folder"], then waits until all item["n"] calls of the batch
    have arrived: it returns only if the calls run side by side (one after the other, the first
    waits until its budget cuts it)."""
    folder = Path(item["folder"])
    (folder / completion).write_text("")
    while len(list(folder.iterdir())) < item["n"]:
        time.sleep(0.01)
    return 1.0


def test_score_batch_runs_hangers_side_by_side_in_order(tmp_path):
    completions = ["1", "spin", "2", "raise", "spin", "3"]
    items = [{"answer": c} for c in completions]

    def verifier(completion, item):
        if completion == "spin":
            while True:
                pass
        if completion == "raise":
            raise RuntimeError("bad item")
        return float(completion == item["answer"])

    results = score_batch(verifier, completions, items, timeout_s=1.0)
    assert [r.outcome.value for r in results] == ["ok", "timeout", "ok", "error", "timeout", "ok"]
    assert results[3].reason == "RuntimeError: bad item"
    assert len(verifier_pool().pids()) <= verifier_pool().max_processes
    # side by side: two calls that each wait for the other both return (counted, not timed)
    if verifier_pool().max_processes < 2:
        pytest.skip("a pool of one worker runs calls one after the other")
    meeting = [{"folder": str(tmp_path), "n": 2}] * 2
    assert [r.outcome.value for r in score_batch(_meet, ["a", "b"], meeting, timeout_s=LATE_S)] == [
        "ok",
        "ok",
    ]


def test_ctrl_c_during_a_batch_kills_its_workers_and_the_pool_goes_on(tmp_path):
    """A KeyboardInterrupt (Ctrl-C, a notebook's interrupt) while calls spin: it propagates,
    the workers in flight are killed (nothing keeps spinning), the next call works."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    def pids() -> set[int]:
        path = tmp_path / "pids"
        return {int(line) for line in path.read_text().split()} if path.exists() else set()

    def interrupt_once_spinning():
        """Ctrl-C once every call in flight (one per worker) spins, as a user would press it."""
        try:
            wait_for(
                lambda: len(pids()) >= min(4, pool.max_processes),
                what="the calls in flight to note their pids and spin",
            )
        finally:  # on a time-out too: the batch must not spin for its whole budget
            os.kill(os.getpid(), signal.SIGALRM)

    pool = verifier_pool()
    run_verifier(quick, "x", {}, timeout_s=30)
    item = {"pids": str(tmp_path / "pids")}
    previous = signal.signal(signal.SIGALRM, interrupt)
    presser = threading.Thread(target=interrupt_once_spinning)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            score_batch(note_pid_then_spin, ["x"] * 4, [item] * 4, timeout_s=WAIT_S)
    finally:
        presser.join()
        signal.signal(signal.SIGALRM, previous)
    spinning = pids()
    assert len(spinning) >= min(4, pool.max_processes)
    wait_for(
        lambda: all(gone(p) for p in spinning), what=f"the spinning workers {spinning} to be killed"
    )
    assert run_verifier(quick, "x", {}, timeout_s=30).ok


# -- Nothing a call started outlives it; budgets and reasons are bounded ---------------------


def _leaves_a_process(completion, item):
    """Starts a process ("child": a plain child; "setsid": it leaves the worker's session;
    "orphan": also its parent exits at once), notes its pid, then spins or returns."""
    read, write = os.pipe()
    if os.fork() == 0:
        if item["how"] != "child":
            os.setsid()
        if item["how"] == "orphan" and os.fork() != 0:
            os._exit(0)
        os.write(write, str(os.getpid()).encode())
        while item["how"] == "setsid":
            pass
        os._exit(time.sleep(600) or 0)
    item["pid_file"].write_text(os.read(read, 32).decode())
    while item["spin"]:
        pass
    return 1.0


@pytest.mark.parametrize("how", ["child", "setsid", "orphan"])
@pytest.mark.parametrize("spin", [True, False])
def test_no_process_a_verifier_starts_outlives_its_call(tmp_path, how, spin):
    """Defect: `os.fork(); os.setsid(); spin` survived the timeout kill (PPID 1, 99% CPU), and a
    child left by a call that returned lived on. The worker is their subreaper: on a timeout
    they die before it; after a call it kills what is left. The process sleeps or spins for
    600 s: the call returns at its budget (2 s: time to start the process first) or at once."""
    item = {"how": how, "spin": spin, "pid_file": tmp_path / "pid"}
    budget = 2.0 if spin else LATE_S
    result, elapsed = timed(lambda: run_verifier(_leaves_a_process, "x", item, timeout_s=budget))
    assert result.outcome is (Outcome.TIMEOUT if spin else Outcome.OK), result
    assert elapsed < budget + LATE_S, elapsed
    pid = int((tmp_path / "pid").read_text())
    wait_for(lambda: gone(pid), what=f"process {pid} ({how}) to end with its call")


def _on_a_thread(completion, item):
    return VerifierResult(0.0, "wrong", "x" * item.get("n", 0))


_on_a_thread.isolation = "thread"


@pytest.mark.parametrize("timeout_s", [math.inf, 1e7, 1e300, math.nan, -1.0, 0, True, "5"])
def test_a_budget_beyond_the_maximum_or_not_finite_is_refused(timeout_s):
    """Defect: inf, 1e7 and 1e300 passed validation, then raised OverflowError in the wait."""
    for verifier in (quick, _on_a_thread):
        with pytest.raises(
            ValueError,
            match=r"timeout_s must be None \(no budget\) or a number "
            r"of seconds in \(0, 1e\+06\]",
        ):
            run_verifier(verifier, "x", {}, timeout_s=timeout_s)
        with pytest.raises(ValueError, match="timeout_s"):
            score_batch(verifier, ["x"], [{}], timeout_s=timeout_s)
        assert run_verifier(verifier, "x", {}, timeout_s=MAX_TIMEOUT_S).scored


def test_a_huge_reason_is_cut_and_the_deadline_holds():
    """Defect: a 200 MB reason came back as `wrong` after 5.8 s of a 5 s budget. The worker
    cuts it to MAX_REASON_CHARS (start and end kept); threads cut it the same way."""
    long = lambda c, i: VerifierResult(0.0, "wrong", "x" * i["n"])  # noqa: E731
    budget = 30.0  # building 200 MB takes ~0.1 s of it when the machine is quiet
    result, elapsed = timed(lambda: run_verifier(long, "x", {"n": 200_000_000}, timeout_s=budget))
    assert result.outcome is Outcome.WRONG and elapsed < budget + LATE_S, (result.outcome, elapsed)
    assert len(result.reason) < MAX_REASON_CHARS + 100 and "characters cut" in result.reason
    assert run_verifier(long, "x", {"n": MAX_REASON_CHARS}).reason == "x" * MAX_REASON_CHARS
    assert len(run_verifier(_on_a_thread, "x", {"n": 10**6}).reason) < MAX_REASON_CHARS + 100
