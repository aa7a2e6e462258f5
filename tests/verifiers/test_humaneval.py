"""HumanEval and the code verifier: problem loading, code extraction, every sandbox outcome
typed, the end marker that early exits cannot fake, all 164 canonical solutions passing, and
pass@k of given completions and of a tiny policy's samples. (The estimator itself:
test_pass_at_k.py; mutants of the canonical solutions: test_humaneval_mutants.py.)"""

import doctest
import pickle

import cloudpickle
import pytest

from posttrain.rewards import Outcome, run_verifier
from posttrain.verifiers import get_verifier
from posttrain.verifiers.code_exec import (
    CodeTestsVerifier,
    build_program,
    code_under_test,
    extract_code,
)
from posttrain.verifiers.humaneval import evaluate_pass_at_k, humaneval_problems, humaneval_verifier
from posttrain.verifiers.sandbox import (
    ExecOutcome,
    ExecutionResult,
    SandboxLimits,
    sandbox_available,
)

NO_SANDBOX = sandbox_available()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}")
# CPU limits end runaway programs whatever the load; the wall-clock limits (60 s) are only a
# backstop that a program expected to finish never reaches beside busy neighbours.
FAST = SandboxLimits(cpu_s=2.0, wall_s=60.0, memory_mb=256)


@pytest.fixture(scope="module")
def verifier():
    if NO_SANDBOX is not None:
        pytest.skip(f"no sandbox here: {NO_SANDBOX}")
    return humaneval_verifier(limits=FAST)


# --------------------------------------------------------------------------------------------
# Problems, extraction, programs (no sandbox)
# --------------------------------------------------------------------------------------------


