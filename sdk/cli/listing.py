"""What the command line lists without running anything: `posttrain ls` (the recipes and the
presets, each with its one-line description, read from the files' text: nothing is imported),
`posttrain runs` (the table of `posttrain.workflows.run_table.run_rows`, printed without
pandas) and the run a name stands for (`find_run`: `posttrain resume` and `posttrain rerun`).

Everything here reads files only, so these commands load neither torch nor pandas.

Example:
    >>> first_sentence("SFT and CPT of a policy. Run: posttrain run sft.")
    'SFT and CPT of a policy.'
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DESCRIPTION_CHARS",
    "CELL_CHARS",
    "first_sentence",
    "recipe_description",
    "preset_description",
    "listing",
    "format_rows",
    "find_run",
]

DESCRIPTION_CHARS = 100
"""Longest description `posttrain ls` shows (a longer one is cut, ending in "...")."""
CELL_CHARS = 60
"""Widest cell of the `posttrain runs` table (a longer one is cut, ending in "...")."""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


_SENTENCE_END = re.compile(r"(?<!\bal)(?<!\be\.g)(?<!\bi\.e)\.\s+(?=[A-Z`(])")
"""A full stop that ends a sentence: followed by a capital (not "et al. 2023", "e.g. x")."""


def first_sentence(text: str, limit: int = DESCRIPTION_CHARS) -> str:
    """The first sentence of `text` (up to the first full stop followed by a capital, or the
    first blank line), on one line, cut to `limit` characters."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    end = _SENTENCE_END.search(paragraph)
    return _cut(paragraph if end is None else paragraph[: end.start() + 1], limit)


def recipe_description(path: Path) -> str:
    """The first sentence of recipe file `path`'s module docstring ("" without one; the file
    is parsed, not imported)."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError, ValueError):
        return ""
    return first_sentence(doc or "")


def preset_description(path: Path) -> tuple[str | None, str]:
    """(recipe, description) of preset file `path`: the recipe its first comment names
    (`# recipe: sft`, None without one) and the first sentence of the comment lines after it."""
    recipe: str | None = None
    lines: list[str] = []
    try:
        text = path.read_text()
    except OSError:
        return None, ""
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        body = line.lstrip("#").strip()
        if recipe is None and not lines and body.startswith("recipe:"):
            recipe = body.removeprefix("recipe:").strip() or None
        else:
            lines.append(body)
    return recipe, first_sentence(" ".join(lines))


def listing(recipes: dict[str, Path], presets: dict[str, Path]) -> str:
    """The text `posttrain ls` prints: the recipes (name, description) and the presets (name,
    recipe, description), one per line."""
    out = ["recipes (posttrain run NAME [key=value ...]):"]
    width = max((len(n) for n in recipes), default=0)
    out += [f"  {n.ljust(width)}  {recipe_description(p)}".rstrip() for n, p in recipes.items()]
    out.append("presets (posttrain run RECIPE --config NAME [key=value ...]):")
    described = {n: preset_description(p) for n, p in presets.items()}
    width = max((len(n) for n in presets), default=0)
    rwidth = max((len(r or "") for r, _ in described.values()), default=0)
    out += [
        f"  {n.ljust(width)}  {(r or '').ljust(rwidth)}  {d}".rstrip()
        for n, (r, d) in described.items()
    ]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return _cut(" ".join(str(value).split()), CELL_CHARS)


def format_rows(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """`rows` as a plain-text table: a header, then one line per row, each column as wide as
    its widest cell; an empty value shows as "-", a float with 4 significant digits, a cell
    longer than `CELL_CHARS` is cut."""
    cells = [list(columns)] + [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def find_run(name: str, root: str | os.PathLike = "runs") -> str:
    """The run folder `name` stands for: a folder path (as `posttrain runs` lists it:
    `runs/a`), or a run's name under `root` (`a` for `runs/a`).

    Raises:
        ValueError: naming `name` and listing the runs under `root`, if neither exists.
    """
    for candidate in (Path(name), Path(root) / name):
        if candidate.is_dir():
            return str(candidate)
    from posttrain.workflows.run_table import find_runs

    runs = [str(p) for p in find_runs(root)] if Path(root).is_dir() else []
    shown = ", ".join(runs[:10]) + (f" and {len(runs) - 10} more" if len(runs) > 10 else "")
    raise ValueError(
        f"unknown run {name!r}: no such folder"
        + (f"; the runs under {root}: {shown}" if runs else f", and no runs under ./{root}")
    )
