"""Verifier time budgets that hold for CPU-bound checks, and linear tag parsers.

Budgets: a budgeted call runs in a worker process that is killed (with everything it started)
when the call runs past its budget, so CPU-bound checks stop (`1e999999999` through math_answer,
a catastrophic regex) and later calls are not slowed. Workers take closures from notebook cells,
report a raising or crashing verifier as outcome error, do not import torch, survive neither
their parent's SIGKILL nor a fork, leave no process a call started, cut long reasons and discard
their output; budgets are finite; a str or mapping batch is refused. Parsers: 25,000 tags in
milliseconds of CPU. (The reward range rule: tests/test_reward_rule.py.)

On a loaded machine a call cut at its budget returns late by up to `conftest.LATE_S`, so the
work a budget must cut runs far longer (it spins, or sleeps 600 s), calls expected to finish get
budgets of seconds, and parsers are timed in CPU seconds (`conftest.thread_cpu_s`); how late a
cut call returns on a quiet machine is for benchmarks (`KILL_MARGIN_S` documents it)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import cloudpickle
import numpy as np
import psutil
import pytest

from _waits import LATE_S, WAIT_S, thread_cpu_s, wait_for
from posttrain.envs.calculator_env import (MAX_CALLS_PER_TURN, CalculatorEnv,
                                           evaluate_arithmetic)
from posttrain.rewards.verifier import Outcome, VerifierResult, run_verifier, score_batch
from posttrain.rewards.verifier_pool import WorkerPool, verifier_pool
from posttrain.rewards.verifier_threads import MAX_TIMEOUT_S
from posttrain.rewards.verifier_worker import MAX_REASON_CHARS
from posttrain.verifiers.basic import FormatVerifier, RegexVerifier, extract_tag, tag_contents
from posttrain.verifiers.math_answer import MathAnswerVerifier

# The verifiers below travel to the workers by value, as notebook functions do. By reference (the
# default for a module's functions) a worker would import this module, and torch with it: ~3 s
# for every new worker.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _spin(completion, item):
    """Never returns, holding the CPU (and, on a thread, the interpreter lock)."""
    while True:
        pass


def _quick(completion, item):
    """A few milliseconds of pure-Python work."""
    return float(sum(range(100_000)) > 0)


def _elapsed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for init counts as ended: it runs nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _live_in_groups(pgids: set[int]) -> list[int]:
    """Live (non-zombie) processes whose process group is one of `pgids`."""
    found = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) in pgids and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


# -- The measured cases: CPU-bound checks end at their budget --------------------------------


def test_a_huge_exponent_through_math_answer_ends_within_its_budget():
    """`1e999999999` made the thread-budgeted math verifier run for minutes (sympy / Fraction
    expand the power); in a worker it is cut at 1 s."""
    verify = MathAnswerVerifier()
    assert run_verifier(verify, "The answer is 2", {"answer": "2"}, timeout_s=30).ok  # loaded
    result, elapsed = _elapsed(lambda: run_verifier(verify, "The answer is 1e999999999",
                                                    {"answer": "2"}, timeout_s=1.0))
    assert isinstance(result.outcome, Outcome) and elapsed < 1.0 + LATE_S, (result, elapsed)


def test_a_catastrophic_regex_times_out_and_its_worker_is_killed():
    """`^(a+)+$` on 34 a's and a b backtracks ~2**34 times inside `re` (which holds the
    interpreter lock: a thread budget could not even abandon it cleanly)."""
    verify = RegexVerifier(r"^(a+)+$")
    assert run_verifier(verify, "aaa", {}, timeout_s=30).ok
    pool = verifier_pool()
    before = set(pool.pids())
    result, elapsed = _elapsed(lambda: run_verifier(verify, "a" * 34 + "b", {}, timeout_s=0.5))
    assert result.outcome is Outcome.TIMEOUT and result.score == 0.0
    assert result.reason == "verifier ran past 0.5 s (worker process killed)"
    assert 0.5 <= elapsed < 0.5 + LATE_S, elapsed   # the backtracking takes hours
    killed = before - set(pool.pids())
    assert len(killed) == 1
    wait_for(lambda: all(_gone(p) for p in killed), what=f"the killed worker {killed} to end")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_abandoned_work_leaves_nothing_spinning_and_no_process(tmp_path):
    """Threads that ran past their budget kept spinning and made every later call ~8x slower.
    After 4 timeouts of a spinning verifier: the process groups of the 4 killed workers are
    empty, this process has no more threads than before, the pool is back to its size, and no
    pool worker burns CPU while idle (a spinning one takes ~0.5 s of CPU per 0.5 s; an idle one
    ~0). Counted, not timed, so a busy machine cannot make it fail."""
    pool = verifier_pool()
    run_verifier(_quick, "x", {}, timeout_s=30)

    def note_pid_then_spin(completion, item):
        with open(item["pids"], "a") as f:
            f.write(f"{os.getpid()}\n")
        while True:
            pass

    threads, workers = threading.active_count(), len(pool.pids())
    item = {"pids": str(tmp_path / "pids")}
    for _ in range(4):
        assert run_verifier(note_pid_then_spin, "x", item, timeout_s=0.2).outcome is \
            Outcome.TIMEOUT
    killed = {int(line) for line in (tmp_path / "pids").read_text().split()}
    assert len(killed) == 4 and not killed & set(pool.pids())
    wait_for(lambda: len(pool.pids()) == workers, what=f"the pool to be back to {workers} workers",
             detail=lambda: f"it has {pool.pids()}")
    assert run_verifier(_quick, "x", {}, timeout_s=30).outcome is not Outcome.TIMEOUT
    wait_for(lambda: not _live_in_groups(killed), what="the killed workers' groups to empty",
             detail=lambda: f"live: {_live_in_groups(killed)}")
    assert threading.active_count() <= threads
    pids = pool.pids()
    start = {pid: _cpu_seconds(pid) for pid in pids}
    time.sleep(0.5)
    burnt = {pid: _cpu_seconds(pid) - start[pid] for pid in pids}
    assert all(cpu < 0.1 for cpu in burnt.values()), burnt
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
    assert [r.outcome.value for r in score_batch(_meet, ["a", "b"], meeting,
                                                 timeout_s=LATE_S)] == ["ok", "ok"]


def test_ctrl_c_during_a_batch_kills_its_workers_and_the_pool_goes_on(tmp_path):
    """A KeyboardInterrupt (Ctrl-C, a notebook's interrupt) while calls spin: it propagates,
    the workers in flight are killed (nothing keeps spinning), the next call works."""
    def note_pid_then_spin(completion, item):
        with open(item["pids"], "a") as f:
            f.write(f"{os.getpid()}\n")
        while True:
            pass

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    def pids() -> set[int]:
        path = tmp_path / "pids"
        return {int(line) for line in path.read_text().split()} if path.exists() else set()

    def interrupt_once_spinning():
        """Ctrl-C once every call in flight (one per worker) spins, as a user would press it."""
        try:
            wait_for(lambda: len(pids()) >= min(4, pool.max_processes),
                     what="the calls in flight to note their pids and spin")
        finally:  # on a time-out too: the batch must not spin for its whole budget
            os.kill(os.getpid(), signal.SIGALRM)

    pool = verifier_pool()
    run_verifier(_quick, "x", {}, timeout_s=30)
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
    wait_for(lambda: all(_gone(p) for p in spinning), what=f"the spinning workers {spinning} "
             "to be killed")
    assert run_verifier(_quick, "x", {}, timeout_s=30).ok


# -- What workers accept and report ----------------------------------------------------------


def test_a_notebook_closure_and_class_run_in_a_worker_process():
    threshold = 3

    class LongEnough:   # as if defined in a notebook cell: pickled by value
        def __call__(self, completion, item):
            return VerifierResult.from_score(float(len(completion) >= threshold),
                                             reason=str(os.getpid()))

    result = run_verifier(LongEnough(), "abcd", {}, timeout_s=30)
    assert result.ok and int(result.reason) != os.getpid()
    assert int(result.reason) in verifier_pool().pids()
    assert run_verifier(lambda c, i: len(c) >= threshold, "ab", {},
                        timeout_s=30).outcome is Outcome.WRONG

    cell = "def in_main(completion, item):\n    return float(completion == item['answer'])\n"
    scope = {"__name__": "__main__"}   # a function of the notebook's __main__ module
    exec(cell, scope)
    assert run_verifier(scope["in_main"], "7", {"answer": "7"}, timeout_s=30).ok


def test_a_verifier_that_raises_or_crashes_its_worker_is_an_error():
    def raises(completion, item):
        raise KeyError("answer")

    result = run_verifier(raises, "x", {}, timeout_s=30)
    assert result.outcome is Outcome.ERROR and result.reason == "KeyError: 'answer'"
    result = run_verifier(lambda c, i: os._exit(3), "x", {}, timeout_s=30)
    assert result.outcome is Outcome.ERROR
    assert result.reason == "the worker process died (exit code 3) while running the verifier"
    result = run_verifier(lambda c, i: os.kill(os.getpid(), signal.SIGSEGV), "x", {},
                          timeout_s=30)
    assert "killed by SIGSEGV" in result.reason
    assert run_verifier(_quick, "x", {}, timeout_s=30).ok   # the pool carries on


def test_a_verifier_that_does_not_pickle_runs_on_a_thread_with_a_warning():
    import threading

    class HoldsALock:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, completion, item):
            with self.lock:
                return VerifierResult.from_score(1.0, reason=str(os.getpid()))

    with pytest.warns(UserWarning, match=r"cannot run in a worker process \(cloudpickle failed: "
                                         r"TypeError: cannot pickle '_thread.lock' object \(in "
                                         r"'lock', a lock\)\).*isolation = 'thread'"):
        result = run_verifier(HoldsALock(), "x", {}, timeout_s=30)
    assert result.ok and int(result.reason) == os.getpid()


def _refuse_to_load():
    raise ImportError("no such module in the worker")


class _LoadsOnlyHere:
    """Pickles fine but cannot be unpickled (what a class from a module the worker cannot
    import looks like)."""

    def __reduce__(self):
        return _refuse_to_load, ()

    def __call__(self, completion, item):
        return 1.0


def test_a_verifier_the_worker_cannot_unpickle_runs_on_a_thread_with_a_warning():
    with pytest.warns(UserWarning, match="the worker could not unpickle it: ImportError: no such "
                                         "module in the worker"):
        results = score_batch(_LoadsOnlyHere(), ["a", "b", "c"], [{}] * 3, timeout_s=30)
    assert [r.outcome for r in results] == [Outcome.OK] * 3


def test_thread_isolation_runs_in_this_process_and_bad_values_are_refused():
    class Client:
        isolation = "thread"

        def __call__(self, completion, item):
            return VerifierResult.from_score(1.0, reason=str(os.getpid()))

    assert int(run_verifier(Client(), "x", {}, timeout_s=30).reason) == os.getpid()

    class Slow(Client):
        def __call__(self, completion, item):
            time.sleep(2)

    result = run_verifier(Slow(), "x", {}, timeout_s=0.1)
    assert result.reason == "verifier ran past 0.1 s (on a thread, abandoned)"
    inner_judge = FormatVerifier(inner=Client())
    assert inner_judge.isolation == "thread"

    class Odd(Client):
        isolation = "gpu"

    with pytest.raises(ValueError, match=r"Odd.isolation is 'gpu'; allowed values: \('process', "
                                         r"'thread'\)"):
        run_verifier(Odd(), "x", {}, timeout_s=1.0)


def test_the_worker_does_not_import_torch():
    """posttrain's packages load their re-exports on first use, so neither importing the
    verifiers nor a worker running one imports torch (~1.2 s)."""
    code = "import sys, posttrain.verifiers; print('torch' in sys.modules)"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=WAIT_S)
    assert plain.stdout.strip() == "False"
    pool = WorkerPool(max_processes=1)      # a fresh worker (the shared ones ran other tests)
    try:
        verify = FormatVerifier(inner=lambda c, i: float("torch" not in sys.modules))
        result, = pool.run(verify, [("<answer>x</answer>", {})], timeout_s=30, max_workers=1)
        assert result.ok, result
    finally:
        pool.shutdown()


def test_a_worker_dies_with_its_parent():
    """SIGKILL the process that owns the pool while its worker spins: the kernel kills the
    worker (parent-death signal), so nothing is left running."""
    script = textwrap.dedent("""
        import sys
        from posttrain.rewards.verifier import run_verifier
        from posttrain.rewards.verifier_pool import verifier_pool
        run_verifier(lambda c, i: 1.0, "x", {}, timeout_s=60)
        print(verifier_pool().pids()[0], flush=True)
        def spin(c, i):
            while True:
                pass
        run_verifier(spin, "x", {}, timeout_s=600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(owner.stdout.readline())
        cpu = _cpu_seconds(worker)
        wait_for(lambda: _cpu_seconds(worker) > cpu + 0.2,
                 what=f"worker {worker} to spin in the verifier (0.2 s of CPU)")
        owner.kill()
        owner.wait(timeout=WAIT_S)
        wait_for(lambda: _gone(worker), what=f"worker {worker} to die with its parent")
    finally:
        owner.kill()


def test_a_forked_child_starts_its_own_pool():
    run_verifier(_quick, "x", {}, timeout_s=30)
    parent_workers = set(verifier_pool().pids())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: report the worker that served it, then leave at once
        try:
            result = run_verifier(lambda c, i: VerifierResult.from_score(
                1.0, reason=str(os.getpid())), "x", {}, timeout_s=30)
            os.write(write, result.reason.encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    served_by = os.read(read, 64).decode()
    os.close(read)
    assert status == 0 and served_by.isdigit()
    assert int(served_by) not in parent_workers and int(served_by) != pid
    assert set(verifier_pool().pids()) == parent_workers   # the parent's pool is untouched
    assert run_verifier(_quick, "x", {}, timeout_s=30).ok


# -- Linear parsers and the calculator's bounded tool ----------------------------------------


@pytest.mark.parametrize("text", ["<answer>" * 25_000, "<answer>x</answer>" * 25_000,
                                  "<answer>" * 25_000 + "</answer>",
                                  "</answer><answer>" * 25_000])
def test_25000_tags_are_parsed_in_linear_time(text):
    """The regex took ~21 s on 25,000 unclosed tags (quadratic); the scan takes milliseconds
    (CPU seconds: a bound 10x under the quadratic cost, that waiting for a core cannot break)."""
    _, cpu_s = thread_cpu_s(lambda: extract_tag(text, "answer"))
    assert cpu_s < 2.0, cpu_s
    result, cpu_s = thread_cpu_s(lambda: FormatVerifier()(text, {}))
    assert cpu_s < 2.0 and isinstance(result.outcome, Outcome)


def test_tag_contents_equals_the_regular_expression():
    """Reference: `re.findall` with the lazy pattern (the slower path), on random texts."""
    rng = np.random.default_rng(0)
    pieces = ["<a>", "</a>", "a", "<", ">", "/", " ", "<a", "a>", "</", "\n", "<b>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces, size=int(rng.integers(0, 14))))
        assert tag_contents(text, "a") == re.findall(r"<a>(.*?)</a>", text, re.DOTALL), text
    assert extract_tag("<a> 1 </a><a>2 ", "a") == "1"
    assert extract_tag("no tags", "a") is None


def test_the_calculator_refuses_huge_powers_at_once_and_bounds_a_turn():
    """Refusals and the worst 200-character expressions take milliseconds of CPU (the powers
    would never end); a turn evaluates at most MAX_CALLS_PER_TURN calls (counted)."""
    for expression in ["9**9**9**9", "2**10**100", "(10**10)**(10**10)"]:
        start = time.thread_time()
        with pytest.raises(ValueError, match="Pow is not allowed"):
            evaluate_arithmetic(expression)
        assert time.thread_time() - start < 0.5, expression
    worst = ["1/7" * 66 + "1", "(" * 99 + "1" + ")" * 99, "-" * 199 + "1",
             "(1/7-1/11)/(1/13+1/17)*" * 8 + "1"]
    for expression in worst:
        _, cpu_s = thread_cpu_s(lambda: evaluate_arithmetic(expression[:200]))
        assert cpu_s < 0.5, (expression, cpu_s)
    env = CalculatorEnv({"question": "?", "answer": "2"})
    result, cpu_s = thread_cpu_s(lambda: env.step("<calc>1+1</calc>" * 25_000))
    replies = result.observation[0]["content"].split("\n")
    assert cpu_s < 5.0 and len(replies) == MAX_CALLS_PER_TURN + 1
    assert replies[0] == "<result>2</result>"
    assert replies[-1] == (f"<result>error: {25_000 - MAX_CALLS_PER_TURN} more calls not "
                           f"evaluated (at most {MAX_CALLS_PER_TURN} a turn)</result>")
    assert env.calls == 25_000 and env.tool_errors == 25_000 - MAX_CALLS_PER_TURN
    _, cpu_s = thread_cpu_s(lambda: CalculatorEnv({"question": "?", "answer": "2"}).step(
        "<calc>" * 25_000))
    assert cpu_s < 2.0


def test_warnings_are_not_raised_by_the_process_path():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_verifier(MathAnswerVerifier(), "\\boxed{2}", {"answer": "2"}, timeout_s=30).ok




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
    result, elapsed = _elapsed(lambda: run_verifier(_leaves_a_process, "x", item,
                                                    timeout_s=budget))
    assert result.outcome is (Outcome.TIMEOUT if spin else Outcome.OK), result
    assert elapsed < budget + LATE_S, elapsed
    pid = int((tmp_path / "pid").read_text())
    wait_for(lambda: _gone(pid), what=f"process {pid} ({how}) to end with its call")


def _on_a_thread(completion, item):
    return VerifierResult(0.0, "wrong", "x" * item.get("n", 0))


_on_a_thread.isolation = "thread"


@pytest.mark.parametrize("timeout_s", [math.inf, 1e7, 1e300, math.nan, -1.0, 0, True, "5"])
def test_a_budget_beyond_the_maximum_or_not_finite_is_refused(timeout_s):
    """Defect: inf, 1e7 and 1e300 passed validation, then raised OverflowError in the wait."""
    for verifier in (_quick, _on_a_thread):
        with pytest.raises(ValueError, match=r"timeout_s must be None \(no budget\) or a number "
                                             r"of seconds in \(0, 1e\+06\]"):
            run_verifier(verifier, "x", {}, timeout_s=timeout_s)
        with pytest.raises(ValueError, match="timeout_s"):
            score_batch(verifier, ["x"], [{}], timeout_s=timeout_s)
        assert run_verifier(verifier, "x", {}, timeout_s=MAX_TIMEOUT_S).scored


def test_a_huge_reason_is_cut_and_the_deadline_holds():
    """Defect: a 200 MB reason came back as `wrong` after 5.8 s of a 5 s budget. The worker
    cuts it to MAX_REASON_CHARS (start and end kept); threads cut it the same way."""
    long = lambda c, i: VerifierResult(0.0, "wrong", "x" * i["n"])   # noqa: E731
    budget = 30.0   # building 200 MB takes ~0.1 s of it when the machine is quiet
    result, elapsed = _elapsed(lambda: run_verifier(long, "x", {"n": 200_000_000},
                                                    timeout_s=budget))
    assert result.outcome is Outcome.WRONG and elapsed < budget + LATE_S, (result.outcome,
                                                                           elapsed)
    assert len(result.reason) < MAX_REASON_CHARS + 100 and "characters cut" in result.reason
    assert run_verifier(long, "x", {"n": MAX_REASON_CHARS}).reason == "x" * MAX_REASON_CHARS
    assert len(run_verifier(_on_a_thread, "x", {"n": 10**6}).reason) < MAX_REASON_CHARS + 100


def test_what_a_worker_prints_does_not_reach_this_process():
    """Defect: a verifier printing 10 MB flooded the host's stdout (a notebook cell)."""
    script = ("import os, sys\nfrom posttrain.rewards.verifier import run_verifier\n"
              "def loud(c, i):\n    print('x' * 10**7); print('y' * 10**7, file=sys.stderr)\n"
              "    return float(os.system('echo from-a-child') == 0)\n"
              "print(run_verifier(loud, 'x', {}, timeout_s=60).outcome.value)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=WAIT_S)
    assert done.stdout == "ok\n" and len(done.stderr) < 10_000, done.stderr[-2000:]


def test_score_batch_refuses_a_str_or_a_mapping_for_its_sequences():
    """Defect: "ab" and {"answer": 1} were zipped character by character / key by key."""
    cases = [("ab", [{}], "completions"), (b"ab", [{}], "completions"), (["a"], {"a": 1}, "items")]
    for completions, items, name in cases:
        with pytest.raises(TypeError, match=f"score_batch {name} must be a sequence"):
            score_batch(_quick, completions, items)
