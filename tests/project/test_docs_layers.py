"""The layer map in the docs is the layer rule's own table: docs/design/architecture.md's diagram
names every layer of `LAYERS` (tests/project/test_layers.py) from the top down, and
docs/design/module_map.md lists every posttrain module once, under its own layer, with a purpose.
A module added, moved or removed without its line in the map fails here, naming the module, its
layer and the first line of its docstring to start the line from.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from test_layers import LAYERS, MODULES, layer

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "design" / "architecture.md"
MODULE_MAP = ROOT / "docs" / "design" / "module_map.md"
# The layer of the package itself ("") is headed by its name in the map.
_HEADING = {name: name or "posttrain" for name in LAYERS}


def map_sections(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """The module map's `## layer` sections in order, each with its (module, purpose) rows.

    >>> text = "# M\\n## core\\n| module | purpose |\\n|---|---|\\n"
    >>> map_sections(text + "| `posttrain.core` | base |\\n")
    [('core', [('posttrain.core', 'base')])]
    """
    sections: list[tuple[str, list[tuple[str, str]]]] = []
    for line in text.splitlines():
        heading = re.match(r"## (\S+)\s*$", line)
        if heading:
            sections.append((heading.group(1), []))
            continue
        row = re.match(r"\|\s*`([\w.]+)`\s*\|(.*)\|\s*$", line)
        if row and sections:
            sections[-1][1].append((row.group(1), row.group(2).strip()))
    return sections


def diagram_layers(text: str) -> list[str]:
    """Layer names that begin the rows of the first diagram under the architecture's layer
    heading, top to bottom (a row: two spaces, the name, two or more spaces, its summary)."""
    section = text.split("## Layers and how data flows through them", 1)[1]
    block = section.split("```", 2)[1]
    return [m.group(1) for m in re.finditer(r"^  ([a-z]+) {2,}\S", block, re.M)]


def _first_line(module: str) -> str:
    doc = ast.get_docstring(ast.parse(MODULES[module].read_text())) or "(no docstring)"
    return " ".join(doc.split("\n\n")[0].split())[:100]


def map_problems(text: str) -> list[str]:
    """What in module-map `text` disagrees with the modules and `LAYERS`; empty when it agrees."""
    sections = map_sections(text)
    headings = [name for name, _ in sections]
    expected = [_HEADING[name] for name in LAYERS]
    problems = (
        []
        if headings == expected
        else [f"the sections are {headings}; the layers, lowest first, are {expected}"]
    )
    listed: set[str] = set()
    for heading, rows in sections:
        for module, purpose in rows:
            if module in listed:
                problems.append(f"{module} is listed twice")
            listed.add(module)
            if module not in MODULES:
                problems.append(f"{module} (under {heading}) is not a posttrain module")
            elif _HEADING[layer(module)] != heading:
                problems.append(
                    f"{module} is under {heading}, its layer is {_HEADING[layer(module)]}"
                )
            if not purpose.strip(" |"):
                problems.append(f"{module} has no purpose")
    problems += [
        f"missing under {_HEADING[layer(m)]}: | `{m}` | {_first_line(m)} |"
        for m in sorted(MODULES)
        if m not in listed
    ]
    return problems


def test_the_module_map_lists_every_module_once_under_its_layer():
    problems = map_problems(MODULE_MAP.read_text(encoding="utf-8"))
    assert not problems, (
        "docs/design/module_map.md does not match the modules (a missing row "
        "shows its docstring's first line to start from):\n" + "\n".join(problems)
    )


def test_the_architecture_diagram_names_every_layer_from_the_top():
    # posttrain itself and the cli stand on everything: the diagram's top line names them.
    layers = [name for name in reversed(LAYERS) if name not in ("", "cli")]
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert diagram_layers(text) == layers, (
        f"docs/design/architecture.md's layer diagram rows are {diagram_layers(text)}; "
        f"LAYERS in tests/project/test_layers.py, highest first, are {layers}"
    )
    top = text.split("## Layers and how data flows through them", 1)[1].split("```", 2)[1]
    assert "posttrain.cli" in top and "posttrain (lazy names)" in top


def test_the_map_checks_catch_a_wrong_missing_misplaced_and_doubled_module():
    assert diagram_layers(
        "## Layers and how data flows through them\n\n```\n  top line\n"
        "  rl          the RL loop\n              more words\n"
        "  core        base\n```\n"
    ) == ["rl", "core"]
    text = MODULE_MAP.read_text(encoding="utf-8")
    base = map_problems(text)

    def new_problems(changed: str) -> list[str]:
        return [p for p in map_problems(changed) if p not in base]

    renamed = text.replace("| `posttrain.rl.trainer` |", "| `posttrain.rl.trainers` |")
    assert new_problems(renamed) == [
        "posttrain.rl.trainers (under rl) is not a posttrain module",
        "missing under rl: | `posttrain.rl.trainer` | "
        + _first_line("posttrain.rl.trainer")
        + " |",
    ]
    row = next(line for line in text.splitlines() if line.startswith("| `posttrain.core.masked` |"))
    moved = text.replace(row + "\n", "").replace(
        "| `posttrain.rl.trainer` |", row + "\n| `posttrain.rl.trainer` |"
    )
    assert new_problems(moved) == ["posttrain.core.masked is under rl, its layer is core"]
    assert new_problems(text.replace(row, row + "\n" + row)) == [
        "posttrain.core.masked is listed twice"
    ]
    assert new_problems(text.replace("## rl\n", "## rl_\n"))[0].startswith("the sections are [")


def test_doctests():
    import doctest
    import sys

    result = doctest.testmod(sys.modules[__name__])
    assert result.attempted >= 1 and not result.failed
