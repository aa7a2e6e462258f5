"""Agreement of `MathAnswerVerifier` with Math-Verify's own published test expectations.

Math-Verify's tests (https://github.com/huggingface/Math-Verify, tests/) pin, for pairs of a gold
answer and a prediction, whether they must verify as equal, and the extraction configs and
options each pair is run with (`compare_strings(gold, pred, match_types=[...], precision=...)`,
or `verify(parse(gold), parse(pred))` with the default configs). `--extract` reads those pairs
out of the test files of one commit (by their syntax tree: nothing is executed) into
benchmarks/data/math_verify_cases.json; the run scores each pair with a `MathAnswerVerifier` set
up as the case is (targets, `float_rounding`, `strict`, `allow_set_relation_comp`,
`extract="anywhere"`: math-verify's search of the whole prediction, as the tests do) and once
more with the verifier's defaults (boxed, then marker, then whole).

Agreement: the verifier's outcome is ok exactly when the case expects equality. A false
positive is ok where the case expects "not equal" (a reward for a wrong answer); a false
negative is any other outcome where it expects "equal".

Usage:
    python benchmarks/math_verify_agreement.py   # prints, writes its docs/benchmarks/ page:
                                                 # docs/benchmarks/math_verify_agreement.md
    python benchmarks/math_verify_agreement.py --previous 48fa468 289316f   # and earlier versions
    python benchmarks/math_verify_agreement.py --extract /path/to/Math-Verify.git [--commit SHA]
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "math_verify_cases.json"
DOC = ROOT / "docs" / "benchmarks" / "math_verify_agreement.md"
REPOSITORY = "huggingface/Math-Verify"
TEST_FILES = (
    "tests/test_all.py",
    "tests/test_boxed.py",
    "tests/test_numina_cases.py",
    "tests/test_open_thoughts.py",
    "tests/test_strict.py",
    "tests/test_yujianll.py",
    "tests/test_string_extraction.py",
    "tests/test_configs.py",
    "tests/test_timeout.py",
    "tests/test_raise_on_error.py",
)

# compare_strings(...) in tests/test_all.py: "latex" is
# LatexExtractionConfig(boxed_match_priority=0), "expr" ExprExtractionConfig();
# verify(..., float_rounding=precision, strict, allow_set_relation_comp).
COMPARE_DEFAULTS = {
    "match_types": ["latex", "expr"],
    "precision": 6,
    "strict": True,
    "allow_set_relation_comp": False,
}


# --------------------------------------------------------------------------------------------
# Extraction of the cases from the test files (syntax tree only)
# --------------------------------------------------------------------------------------------


def _value(node: Any, params: dict) -> Any:
    """A literal, a test parameter by name, or an f-string over `math` (test_float_precision);
    None for anything else (a config object in a parameter list)."""
    if isinstance(node, ast.Name) and node.id in params:
        return params[node.id]
    try:
        return eval(
            compile(ast.Expression(node), "<case>", "eval"), {"math": math, "__builtins__": {}}
        )
    except NameError:
        return None


def _parametrizations(function: ast.FunctionDef) -> list[tuple[int, dict]]:
    """(line, {argname: value}) for each parameter set of `@pytest.mark.parametrize`."""
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize":
            names = [n.strip() for n in _value(decorator.args[0], {}).split(",")]
            table: Any = decorator.args[1]  # a list or tuple node of parameter tuples
            return [
                (
                    element.lineno,
                    dict(zip(names, (_value(v, {}) for v in element.elts), strict=True)),
                )
                for element in table.elts
            ]
    return [(function.lineno, {})]


def _pair(test: ast.expr, params: dict) -> dict | None:
    """The case asserted by `compare_strings(...) == expected` or
    `int(verify(parse(gold), parse(pred))) == expected`, or None for any other assert."""
    if not (
        isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
    ):
        return None
    call: Any = test.left  # an ast node of any kind, read by its fields
    expected = _value(test.comparators[0], params)
    if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "int":
        call = call.args[0]
    name = getattr(call.func, "id", "") if isinstance(call, ast.Call) else ""
    if name == "compare_strings":
        options: dict[str, Any] = dict(COMPARE_DEFAULTS)
        options.update({k.arg: _value(k.value, params) for k in call.keywords})
        gold, pred = (_value(a, params) for a in call.args[:2])
        return {
            "gold": gold,
            "pred": pred,
            "expected": bool(expected),
            "targets": [
                {"latex": "latex_boxed_first", "expr": "expr"}[t] for t in options["match_types"]
            ],
            "float_rounding": options["precision"],
            "strict": options["strict"],
            "allow_set_relation_comp": options["allow_set_relation_comp"],
        }
    if name == "verify" and all(
        getattr(a.func, "id", "") == "parse" and len(a.args) == 1 and not a.keywords
        for a in call.args[:2]
    ):
        gold, pred = (_value(a.args[0], params) for a in call.args[:2])
        return {
            "gold": gold,
            "pred": pred,
            "expected": bool(expected),
            "targets": ["latex_default", "expr"],
            "float_rounding": 6,
            "strict": True,
            "allow_set_relation_comp": False,
        }
    return None


def extract_cases(repo: Path, commit: str) -> dict:
    """The gold/prediction cases of Math-Verify's tests at `commit` of the git repository `repo`,
    with the tests that are not such pairs counted by file."""
    cases: list[dict] = []
    other: collections.Counter[str] = collections.Counter()
    for path in TEST_FILES:
        source = subprocess.run(
            ["git", "-C", str(repo), "show", f"{commit}:{path}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for function in ast.parse(source).body:
            if not (isinstance(function, ast.FunctionDef) and function.name.startswith("test")):
                continue
            asserts = [n for n in ast.walk(function) if isinstance(n, ast.Assert)]
            for index, (line, params) in enumerate(_parametrizations(function)):
                found = [p for p in (_pair(a.test, params) for a in asserts) if p is not None]
                if not found:
                    other[path] += 1
                for pair in found:
                    cases.append({"id": f"{path}::{function.name}[{index}]", "line": line, **pair})
    return {
        "source": {
            "repository": REPOSITORY,
            "commit": commit,
            "paths": list(TEST_FILES),
            "license": "Apache-2.0 (Math-Verify's LICENCE)",
        },
        "not_pairs": dict(other),
        "cases": cases,
    }


# --------------------------------------------------------------------------------------------
# Running the cases
# --------------------------------------------------------------------------------------------


def _targets(names: list[str]) -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    configs = {
        "latex_boxed_first": LatexExtractionConfig(boxed_match_priority=0),
        "latex_default": LatexExtractionConfig(),
        "expr": ExprExtractionConfig(),
    }
    return tuple(configs[name] for name in names)


def score_cases(cases: list[dict], *, defaults: bool = False, module=None) -> list[dict]:
    """Each case with the verifier's `outcome` and `reason` added: set up as the case is, or
    with the verifier's default extraction (`defaults=True`; targets and options still the
    case's). `module`: a math_answer module to take the verifier from (`previous_module`);
    this checkout's by default."""
    if module is None:
        from posttrain.verifiers import math_answer as module

    scored = []
    for case in cases:
        verifier = module.MathAnswerVerifier(
            extract=module.DEFAULT_EXTRACT if defaults else "anywhere",
            targets=_targets(case["targets"]),
            float_rounding=case["float_rounding"],
            strict=case["strict"],
            allow_set_relation_comp=case["allow_set_relation_comp"],
        )
        result = verifier(case["pred"], {"answer": case["gold"]})
        scored.append({**case, "outcome": result.outcome.value, "reason": result.reason})
    return scored


