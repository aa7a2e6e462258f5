"""Refactoring guard: every recipe preset at tiny size gives the same run as before.

`tests/fixtures/refactor_guard.json` holds, per case of `tests/refactor_guard.py` (SFT, CPT,
DPO, IPO, SimPO, KTO, ORPO, reward model, GRPO, PPO), the per-step metrics of every training
stage, sha256 of the saved weights and evaluation tables, and results.json without timings. It
was recorded from the code before the move into layered subpackages; this is the one place where
pinned values come from the code itself. A deliberate change of behaviour re-records it:

    for c in sft cpt ...; do python tests/refactor_guard.py $c /tmp/run-$c; done

The cases run one after the other in one fresh process with one thread and AVX2 kernels
(`guard_env`). Even so, two
x86 CPUs can round a few floats differently (differences of ~1e-7 in a loss were seen between
machines; a ppo_kl of 1.5e-7 against 0.0), so metrics and results are compared to a relative
tolerance of 1e-5 and an absolute one of 1e-6; when every float is bitwise equal (the arithmetic of
the recording machine), the sha256 of the weights and evaluation tables must match too, otherwise
they are not comparable and only the numbers are.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parents[1]  # tests/: refactor_guard.py and fixtures/
sys.path.insert(0, str(HERE))
from refactor_guard import CASES, guard_env  # noqa: E402

EXPECTED = json.loads((HERE / "fixtures" / "refactor_guard.json").read_text())


def _has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _first_difference(got, want, path="") -> str:
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(set(want) | set(got)):
            if key not in got or key not in want:
                return f"{path}/{key}: only in {'fixture' if key in want else 'this run'}"
            if got[key] != want[key]:
                return _first_difference(got[key], want[key], f"{path}/{key}")
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                return _first_difference(g, w, f"{path}[{i}]")
    return f"{path}: got {got!r}, recorded {want!r}"


REL_TOL, ABS_TOL = 1e-5, 1e-6


def _close_difference(got, want, path="") -> tuple[str | None, bool]:
    """(first difference beyond tolerance or None, whether every value is bitwise equal)."""
    if isinstance(want, dict) and isinstance(got, dict):
        exact = True
        for key in sorted(set(want) | set(got)):
            if key not in got or key not in want:
                return f"{path}/{key}: only in {'fixture' if key in want else 'this run'}", False
            diff, same = _close_difference(got[key], want[key], f"{path}/{key}")
            if diff:
                return diff, False
            exact &= same
        return None, exact
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        exact = True
        for i, (g, w) in enumerate(zip(got, want)):
            diff, same = _close_difference(g, w, f"{path}[{i}]")
            if diff:
                return diff, False
            exact &= same
        return None, exact
    numbers = (int, float)
    if (
        isinstance(got, numbers)
        and isinstance(want, numbers)
        and not isinstance(got, bool)
        and not isinstance(want, bool)
    ):
        if got == want or (math.isnan(got) and math.isnan(want)):
            return None, True
        if math.isclose(got, want, rel_tol=REL_TOL, abs_tol=ABS_TOL):
            return None, False
    elif got == want and isinstance(got, bool) == isinstance(want, bool):
        return None, True
    return f"{path}: got {got!r}, recorded {want!r}", False


def test_close_difference_rules():
    assert _close_difference({"a": [1.0, 2.0]}, {"a": [1.0, 2.0]}) == (None, True)
    assert _close_difference({"a": 1.0000001}, {"a": 1.0}) == (None, False)
    assert _close_difference({"a": 1.001}, {"a": 1.0})[0] == "/a: got 1.001, recorded 1.0"
    assert _close_difference({"a": "x"}, {"a": "y"})[0] is not None
    assert _close_difference({"a": 1}, {"b": 1})[0] == "/a: only in this run"
    assert _close_difference([True], [1.0])[0] is not None


def test_every_case_is_recorded():
    assert set(EXPECTED) == set(CASES)


@pytest.fixture(scope="module")
def fingerprints(tmp_path_factory) -> dict[str, dict | str]:
    """Every case's fingerprint, all cases run one after the other in one fresh process (the
    stack imports once: ~45 s for the ten instead of ~150 s in ten processes; a case's
    fingerprint is the same either way). A case the process did not reach maps to its stderr."""
    root = tmp_path_factory.mktemp("refactor_guard") / "runs"
    proc = subprocess.run(
        [sys.executable, str(HERE / "refactor_guard.py"), ",".join(sorted(CASES)), str(root)],
        env=guard_env(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    found: dict[str, dict | str] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("FINGERPRINT "):
            case, data = line.removeprefix("FINGERPRINT ").split(" ", 1)
            found[case] = json.loads(data)
    failure = f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    return {case: found.get(case, failure) for case in CASES}


@pytest.mark.slow
@pytest.mark.skipif(
    not _has_avx2(), reason="the recorded floats come from AVX2 kernels; this CPU has none"
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_preset_run_is_bitwise_unchanged(case, fingerprints):
    got = fingerprints[case]
    assert isinstance(got, dict), f"{case} did not run: {got}"
    want = EXPECTED[case]
    numbers = {k: want[k] for k in ("metrics", "results")}
    diff, exact = _close_difference({k: got.get(k) for k in numbers}, numbers)
    assert diff is None, f"{case} changed: {diff}"
    if exact:  # the recording machine's arithmetic: the files must be the same bytes too
        assert got == want, f"{case} changed: {_first_difference(got, want)}"
