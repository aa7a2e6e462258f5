"""Benchmark scripts are shipped artifacts: each parses its options (imports resolve)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))


def test_benchmarks_found():
    assert {"generation", "sft_throughput", "grpo_step"} <= {p.stem for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_help(script):
    proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout.lower()
