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
    python benchmarks/math_verify_agreement.py            # prints, writes docs/benchmarks_math_verify.md
    python benchmarks/math_verify_agreement.py --previous 289316f   # and an earlier version
    python benchmarks/math_verify_agreement.py --extract /path/to/Math-Verify.git [--commit SHA]
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "math_verify_cases.json"
DOC = ROOT / "docs" / "benchmarks_math_verify.md"
REPOSITORY = "huggingface/Math-Verify"
TEST_FILES = ("tests/test_all.py", "tests/test_boxed.py", "tests/test_numina_cases.py",
              "tests/test_open_thoughts.py", "tests/test_strict.py", "tests/test_yujianll.py",
              "tests/test_string_extraction.py", "tests/test_configs.py", "tests/test_timeout.py",
              "tests/test_raise_on_error.py")

# compare_strings(...) in tests/test_all.py: "latex" is LatexExtractionConfig(boxed_match_priority=0),
# "expr" ExprExtractionConfig(); verify(..., float_rounding=precision, strict, allow_set_relation_comp).
COMPARE_DEFAULTS = {"match_types": ["latex", "expr"], "precision": 6, "strict": True,
                    "allow_set_relation_comp": False}


# --------------------------------------------------------------------------------------------
# Extraction of the cases from the test files (syntax tree only)
# --------------------------------------------------------------------------------------------


def _value(node: ast.AST, params: dict):
    """A literal, a test parameter by name, or an f-string over `math` (test_float_precision);
    None for anything else (a config object in a parameter list)."""
    if isinstance(node, ast.Name) and node.id in params:
        return params[node.id]
    try:
        return eval(compile(ast.Expression(node), "<case>", "eval"),
                    {"math": math, "__builtins__": {}})
    except NameError:
        return None


def _parametrizations(function: ast.FunctionDef) -> list[tuple[int, dict]]:
    """(line, {argname: value}) for each parameter set of `@pytest.mark.parametrize`."""
    for decorator in function.decorator_list:
        if isinstance(decorator, ast.Call) and getattr(decorator.func, "attr", "") == "parametrize":
            names = [n.strip() for n in _value(decorator.args[0], {}).split(",")]
            return [(element.lineno, dict(zip(names, (_value(v, {}) for v in element.elts),
                                              strict=True)))
                    for element in decorator.args[1].elts]
    return [(function.lineno, {})]


def _pair(test: ast.expr, params: dict) -> dict | None:
    """The case asserted by `compare_strings(...) == expected` or
    `int(verify(parse(gold), parse(pred))) == expected`, or None for any other assert."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return None
    call, expected = test.left, _value(test.comparators[0], params)
    if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "int":
        call = call.args[0]
    name = getattr(call.func, "id", "") if isinstance(call, ast.Call) else ""
    if name == "compare_strings":
        options = dict(COMPARE_DEFAULTS)
        options.update({k.arg: _value(k.value, params) for k in call.keywords})
        gold, pred = (_value(a, params) for a in call.args[:2])
        return {"gold": gold, "pred": pred, "expected": bool(expected),
                "targets": [{"latex": "latex_boxed_first", "expr": "expr"}[t]
                            for t in options["match_types"]],
                "float_rounding": options["precision"], "strict": options["strict"],
                "allow_set_relation_comp": options["allow_set_relation_comp"]}
    if name == "verify" and all(getattr(a.func, "id", "") == "parse" and len(a.args) == 1
                                and not a.keywords for a in call.args[:2]):
        gold, pred = (_value(a.args[0], params) for a in call.args[:2])
        return {"gold": gold, "pred": pred, "expected": bool(expected),
                "targets": ["latex_default", "expr"], "float_rounding": 6, "strict": True,
                "allow_set_relation_comp": False}
    return None


def extract_cases(repo: Path, commit: str) -> dict:
    """The gold/prediction cases of Math-Verify's tests at `commit` of the git repository `repo`,
    with the tests that are not such pairs counted by file."""
    cases, other = [], collections.Counter()
    for path in TEST_FILES:
        source = subprocess.run(["git", "-C", str(repo), "show", f"{commit}:{path}"], check=True,
                                capture_output=True, text=True).stdout
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
    return {"source": {"repository": REPOSITORY, "commit": commit, "paths": list(TEST_FILES),
                       "license": "Apache-2.0 (Math-Verify's LICENCE)"},
            "not_pairs": dict(other), "cases": cases}


# --------------------------------------------------------------------------------------------
# Running the cases
# --------------------------------------------------------------------------------------------


def _targets(names: list[str]) -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    configs = {"latex_boxed_first": LatexExtractionConfig(boxed_match_priority=0),
               "latex_default": LatexExtractionConfig(), "expr": ExprExtractionConfig()}
    return tuple(configs[name] for name in names)


def score_cases(cases: list[dict], *, defaults: bool = False) -> list[dict]:
    """Each case with the verifier's `outcome` and `reason` added: set up as the case is, or
    with the verifier's default extraction (`defaults=True`; targets and options still the
    case's)."""
    from posttrain.verifiers.math_answer import DEFAULT_EXTRACT, MathAnswerVerifier

    scored = []
    for case in cases:
        verifier = MathAnswerVerifier(
            extract=DEFAULT_EXTRACT if defaults else "anywhere", targets=_targets(case["targets"]),
            float_rounding=case["float_rounding"], strict=case["strict"],
            allow_set_relation_comp=case["allow_set_relation_comp"])
        result = verifier(case["pred"], {"answer": case["gold"]})
        scored.append({**case, "outcome": result.outcome.value, "reason": result.reason})
    return scored


