"""Mutants of the 164 HumanEval canonical solutions, generated with `ast` (body -> `return
None`, an int literal + 1, a comparison flipped): each fails in the verifier exactly when it
fails the same tests in a plain subprocess."""

import ast
import resource
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