def summarize(scored: list[dict]) -> dict:
    """Counts: cases, agree, false positives (ok where "not equal" is expected), false
    negatives (anything else where "equal" is expected), and outcomes."""
    fp = [c for c in scored if c["outcome"] == "ok" and not c["expected"]]
    fn = [c for c in scored if c["outcome"] != "ok" and c["expected"]]
    return {
        "cases": len(scored),
        "agree": len(scored) - len(fp) - len(fn),
        "false_positives": len(fp),
        "false_negatives": len(fn),
        "outcomes": dict(collections.Counter(c["outcome"] for c in scored)),
        "disagreements": fp + fn,
    }


def load_cases(path: Path = DATA) -> dict:
    """The JSON data file written by `--extract`."""
    return json.loads(path.read_text())


_APPROXIMATE = (
    "the answer holds `\\approx`, a relation math-verify does not compare: it reads one "
    "side of it (here the {side}), so `x \\approx 11` would be credited for 11 and "
    "`1/3 \\approx 11` for 1/3 or 11; the verifier refuses it as a hedge (format_error)"
)
_TWO_BOXES = (
    "the completion boxes {boxes}: two box runs with different values, which the "
    "verifier refuses as two final answers (format_error) whatever the source"
)

# Why a case scored differently from its published expectation does so, by case id: each is a
# completion that Math-Verify credits and the verifier refuses as stating more than one answer.
WHY: dict[str, str] = {
    "tests/test_all.py::test_relations_math[13]": _APPROXIMATE.format(side="left, 1/3"),
    "tests/test_all.py::test_relations_math[15]": _APPROXIMATE.format(side="right, 11"),
    "tests/test_all.py::test_relations_math[16]": _APPROXIMATE.format(side="left, 1/3"),
    "tests/test_all.py::test_math_extraction_additional_cases[17]": _TWO_BOXES.format(
        boxes="the intermediate results 200 and 255 and states the final answer 10,455 in words"
    ),
    "tests/test_open_thoughts.py::test_open_thoughts[14]": _TWO_BOXES.format(
        boxes='(3, 3) "for part (a) and" (1, 1)'
    ),
    "tests/test_open_thoughts.py::test_open_thoughts[24]": _TWO_BOXES.format(
        boxes="`y_1 = \\boxed{...}` and `y_2 = \\boxed{...}` (`y_2 =` stands between the boxes)"
    ),
}