def test_the_164_problems_load_offline_in_order(problems):
    assert len(problems) == 164
    assert [p["task_id"] for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    first = problems[0]
    assert first["entry_point"] == "has_close_elements" and "def check(candidate)" in first["test"]
    assert first["prompt"] in first["question"] and first["answer"] == first["canonical_solution"]
    with pytest.raises(ValueError, match="prompt"):
        humaneval_problems(instruction="no slot")


def test_extract_code_modes():
    fenced = "text\n```python\na = 1\n```\nmore\n```py\nb = 2\n```\n```bash\nls\n```"
    assert extract_code(fenced) == "b = 2\n"  # the last python block
    assert extract_code(fenced, mode="fenced") == "b = 2\n"
    assert extract_code(fenced, mode="raw") == fenced
    assert extract_code("```\nc = 3\n```") == "c = 3\n"  # a bare fence is python
    assert extract_code("    return x\n") == "    return x\n"  # auto: no fence -> raw
    assert extract_code("```js\nx\n```") == "```js\nx\n```"  # no python fence -> raw
    assert extract_code("plain", mode="fenced") is None
    assert extract_code("```python\n  \n```") is None and extract_code(" \n\t") is None
    with pytest.raises(ValueError, match="auto.*fenced.*raw"):
        extract_code("x", mode="markdown")
    with pytest.raises(TypeError, match="str"):
        extract_code(None)


def test_build_program_layout_and_bad_items():
    item = {
        "prompt": "def f(x):\n",
        "test": "def check(c):\n    assert c(1) == 2\n",
        "entry_point": "f",
    }
    body = code_under_test("    return x + 1\n", item)
    assert body == (
        "def f(x):\n    return x + 1\n\ndef check(c):\n    assert c(1) == 2\n\ncheck(f)\n"
    )
    program = build_program("    return x + 1\n", item)
    assert program.endswith(f"\n_posttrain_harness({body!r})\n")
    assert "_posttrain_marker" not in program  # the marker is in no global of the program
    compile(program, "main.py", "exec")
    assert "def f(x):\n" not in code_under_test("y = 1\n", item, include_prompt=False)
    with pytest.raises(ValueError, match="'test'"):
        build_program("x", {"prompt": ""})
    with pytest.raises(ValueError, match="entry_point"):
        build_program("x", {"test": "pass", "entry_point": "f(); import os"})
    with pytest.raises(ValueError, match="'prompt'"):
        build_program("x", {"test": "pass", "prompt": 3})


def test_verifier_options_are_checked():
    with pytest.raises(ValueError, match="extract"):
        CodeTestsVerifier(extract="markdown")
    with pytest.raises(ValueError, match="on_timeout"):
        CodeTestsVerifier(on_timeout="ignore")
    with pytest.raises(ValueError, match="SandboxLimits"):
        CodeTestsVerifier(limits={"cpu_s": 1})
    with pytest.raises(ValueError, match="include_prompt must be True or False"):
        CodeTestsVerifier(include_prompt="no")
    assert CodeTestsVerifier.isolation == "thread"


def _run(outcome, stdout="", stderr="", exit_code=0, signal=None):
    return ExecutionResult(
        outcome=outcome,
        exit_code=exit_code,
        signal=signal,
        stdout=stdout,
        stderr=stderr,
        stdout_truncated=False,
        wall_s=0.1,
    )


@needs_sandbox
def test_every_sandbox_outcome_maps_to_a_typed_verifier_outcome():
    judge = CodeTestsVerifier(limits=FAST, on_timeout="timeout").judge
    cases = [
        (_run(ExecOutcome.OK, "x\nMARK\n"), Outcome.OK),
        (_run(ExecOutcome.OK, "MARK\nmore\n"), Outcome.WRONG),  # the marker must come last
        (_run(ExecOutcome.OK, ""), Outcome.WRONG),
        (
            _run(ExecOutcome.FAILED, stderr="Traceback\nAssertionError\n", exit_code=1),
            Outcome.WRONG,
        ),
        (_run(ExecOutcome.TIMEOUT, exit_code=None, signal=9), Outcome.TIMEOUT),
        (_run(ExecOutcome.MEMORY, exit_code=1), Outcome.WRONG),
        (_run(ExecOutcome.OUTPUT_LIMIT, exit_code=None, signal=9), Outcome.WRONG),
        (_run(ExecOutcome.KILLED, exit_code=None, signal=11), Outcome.WRONG),
        (
            _run(
                ExecOutcome.SANDBOX_ERROR, stderr="bwrap: setting up uid map failed", exit_code=None
            ),
            Outcome.ERROR,
        ),
    ]
    got = [judge(run, "MARK") for run, _ in cases]
    assert [r.outcome for r in got] == [want for _, want in cases]
    assert [r.score for r in got] == [1.0] + [0.0] * 8
    assert got[3].reason == "failed: AssertionError" and "signal 11" in got[7].reason
    assert "uid map" in got[8].reason
    by_default = CodeTestsVerifier(limits=FAST).judge  # the policy's program: its failure
    assert by_default(cases[4][0], "MARK").outcome is Outcome.WRONG


# --------------------------------------------------------------------------------------------
# In the sandbox
# --------------------------------------------------------------------------------------------


@needs_sandbox
def test_all_164_canonical_solutions_pass(problems):
    result = evaluate_pass_at_k(
        problems,
        completions=[[p["canonical_solution"]] for p in problems],
        verifier=humaneval_verifier(limits=FAST),
    )
    failed = result.table[result.table["correct"] == 0]["task_id"].tolist()
    assert failed == [] and result.pass_at_k == {1: 1.0}
    assert result.outcome_counts == {
        "ok": 164,
        "wrong": 0,
        "format_error": 0,
        "timeout": 0,
        "error": 0,
    }


@needs_sandbox
@pytest.mark.parametrize(
    "completion",
    [
        "    import sys\n    sys.exit(0)\n",  # inside the function, during check()
        "    import os\n    os._exit(0)\n",
        "    raise SystemExit(0)\n",
        "    return 0\nimport os\nos._exit(0)\n",  # at top level, before the tests
        "    return 0\nprint('ok')\nimport sys\nsys.exit()\n",  # a fake success line, then exit 0
    ],
)
def test_an_early_exit_with_status_0_is_not_a_pass(problems, verifier, completion):
    problem = problems[0]
    assert verifier(problem["canonical_solution"], problem).ok
    result = verifier(completion, problem)
    assert result.outcome is Outcome.WRONG and "before the tests finished" in result.reason


HACKS = {
    # the reviewer's: an excepthook that prints the (then global) marker and exits 0
    "excepthook_global_marker": (
        "    return True\nimport sys, os\ndef h(*a):\n"
        "    print('\\n'+_posttrain_marker, flush=True); os._exit(0)\n"
        "sys.excepthook=h\n"
    ),
    "excepthook_stdin_marker": (
        "    return True\nimport sys, os\nm = sys.stdin.readline()\n"
        "def h(*a):\n    print('\\n' + m.strip(), flush=True)\n"
        "    os._exit(0)\nsys.excepthook = h\n"
    ),
    "read_stdin_early_then_exit": (
        "    return True\nimport sys, os\nm = sys.stdin.read().strip()\n"
        "print('\\n' + m, flush=True)\nos._exit(0)\n"
    ),
    "read_fd0_early_then_exit": (
        "    return True\nimport os\nm = os.read(0, 100).decode()\n"
        "print('\\n' + m.strip(), flush=True)\nos._exit(0)\n"
    ),
    "atexit_stdin_marker": (
        "    return True\nimport atexit, sys\natexit.register(lambda: "
        "print('\\n' + sys.stdin.readline().strip(), flush=True))\n"
    ),
    "atexit_guessed_marker": (
        "    return True\nimport atexit, os\natexit.register(lambda: "
        "(print('\\n' + '0' * 32, flush=True), os._exit(0)))\n"
    ),
    "sys_exit_inside_check": "    import sys\n    sys.exit(0)\n",
    "sys_exit_in_excepthook": (
        "    return True\nimport sys\nsys.excepthook = lambda *a: sys.exit(0)\n"
    ),
    "print_replaced_by_exit": (
        "    return True\nimport builtins, os\nbuiltins.print = lambda *a, **k: os._exit(0)\n"
    ),
    "os_exit_replaced": "    return True\nimport os\nos._exit = lambda status: None\n",
    "builtins_exit_replaced": (
        "    return True\nimport builtins, os\n"
        "builtins.isinstance = lambda *a: os._exit(0)\n"
        "builtins.type = lambda *a: os._exit(0)\n"
    ),
    "sys_stdout_replaced": (
        "    return True\nimport sys, io\nsys.stdout = io.StringIO()\nsys.stderr = io.StringIO()\n"
    ),
    "keyboard_interrupt_in_check": "    raise KeyboardInterrupt\n",
}


@needs_sandbox
@pytest.mark.parametrize("name", list(HACKS))
def test_generic_ways_to_fake_a_pass_are_wrong(problems, verifier, name):
    """Failing tests cannot be turned into a pass by an excepthook, an atexit handler, reading
    the marker from stdin early, sys.exit inside check, or replacing print / os._exit /
    builtins: the harness ends a failed run itself with exit 1, and the marker is on no stdin
    the code can read and in no global it can name (module docstring)."""
    result = verifier(HACKS[name], problems[0])
    assert result.outcome is Outcome.WRONG and result.score == 0.0, result


@needs_sandbox
def test_harmless_uses_of_stdin_print_and_exit_hooks_still_pass(problems, verifier):
    problem = problems[0]
    for prefix in (
        "    import sys\n    sys.stdin.read()\n",
        "    print('working', flush=True)\n",
        "    import atexit\n    atexit.register(print, 'bye')\n",
    ):
        assert verifier(prefix + problem["canonical_solution"], problem).ok, prefix
    mbpp = {"prompt": "", "test": "if __name__ == '__main__':\n    assert f() == 1\n"}
    assert verifier("def f():\n    return 1\n", mbpp).ok
    assert verifier("def f():\n    return 2\n", mbpp).outcome is Outcome.WRONG


@needs_sandbox
def test_a_non_str_completion_is_its_own_outcome_error_in_a_batch(problems, verifier):
    """One bad completion in a batch is that completion's outcome error; the rest are checked."""
    p0, good = problems[0], problems[0]["canonical_solution"]
    results = verifier.check_many([good, None, b"x", "    return False\n"], [p0] * 4)
    assert [r.outcome for r in results] == [Outcome.OK, Outcome.ERROR, Outcome.ERROR, Outcome.WRONG]
    assert "completion must be a str" in results[1].reason
    assert run_verifier(verifier, None, p0, timeout_s=30).outcome is Outcome.ERROR
    result = evaluate_pass_at_k(
        [p0, problems[1]],
        completions=[[good, None], ["    return 1\n"] * 2],
        ks=[1, 2],
        verifier=verifier,
    )
    assert result.table["correct"].tolist() == [1, 0]
    assert result.pass_at_k == pytest.approx({1: 0.25, 2: 0.5})
    assert result.outcome_counts["error"] == 1 and result.outcome_counts["ok"] == 1


@pytest.mark.parametrize(
    "completions, where",
    [
        (["abc"], r"completions\[0\] must be a list"),
        ("abc", "completions must be a sequence"),
        ([("ok", "ok"), "ab"], r"completions\[1\]"),
        ([None], r"completions\[0\]"),
    ],
)
def test_a_str_where_samples_are_expected_is_a_type_error(problems, completions, where):
    """A bare string is not n one-character samples."""
    with pytest.raises(TypeError, match=where):
        evaluate_pass_at_k(
            problems[: len(completions)] if isinstance(completions, list) else problems[:3],
            completions=completions,
            ks=[1],
            verifier=object(),
        )


@needs_sandbox
def test_failures_in_the_sandbox_are_typed(problems, verifier):
    problem = problems[2]  # truncate_number
    tight = SandboxLimits(cpu_s=0.5, wall_s=60.0, memory_mb=128, output_bytes=10_000)
    cases = {
        "    return None\n": Outcome.WRONG,
        "    return number % 1.0 +\n": Outcome.WRONG,  # syntax error
        "    while True:\n        pass\n": Outcome.WRONG,  # time limit
        "    x = bytearray(1 << 30)\n": Outcome.WRONG,  # memory limit
        "    print('a' * 100_000)\n    return number % 1.0\n": Outcome.WRONG,  # output limit
        "I would rather not.\n\n": Outcome.WRONG,  # prose is code that fails
        "   \n": Outcome.FORMAT_ERROR,
    }
    checker = humaneval_verifier(limits=tight)
    results = checker.check_many(list(cases), [problem] * len(cases))
    assert [r.outcome for r in results] == list(cases.values())
    assert "SyntaxError" in results[1].reason and "memory" in results[3].reason
    assert "output" in results[4].reason
    loops = humaneval_verifier(limits=tight)("    while True:\n        pass\n", problem)
    assert loops.outcome is Outcome.WRONG and "time limit" in loops.reason
    excluded = humaneval_verifier(limits=tight, on_timeout="timeout")(
        "    while True:\n        pass\n", problem
    )
    assert excluded.outcome is Outcome.TIMEOUT
    bad_item = run_verifier(verifier, "    return 1\n", {"prompt": "def f():\n"}, timeout_s=30)
    assert bad_item.outcome is Outcome.ERROR and "'test'" in bad_item.reason


@needs_sandbox
def test_the_verifier_pickles_registers_and_runs_through_run_verifier(problems, verifier):
    problem = problems[1]
    fenced = f"Sure:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\n"
    for dumps, loads in [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)]:
        copy = loads(dumps(verifier))
        assert run_verifier(copy, fenced, problem, timeout_s=copy.time_budget_s).ok
    assert get_verifier("humaneval").extract == "auto"
    strict = get_verifier("code_tests", extract="fenced", limits=FAST)
    assert strict(problem["canonical_solution"], problem).outcome is Outcome.FORMAT_ERROR
    assert strict(fenced, problem).ok


