"""Refactoring guard: every recipe preset at tiny size gives bitwise the same run as before.

`tests/fixtures/refactor_guard.json` holds, per case of `tests/refactor_guard.py` (SFT, CPT,
DPO, IPO, SimPO, KTO, ORPO, reward model, GRPO, PPO), the per-step metrics of every training
stage, sha256 of the saved weights and evaluation tables, and results.json without timings. It
was recorded from the code before the move into layered subpackages; this is the one place where
pinned values come from the code itself. A deliberate change of behaviour re-records it:

    for c in sft cpt ...; do python tests/refactor_guard.py $c /tmp/run-$c; done

Each case runs in a fresh process with one thread and AVX2 kernels (`guard_env`), so that the
floats do not depend on which x86 CPU runs the test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
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


def test_every_case_is_recorded():
    assert set(EXPECTED) == set(CASES)


@pytest.mark.slow
@pytest.mark.skipif(not _has_avx2(), reason="the recorded floats come from AVX2 kernels; this CPU has none")
@pytest.mark.parametrize("case", sorted(CASES))
def test_preset_run_is_bitwise_unchanged(case, tmp_path):
    proc = subprocess.run([sys.executable, str(HERE / "refactor_guard.py"), case, str(tmp_path / "run")],
                          env=guard_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("FINGERPRINT "))
    got = json.loads(line.removeprefix("FINGERPRINT "))
    want = EXPECTED[case]
    assert got == want, f"{case} changed: {_first_difference(got, want)}"