def _default_gap(case: dict) -> str:
    """Why the verifier's defaults decline a case that math-verify's search accepts."""
    if case["outcome"] == "format_error" and case["reason"].startswith("no answer found"):
        return (
            'prose with no `\\boxed{}`, no answer marker ("answer is", "answer:") and '
            "not only an answer: the defaults do not search prose for the last span or number"
        )
    if case["outcome"] == "format_error" and case["reason"].startswith("not one answer"):
        return (
            "the completion states more than one answer (`\\approx`, or boxes with different "
            "values): refused as a hedge, as set up as each case"
        )
    if case["outcome"] == "format_error":
        return "the marker's sentence holds nothing math-verify's answer-anchored patterns read"
    return (
        'the last boxed answer is not the one expected: words between boxes ("for part (a) '
        'and", "y_2 ="), or a last box after the stated final answer'
    )


def previous_module(ref: str):
    """verifiers/math_answer.py at git `ref` of this checkout, loaded as a separate module (its
    verifier not registered), to measure an earlier version on the same cases."""
    import types

    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:verifiers/math_answer.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    source = source.replace('register_verifier("math_answer")', "(lambda cls: cls)")
    module = types.ModuleType(f"math_answer_at_{ref}")
    exec(compile(source, f"{ref}:verifiers/math_answer.py", "exec"), module.__dict__)
    return module


def score_with(verifier, cases: list[dict]) -> list[dict]:
    """Each case with `outcome` from one fixed `verifier` (a raise counts as error)."""
    scored = []
    for case in cases:
        try:
            outcome = verifier(case["pred"], {"answer": case["gold"]}).outcome.value
        except Exception:  # noqa: BLE001 - recorded as the outcome a runner would give
            outcome = "error"
        scored.append({**case, "outcome": outcome, "reason": ""})
    return scored


def previous_runs(ref: str, cases: list[dict]) -> dict[str, list[dict]]:
    """The scored cases of the version at `ref`: set up as each case and with its defaults, or
    only its defaults (`MathAnswerVerifier()`) where its constructor takes no such settings."""
    module = previous_module(ref)
    try:
        return {
            f"previous verifier at `{ref}`, set up as each case": score_cases(cases, module=module),
            f"previous verifier at `{ref}`, defaults": score_cases(
                cases, defaults=True, module=module
            ),
        }
    except (TypeError, AttributeError):  # an early version: no targets / extract settings
        name = f"previous verifier at `{ref}`, defaults (exact rationals, last-number fallback)"
        return {name: score_with(module.MathAnswerVerifier(), cases)}


def changes(now: list[dict], before: list[dict]) -> list[str]:
    """The cases whose outcome differs between two runs over the same cases, as report lines."""
    return [
        f"`{new['id'].split('::')[1]}` (expects {'equal' if new['expected'] else 'not equal'})"
        f": {old['outcome']} -> {new['outcome']}"
        for new, old in zip(now, before, strict=True)
        if new["outcome"] != old["outcome"]
    ]


def _row(name: str, run: dict) -> str:
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(run["outcomes"].items()))
    return (
        f"| {name} | {run['cases']} | {run['agree']} | {100 * run['agree'] / run['cases']:.1f}% "
        f"| {run['false_positives']} | {run['false_negatives']} | {outcomes} |"
    )


