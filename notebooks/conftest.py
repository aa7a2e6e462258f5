"""How the tutorials run as tests: nbval executes each notebook, one test per cell (pyproject's
pytest options). A notebook that needs a component the project installs apart (vLLM's own venv)
says so in its metadata,

    "metadata": {"posttrain": {"requires": ["vllm"]}, ...}

and where the component is missing every cell of it is skipped with the component's reason
(collected, not run: no kernel starts), instead of failing, or falling back to something else
and passing without showing what it teaches. `REQUIREMENTS` maps each name to the function that
says why the component is missing (None when it is there); a name it does not know fails the
collection of that notebook with the known names listed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

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