def summarize(scored: list[dict]) -> dict:
    """Counts: cases, agree, false positives (ok where "not equal" is expected), false
    negatives (anything else where "equal" is expected), and outcomes."""
    fp = [c for c in scored if c["outcome"] == "ok" and not c["expected"]]
    fn = [c for c in scored if c["outcome"] != "ok" and c["expected"]]
    return {"cases": len(scored), "agree": len(scored) - len(fp) - len(fn),
            "false_positives": len(fp), "false_negatives": len(fn),
            "outcomes": dict(collections.Counter(c["outcome"] for c in scored)),
            "disagreements": fp + fn}


def load_cases(path: Path = DATA) -> dict:
    """The JSON data file written by `--extract`."""
    return json.loads(path.read_text())


# Why a case scored differently from its published expectation does so, by case id.
WHY: dict[str, str] = {}


def _default_gap(case: dict) -> str:
    """Why the verifier's defaults decline a case that math-verify's search accepts."""
    if case["outcome"] == "format_error" and case["reason"].startswith("no answer found"):
        return ("prose with no `\\boxed{}`, no answer marker (\"answer is\", \"answer:\") and "
                "not only an answer: the defaults do not search prose for the last span or number")
    if case["outcome"] == "format_error":
        return "the marker's sentence holds nothing math-verify's answer-anchored patterns read"
    return ("the last boxed answer is not the one expected: words between boxes (\"for part (a) "
            "and\", \"y_2 =\"), or a last box after the stated final answer")


def previous_verifier(ref: str):
    """`MathAnswerVerifier()` of verifiers/math_answer.py at git `ref` of this checkout, loaded
    as a separate module (not registered), to measure an earlier version on the same cases."""
    import types

    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:verifiers/math_answer.py"],
                            check=True, capture_output=True, text=True).stdout
    source = source.replace("register_verifier(\"math_answer\")", "(lambda cls: cls)")
    module = types.ModuleType(f"math_answer_at_{ref}")
    exec(compile(source, f"{ref}:verifiers/math_answer.py", "exec"), module.__dict__)
    return module.MathAnswerVerifier()


def score_with(verifier, cases: list[dict]) -> list[dict]:
    """Each case with `outcome` from one fixed `verifier` (a raise counts as error)."""
    scored = []
    for case in cases:
        try:
            outcome = verifier(case["pred"], {"answer": case["gold"]}).outcome.value
        except Exception:   # noqa: BLE001 - recorded as the outcome a runner would give
            outcome = "error"
        scored.append({**case, "outcome": outcome, "reason": ""})
    return scored


