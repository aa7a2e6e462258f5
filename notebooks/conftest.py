"""How the tutorials run as tests: nbval executes each notebook, one test per cell (pyproject's
pytest options). A notebook that needs a component the project installs apart (vLLM's own venv)
says so in its metadata,

    "metadata": {"posttrain": {"requires": ["vllm"]}, ...}

and where the component is missing every cell of it is skipped with the component's reason
(collected, not run: no kernel starts), instead of failing, or falling back to something else
and passing without showing what it teaches. `REQUIREMENTS` maps each name to the function that
says why the component is missing (None when it is there); a name it does not know fails the
collection of that notebook with the known names listed.

A cell that teaches with a plot carries the cell tag `shows-figure` (`FIGURE_TAG`, in the cell's
`metadata.tags`): its test fails unless the cell displayed an image (image/png), as a figure that
is the cell's value, through `display(fig)` or `plt.show()`. nbval compares no image and, under
--nbval-lax, no output of an unmarked cell, so a plot that renders nothing (after something
switched matplotlib's backend in the kernel) would otherwise pass.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest


def _vllm_missing() -> str | None:
    from posttrain.policy.vllm_process import vllm_unavailable_reason

    return vllm_unavailable_reason()


REQUIREMENTS: dict[str, Callable[[], str | None]] = {"vllm": _vllm_missing}
"""Requirement name -> why it is missing here (None: present)."""


def notebook_requirements(path: str | os.PathLike) -> list[str]:
    """The names in the notebook's `metadata.posttrain.requires` (none: []).

    Raises:
        ValueError: a name `REQUIREMENTS` does not know, or `requires` not a list of names.
    """
    meta = json.loads(Path(path).read_text(encoding="utf-8")).get("metadata", {})
    names = meta.get("posttrain", {}).get("requires", [])
    known = sorted(REQUIREMENTS)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"{Path(path).name}: metadata.posttrain.requires={names!r}; must be a list of "
            f"names from: {', '.join(known)}"
        )
    unknown = [n for n in names if n not in REQUIREMENTS]
    if unknown:
        raise ValueError(
            f"{Path(path).name}: metadata.posttrain.requires names {unknown}; known "
            f"requirements: {', '.join(known)}"
        )
    return names


def unmet_reason(path: str | os.PathLike) -> str | None:
    """Why the notebook at `path` cannot run here (its first missing requirement, named), or
    None when everything it requires is present."""
    for name in notebook_requirements(path):
        reason = REQUIREMENTS[name]()
        if reason is not None:
            return f"{Path(path).name} requires {name}: {reason}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons: dict[Path, str | None] = {}
    for item in items:
        path = Path(str(item.path))
        if path.suffix != ".ipynb":
            continue
        if path not in reasons:
            reasons[path] = unmet_reason(path)
        if reasons[path] is not None:
            item.add_marker(pytest.mark.skip(reason=reasons[path]))


FIGURE_TAG = "shows-figure"
"""Cell tag: the cell must display at least one image/png output."""


def missing_figure(tags: Sequence[str], outputs: Sequence[dict[str, Any]]) -> str | None:
    """Why a cell tagged `FIGURE_TAG` failed to show a figure (None: untagged, or it displayed
    one). `outputs` are the cell's nbformat outputs (dicts with output_type and data)."""
    if FIGURE_TAG not in tags:
        return None
    kinds = [o.get("output_type") for o in outputs]
    if any(
        o.get("output_type") in ("display_data", "execute_result")
        and "image/png" in o.get("data", {})
        for o in outputs
    ):
        return None
    return (
        f"the cell is tagged {FIGURE_TAG!r} but displayed no image/png (outputs: {kinds}); "
        "is matplotlib's backend still the inline one?"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield  # nbval ran the cell (a failure already raised)
    cell = getattr(item, "cell", None)  # nbval's IPyNbCell
    if cell is not None:
        reason = missing_figure(cell.metadata.get("tags", []), item.test_outputs or [])
        if reason is not None:
            pytest.fail(f"{item.name}: {reason}", pytrace=False)
    return result
