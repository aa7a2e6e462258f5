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


def test_grpo_vs_trl_quick_compares_both_trainers_on_one_scorer():
    """The side-by-side runs end to end at tiny size: both trainers train from the same SFT
    start and are scored by the same held-out evaluation (nothing is written with --quick)."""
    pytest.importorskip("trl")
    script = next(p for p in SCRIPTS if p.stem == "grpo_vs_trl")
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    names = [row.split("|")[1].strip() for row in rows]
    assert {"SFT start", "posttrain GRPO", "TRL GRPO"} <= set(names)
    assert "TRL GRPO minus posttrain GRPO" in names
    assert "nan" not in proc.stdout.lower()


def test_generation_grouped_tiny_matches_transformers_tokens(tmp_path):
    """A G=4 run at tiny size: Policy.generate(prompts, n=4) with a shared prefill produces the
    same greedy tokens as transformers generate on the 4 copies (the script exits 1 otherwise)."""
    script = next(p for p in SCRIPTS if p.stem == "generation")
    proc = subprocess.run([sys.executable, str(script), "--batch", "8", "--group-size", "4",
                           "--prompt-len", "8", "--new-tokens", "4", "--reps", "1",
                           "--threads", "1", "--out", str(tmp_path / "gen")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Greedy tokens identical across the three methods: True" in proc.stdout
    assert "(2 prompts x G=4 samples)" in proc.stdout