@needs_sandbox
def test_pass_at_k_of_given_completions_by_hand(problems, verifier):
    """Two problems, three samples each: canonical, `return None`, canonical -> c = 2 of n = 3:
    pass@1 = 2/3; pass@2 = 1 - C(1,2)/C(3,2) = 1; pass@3 = 1."""
    items = problems[3:5]
    samples = [
        [p["canonical_solution"], "    return None\n", p["canonical_solution"]] for p in items
    ]
    result = evaluate_pass_at_k(items, completions=samples, ks=(1, 2, 3), verifier=verifier)
    assert result.pass_at_k == pytest.approx({1: 2 / 3, 2: 1.0, 3: 1.0}, abs=1e-12)
    assert result.table["correct"].tolist() == [2, 2] and result.num_problems == 2
    assert [[r.outcome.value for r in rs] for rs in result.results] == [["ok", "wrong", "ok"]] * 2
    with pytest.raises(ValueError, match="at least max"):
        evaluate_pass_at_k(items, completions=samples, ks=(4,), verifier=verifier)
    with pytest.raises(ValueError, match="exactly one"):
        evaluate_pass_at_k(items, verifier=verifier)
    with pytest.raises(ValueError, match="one list per item"):
        evaluate_pass_at_k(items, completions=samples[:1], verifier=verifier)


@needs_sandbox
def test_pass_at_k_of_a_tiny_policy_samples_n_per_problem(verifier):
    from posttrain.policy import Policy

    items = [
        {
            "task_id": "add",
            "question": "Write add(a, b).",
            "prompt": "",
            "test": "assert add(1, 2) == 3\n",
            "entry_point": None,
        },
        {
            "task_id": "neg",
            "question": "Write neg(a).",
            "prompt": "",
            "test": "assert neg(1) == -1\n",
            "entry_point": None,
        },
    ]
    policy = Policy.from_spec("tiny-1m", seed=0)
    result = evaluate_pass_at_k(
        items, policy=policy, n=3, ks=(1, 3), max_new_tokens=6, verifier=verifier
    )
    assert result.table["n"].tolist() == [3, 3] and sum(result.outcome_counts.values()) == 6
    # a fresh model writes bytes, not add(): nothing passes and nothing is a checker error
    assert result.pass_at_k == {1: 0.0, 3: 0.0} and result.outcome_counts["error"] == 0


def test_doctests():
    import posttrain.verifiers.code_exec as code_exec
    import posttrain.verifiers.humaneval as humaneval

    for module in (code_exec, humaneval):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0