def _report(data: dict, scored: dict[str, list[dict]], seconds: float, previous: list[str]) -> str:
    runs = {name: summarize(cases) for name, cases in scored.items()}
    source = data["source"]
    files = ", ".join(p.split("/")[-1] for p in source["paths"])
    lines = [
        "# MathAnswerVerifier against Math-Verify's published test expectations",
        "",
        f"Cases: the {len(data['cases'])} gold/prediction pairs with an expected result in the "
        f"tests of `{source['repository']}` at commit `{source['commit']}` ({files}), read from "
        "their syntax trees by `benchmarks/math_verify_agreement.py --extract` into "
        "`benchmarks/data/math_verify_cases.json`, each with the extraction configs and options "
        "its test runs it with. Tests that are not such pairs (string extraction, configs, "
        f"mocked timeouts, raise_on_error: {sum(data['not_pairs'].values())}) are not cases.",
        "",
        "Supported: all 270. Every case's configs and options are settings of the verifier "
        "(`targets` as math-verify config objects, `float_rounding`, `strict`, "
        '`allow_set_relation_comp`); with `extract="anywhere"` the prediction is searched by '
        "math-verify as in the tests, and the gold is read by the verifier's reference rule.",
        "",
        "Agreement: outcome ok exactly when the case expects equal. False positive: ok where the "
        "case expects not equal (a reward for a wrong answer). False negative: any other outcome "
        "where it expects equal.",
        "",
        "Command: `python benchmarks/math_verify_agreement.py"
        + (f" --previous {' '.join(previous)}`" if previous else "`")
        + f" (math-verify 0.9.0, latex2sympy2_extended 1.11.0, antlr4-python3-runtime 4.9.3; "
        f"{seconds:.0f} s on 2 shared cores).",
        "",
        "| verifier | cases | agree | agreement | false positives | false negatives | outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        lines.append(_row(name, run))
    case_run, default_run = list(runs.values())[:2]
    lines += [
        "",
        "## Disagreements, set up as each case",
        "",
        "Each is a completion that states more than one answer, which Math-Verify's tests "
        "credit and the verifier refuses as a hedge (format_error, never credited, whatever "
        "the extraction order: verifiers/math_statements.py):",
        "",
    ]
    for case in case_run["disagreements"]:
        kind = "false positive" if case["outcome"] == "ok" else "false negative"
        lines.append(
            f"- `{case['id']}` (line {case['line']}), {kind}, outcome "
            f"{case['outcome']}: {WHY.get(case['id'], 'not explained yet')}."
        )
    if not case_run["disagreements"]:
        lines.append(
            "None. Without the verifier's fix for LaTeX percentages (latex2sympy2_extended's "
            "parser for antlr4 4.9.3 lacks `AtomContext.FUNC_GAMMA`, so `28\\%` raised inside "
            "math-verify) one case failed: `tests/test_all.py::test_latex_notation_math[2]` "
            '(gold "... $28 \\%$", prediction `\\boxed{28\\%}`), which math-verify itself then '
            "also fails."
        )
    names = list(scored)
    for name in names[2:4] if previous and "set up as each case" in names[2] else []:
        kind = "set up as each case" if "each case" in name else "defaults"
        now = scored[names[0] if kind == "set up as each case" else names[1]]
        lines += ["", f"## Outcomes changed since `{previous[0]}`, {kind}", ""]
        lines += [f"- {line}." for line in changes(now, scored[name])] or ["None."]
    gaps = collections.defaultdict(list)
    for case in default_run["disagreements"]:
        gaps[_default_gap(case)].append(case["id"].split("::")[1])
    lines += [
        "",
        "## Where the defaults decline (all false negatives, no false positive)",
        "",
        "The defaults take the answer only from a box, an answer marker or a completion "
        "that is only an answer, so prose that states an answer in passing gets "
        "format_error instead of math-verify's last-span or last-number guess:",
        "",
    ]
    for why, ids in sorted(gaps.items(), key=lambda item: -len(item[1])):
        lines.append(f"- {len(ids)}: {why}: {', '.join(f'`{i}`' for i in ids)}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--extract",
        type=Path,
        help="a Math-Verify git repository: rewrite the data file from its tests",
    )
    parser.add_argument("--commit", default="HEAD", help="the commit to read (with --extract)")
    parser.add_argument("--doc", type=Path, default=DOC, help="where to write the report")
    parser.add_argument(
        "--previous",
        metavar="REF",
        nargs="*",
        default=[],
        help="also score verifiers/math_answer.py as it was at these git refs of the checkout",
    )
    args = parser.parse_args(argv)
    if args.extract:
        commit = subprocess.run(
            ["git", "-C", str(args.extract), "rev-parse", args.commit],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        data = extract_cases(args.extract, commit)
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {len(data['cases'])} cases to {DATA}")
        return
    data = load_cases()
    start = time.monotonic()
    scored = {
        'MathAnswerVerifier set up as each case (`extract="anywhere"`)': score_cases(data["cases"]),
        'MathAnswerVerifier defaults (`extract=("boxed", "marker", "whole")`)': score_cases(
            data["cases"], defaults=True
        ),
    }
    for ref in args.previous:
        scored.update(previous_runs(ref, data["cases"]))
    seconds = time.monotonic() - start
    report = _report(data, scored, seconds, args.previous)
    args.doc.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