def _row(name: str, run: dict) -> str:
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(run["outcomes"].items()))
    return (f"| {name} | {run['cases']} | {run['agree']} | {100 * run['agree'] / run['cases']:.1f}% "
            f"| {run['false_positives']} | {run['false_negatives']} | {outcomes} |")


def _report(data: dict, runs: dict, seconds: float, previous: str | None) -> str:
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
        "`allow_set_relation_comp`); with `extract=\"anywhere\"` the prediction is searched by "
        "math-verify as in the tests, and the gold is read by the verifier's reference rule.",
        "",
        "Agreement: outcome ok exactly when the case expects equal. False positive: ok where the "
        "case expects not equal (a reward for a wrong answer). False negative: any other outcome "
        "where it expects equal.",
        "",
        "Command: `python benchmarks/math_verify_agreement.py"
        + (f" --previous {previous}`" if previous else "`")
        + f" (math-verify 0.9.0, latex2sympy2_extended 1.11.0, antlr4-python3-runtime 4.9.3; "
        f"{seconds:.0f} s on 2 shared cores).",
        "",
        "| verifier | cases | agree | agreement | false positives | false negatives | outcomes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        lines.append(_row(name, run))
    case_run, default_run = list(runs.values())[:2]
    lines += ["", "## Disagreements, set up as each case", ""]
    for case in case_run["disagreements"]:
        kind = "false positive" if case["outcome"] == "ok" else "false negative"
        lines.append(f"- `{case['id']}` (line {case['line']}), {kind}, outcome "
                     f"{case['outcome']}: {WHY.get(case['id'], 'not explained yet')}.")
    if not case_run["disagreements"]:
        lines.append(
            "None. Without the verifier's fix for LaTeX percentages (latex2sympy2_extended's "
            "parser for antlr4 4.9.3 lacks `AtomContext.FUNC_GAMMA`, so `28\\%` raised inside "
            "math-verify) one case failed: `tests/test_all.py::test_latex_notation_math[2]` "
            "(gold \"... $28 \\%$\", prediction `\\boxed{28\\%}`), which math-verify itself then "
            "also fails.")
    gaps = collections.defaultdict(list)
    for case in default_run["disagreements"]:
        gaps[_default_gap(case)].append(case["id"].split("::")[1])
    lines += ["", "## Where the defaults decline (all false negatives, no false positive)", "",
              "The defaults take the answer only from a box, an answer marker or a completion "
              "that is only an answer, so prose that states an answer in passing gets "
              "format_error instead of math-verify's last-span or last-number guess:", ""]
    for why, ids in sorted(gaps.items(), key=lambda item: -len(item[1])):
        lines.append(f"- {len(ids)}: {why}: {', '.join(f'`{i}`' for i in ids)}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--extract", type=Path, help="a Math-Verify git repository: rewrite the "
                        "data file from its tests")
    parser.add_argument("--commit", default="HEAD", help="the commit to read (with --extract)")
    parser.add_argument("--doc", type=Path, default=DOC, help="where to write the report")
    parser.add_argument("--previous", metavar="REF", help="also score verifiers/math_answer.py "
                        "as it was at this git ref of the checkout (its defaults)")
    args = parser.parse_args(argv)
    if args.extract:
        commit = subprocess.run(["git", "-C", str(args.extract), "rev-parse", args.commit],
                                check=True, capture_output=True, text=True).stdout.strip()
        data = extract_cases(args.extract, commit)
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {len(data['cases'])} cases to {DATA}")
        return
    data = load_cases()
    start = time.monotonic()
    runs = {"MathAnswerVerifier set up as each case (`extract=\"anywhere\"`)":
            summarize(score_cases(data["cases"])),
            "MathAnswerVerifier defaults (`extract=(\"boxed\", \"marker\", \"whole\")`)":
            summarize(score_cases(data["cases"], defaults=True))}
    if args.previous:
        runs[f"previous verifier at `{args.previous}` (exact rationals, last-number fallback)"] = \
            summarize(score_with(previous_verifier(args.previous), data["cases"]))
    seconds = time.monotonic() - start
    report = _report(data, runs, seconds, args.previous)
    args.doc.write_text(report)
    print(report)


if __name__ == "__main__":
    sys.exit(main())
