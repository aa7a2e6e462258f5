"""Mutants of the 164 HumanEval canonical solutions, generated with `ast` (body -> `return
None`, an int literal + 1, a comparison flipped): each fails in the verifier exactly when it
fails the same tests in a plain subprocess."""

import ast
import json
import subprocess
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from _waits import WAIT_S

from posttrain.rewards import Outcome
from posttrain.verifiers.humaneval import humaneval_verifier
from posttrain.verifiers.sandbox import SandboxLimits, sandbox_available

NO_SANDBOX = sandbox_available()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no sandbox here: {NO_SANDBOX}")


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


_REFERENCE_RUNNER = """
import json, os, resource, sys, types

limit_s, programs = json.load(sys.stdin)
passed = []
for program in programs:
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        resource.setrlimit(resource.RLIMIT_CPU, (limit_s, limit_s))
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        try:
            exec(compile(program, "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    passed.append(os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
print(json.dumps(passed))
"""
"""The reference's runner, run by the system /usr/bin/python3 outside any sandbox: each program
in a child forked from it (a plain process of its own, as `python3 -c PROGRAM` would run it, but
without an interpreter start per program: ~20 ms of CPU each, 404 times), with RLIMIT_AS 1 GiB
and RLIMIT_CPU MUTANT_CPU_S rounded up to whole seconds, as RLIMIT_CPU counts. Prints which
programs exited with status 0."""


def _pass_outside_the_sandbox(made) -> list[bool]:
    """The reference: each mutant's tests in a plain process of its own (`_REFERENCE_RUNNER`,
    two runners side by side); passing = exit status 0 within MUTANT_CPU_S of CPU."""
    programs = [
        f"{source}\n{problem['test']}\ncheck({problem['entry_point']})\n"
        for problem, _, source in made
    ]
    limit_s = int(MUTANT_CPU_S + 0.5)

    def run(share: list[str]) -> list[bool]:
        done = subprocess.run(
            ["/usr/bin/python3", "-c", _REFERENCE_RUNNER],
            input=json.dumps([limit_s, share]),
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            check=True,
        )
        passed = json.loads(done.stdout)
        assert len(passed) == len(share)
        return passed

    half = (len(programs) + 1) // 2
    with ThreadPoolExecutor(2) as pool:
        return [p for part in pool.map(run, (programs[:half], programs[half:])) for p in part]


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
    reference = _pass_outside_the_sandbox(made)
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
