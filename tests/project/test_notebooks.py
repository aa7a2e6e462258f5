"""Conventions of the tutorials in notebooks/.

Executing them is nbval's job: pyproject's pytest options put `notebooks` in `testpaths` and run
it with `--nbval-lax --nbval-current-env`, one test per cell. These checks keep the files
themselves in shape: stored without outputs (small diffs, nothing machine-specific committed),
in the "python3" kernel, opening with a title that says what they teach and how long they take,
and asserting their outcomes (a notebook without an assert cannot fail when it goes wrong).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_are_collected_by_pytest_with_nbval():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "notebooks" in options["testpaths"]
    assert {"--nbval-lax", "--nbval-current-env"} <= set(options["addopts"].split())
    assert len(NOTEBOOKS) >= 4


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_conventions(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    title = nb.cells[0]
    assert title.cell_type == "markdown" and title.source.startswith("# "), (
        f"{path.name}: the first cell must be a markdown title"
    )
    assert "Expected runtime" in title.source, f"{path.name}: say the expected runtime up front"
    code = [c for c in nb.cells if c.cell_type == "code"]
    with_outputs = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
    ]
    assert not with_outputs, (
        f"{path.name}: cells {with_outputs} hold outputs; clear them: "
        f".venv/bin/jupyter nbconvert --clear-output --inplace {path}"
    )
    assert any("assert " in c.source for c in code), f"{path.name} asserts nothing"
