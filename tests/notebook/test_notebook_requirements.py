"""A tutorial that needs an optional component (notebooks/conftest.py: `metadata.posttrain.
requires`) is skipped with the component's reason where it is missing, and only then."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _waits import WAIT_S

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _hooks():
    """notebooks/conftest.py as a module of its own name (pytest registers it as "conftest")."""
    spec = importlib.util.spec_from_file_location("notebook_hooks", NOTEBOOKS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _notebook(path: Path, requires, source: str = "assert False, 'ran'") -> Path:
    meta = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    if requires is not None:
        meta["posttrain"] = {"requires": requires}
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
            "source": source}  # fmt: skip
    path.write_text(json.dumps({"cells": [cell], "metadata": meta, "nbformat": 4,
                                "nbformat_minor": 5}))  # fmt: skip
    return path


def test_every_tutorial_names_known_requirements_and_the_vllm_one_requires_vllm():
    hooks = _hooks()
    needs = {p.name: hooks.notebook_requirements(p) for p in sorted(NOTEBOOKS.glob("*.ipynb"))}
    assert needs["10_vllm_rollouts.ipynb"] == ["vllm"]
    assert needs["02_grpo_reasoning.ipynb"] == []


def test_unmet_reason_names_the_notebook_and_the_component(tmp_path, monkeypatch):
    hooks = _hooks()
    nb = _notebook(tmp_path / "needs.ipynb", ["vllm"])
    monkeypatch.setitem(hooks.REQUIREMENTS, "vllm", lambda: "no venv at /x (run vllm-up.sh)")
    assert hooks.unmet_reason(nb) == "needs.ipynb requires vllm: no venv at /x (run vllm-up.sh)"
    monkeypatch.setitem(hooks.REQUIREMENTS, "vllm", lambda: None)
    assert hooks.unmet_reason(nb) is None
    assert hooks.unmet_reason(_notebook(tmp_path / "plain.ipynb", None)) is None


@pytest.mark.parametrize("requires", [["vlm"], "vllm", [1]])
def test_an_unknown_or_malformed_requirement_is_refused_with_the_known_names(tmp_path, requires):
    nb = _notebook(tmp_path / "bad.ipynb", requires)
    with pytest.raises(ValueError, match=r"bad.ipynb: metadata.posttrain.requires.*vllm"):
        _hooks().notebook_requirements(nb)


def test_nbval_skips_every_cell_of_a_notebook_whose_requirement_is_missing(tmp_path):
    """pytest with nbval on a notebook that requires vllm while the vLLM venv is missing
    ($POSTTRAIN_VLLM_VENV points nowhere): its cell (which would fail) is skipped, the reason
    names the requirement, and no kernel starts (a kernel start would need ipykernel's
    connection files; the cell's `assert False` would fail it)."""
    shutil.copy(NOTEBOOKS / "conftest.py", tmp_path / "conftest.py")
    _notebook(tmp_path / "needs_vllm.ipynb", ["vllm"])
    env = {**os.environ, "POSTTRAIN_VLLM_VENV": str(tmp_path / "no-venv")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--nbval-lax",
         "needs_vllm.ipynb"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=WAIT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 skipped" in proc.stdout and "passed" not in proc.stdout, proc.stdout[-3000:]
    assert "needs_vllm.ipynb requires vllm:" in proc.stdout, proc.stdout[-3000:]
