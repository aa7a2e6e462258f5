"""What verifier workers accept and report, and how they live and die: closures and classes
from notebook cells run in a worker process; a raising or crashing verifier is outcome error; a
verifier that cannot travel to a worker runs on a thread with a warning; `isolation = "thread"`
runs in this process; a worker does not import torch, dies with its parent, is not shared with
a forked child, and discards its output; `score_batch` refuses a str or a mapping for its
sequences. (Time budgets: tests/rewards/test_budgets.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import cloudpickle
import pytest
from _waits import WAIT_S, wait_for
from _worker_helpers import cpu_seconds, gone, quick

from posttrain.rewards.verifier import Outcome, VerifierResult, run_verifier, score_batch
from posttrain.rewards.verifier_pool import WorkerPool, verifier_pool
from posttrain.verifiers.basic import FormatVerifier
from posttrain.verifiers.math_answer import MathAnswerVerifier

# The verifiers below travel to the workers by value, as notebook functions do. By reference (the
# default for a module's functions) a worker would import this module, and torch with it: ~3 s
# for every new worker.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_a_notebook_closure_and_class_run_in_a_worker_process():
    threshold = 3

    class LongEnough:  # as if defined in a notebook cell: pickled by value
        def __call__(self, completion, item):
            return VerifierResult.from_score(
                float(len(completion) >= threshold), reason=str(os.getpid())
            )

    result = run_verifier(LongEnough(), "abcd", {}, timeout_s=30)
    assert result.ok and int(result.reason) != os.getpid()
    assert int(result.reason) in verifier_pool().pids()
    assert (
        run_verifier(lambda c, i: len(c) >= threshold, "ab", {}, timeout_s=30).outcome
        is Outcome.WRONG
    )

    cell = "def in_main(completion, item):\n    return float(completion == item['answer'])\n"
    scope = {"__name__": "__main__"}  # a function of the notebook's __main__ module
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
    result = run_verifier(lambda c, i: os.kill(os.getpid(), signal.SIGSEGV), "x", {}, timeout_s=30)
    assert "killed by SIGSEGV" in result.reason
    assert run_verifier(quick, "x", {}, timeout_s=30).ok  # the pool carries on


def test_a_verifier_that_does_not_pickle_runs_on_a_thread_with_a_warning():
    import threading

    class HoldsALock:
        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, completion, item):
            with self.lock:
                return VerifierResult.from_score(1.0, reason=str(os.getpid()))

    with pytest.warns(
        UserWarning,
        match=r"cannot run in a worker process \(cloudpickle failed: "
        r"TypeError: cannot pickle '_thread.lock' object \(in "
        r"'lock', a lock\)\).*isolation = 'thread'",
    ):
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
    with pytest.warns(
        UserWarning,
        match="the worker could not unpickle it: ImportError: no such module in the worker",
    ):
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

    with pytest.raises(
        ValueError,
        match=r"Odd.isolation is 'gpu'; allowed values: \('process', "
        r"'thread'\)",
    ):
        run_verifier(Odd(), "x", {}, timeout_s=1.0)


def test_warnings_are_not_raised_by_the_process_path():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_verifier(MathAnswerVerifier(), "\\boxed{2}", {"answer": "2"}, timeout_s=30).ok


def test_score_batch_refuses_a_str_or_a_mapping_for_its_sequences():
    """Defect: "ab" and {"answer": 1} were zipped character by character / key by key."""
    cases = [("ab", [{}], "completions"), (b"ab", [{}], "completions"), (["a"], {"a": 1}, "items")]
    for completions, items, name in cases:
        with pytest.raises(TypeError, match=f"score_batch {name} must be a sequence"):
            score_batch(quick, completions, items)


# -- A worker's life: no torch, dies with its parent, its own in a fork, output discarded -----


def test_the_worker_does_not_import_torch():
    """posttrain's packages load their re-exports on first use, so neither importing the
    verifiers nor a worker running one imports torch (~1.2 s)."""
    code = "import sys, posttrain.verifiers; print('torch' in sys.modules)"
    plain = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S
    )
    assert plain.stdout.strip() == "False"
    pool = WorkerPool(max_processes=1)  # a fresh worker (the shared ones ran other tests)
    try:
        verify = FormatVerifier(inner=lambda c, i: float("torch" not in sys.modules))
        (result,) = pool.run(verify, [("<answer>x</answer>", {})], timeout_s=30, max_workers=1)
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
        cpu = cpu_seconds(worker)
        wait_for(
            lambda: cpu_seconds(worker) > cpu + 0.2,
            what=f"worker {worker} to spin in the verifier (0.2 s of CPU)",
        )
        owner.kill()
        owner.wait(timeout=WAIT_S)
        wait_for(lambda: gone(worker), what=f"worker {worker} to die with its parent")
    finally:
        owner.kill()


def test_a_forked_child_starts_its_own_pool():
    run_verifier(quick, "x", {}, timeout_s=30)
    parent_workers = set(verifier_pool().pids())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the worker that served it, then leave at once
        try:
            result = run_verifier(
                lambda c, i: VerifierResult.from_score(1.0, reason=str(os.getpid())),
                "x",
                {},
                timeout_s=30,
            )
            os.write(write, result.reason.encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    served_by = os.read(read, 64).decode()
    os.close(read)
    assert status == 0 and served_by.isdigit()
    assert int(served_by) not in parent_workers and int(served_by) != pid
    assert set(verifier_pool().pids()) == parent_workers  # the parent's pool is untouched
    assert run_verifier(quick, "x", {}, timeout_s=30).ok


def test_what_a_worker_prints_does_not_reach_this_process():
    """Defect: a verifier printing 10 MB flooded the host's stdout (a notebook cell)."""
    script = (
        "import os, sys\nfrom posttrain.rewards.verifier import run_verifier\n"
        "def loud(c, i):\n    print('x' * 10**7); print('y' * 10**7, file=sys.stderr)\n"
        "    return float(os.system('echo from-a-child') == 0)\n"
        "print(run_verifier(loud, 'x', {}, timeout_s=60).outcome.value)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.stdout == "ok\n" and len(done.stderr) < 10_000, done.stderr[-2000:]
