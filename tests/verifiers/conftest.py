"""Fixtures of the verifier tests: `box`, one sandbox shared by a module's tests; `problems`, the
164 HumanEval problems (test_humaneval.py, test_humaneval_mutants.py)."""

from __future__ import annotations

import pytest

from posttrain.verifiers.humaneval import humaneval_problems
from posttrain.verifiers.sandbox import Sandbox, SandboxLimits, sandbox_available


@pytest.fixture(scope="module")
def box() -> Sandbox:
    """A sandbox whose wall-clock limit (60 s) a program that should finish never reaches, even
    on a loaded machine; tests of the limits pass their own."""
    reason = sandbox_available()
    if reason is not None:
        pytest.skip(f"no sandbox here: {reason}")
    return Sandbox(SandboxLimits(cpu_s=5.0, wall_s=60.0))


@pytest.fixture(scope="module")
def problems() -> list[dict]:
    return humaneval_problems()
