"""Figures outside pyplot (`posttrain.core.figures`), and the rule that keeps matplotlib's
backend alone: no module of posttrain (sdk/, envs/, verifiers/) nor a recipe imports pyplot or
switches the backend (read with `ast`, imports inside functions included)."""

from __future__ import annotations

import ast
import io
from pathlib import Path

from _figure_helpers import pyplot_untouched

from posttrain.core.figures import figure_png, new_figure

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("sdk", "envs", "verifiers", "recipes")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(png: bytes) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (bytes 16-24, big-endian)."""
    assert png[:8] == PNG_SIGNATURE
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def global_matplotlib_uses(source: str) -> list[str]:
    """What in `source` touches matplotlib's global state: an import of pyplot, pylab or
    `matplotlib.use`, or a call of `.use(...)` / `.switch_backend(...)` on matplotlib (under any
    alias), one line each with its line number, in source order."""
    tree = ast.parse(source)
    aliases = {"matplotlib"} | {
        a.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for a in node.names
        if a.name.startswith("matplotlib") and a.asname
    }
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        found += [
            (node.lineno, f"line {node.lineno}: import {n}")
            for n in names
            if n.startswith(("matplotlib.pyplot", "matplotlib.pylab", "pylab"))
            or n == "matplotlib.use"
        ]
        call = node.func if isinstance(node, ast.Call) else None
        if (
            isinstance(call, ast.Attribute)
            and call.attr in ("use", "switch_backend")
            and ast.unparse(call.value).split(".")[0] in aliases
        ):
            found.append((node.lineno, f"line {node.lineno}: {ast.unparse(call)}()"))
    return [text for _, text in sorted(found)]


def test_the_scan_finds_each_kind_of_global_use():
    source = (
        "import matplotlib\n"
        "def f():\n"
        "    matplotlib.use('Agg')\n"
        "    import matplotlib.pyplot as plt\n"
        "    from matplotlib import pyplot\n"
        "    matplotlib.pyplot.switch_backend('agg')\n"
        "    import matplotlib as mpl\n"
        "    mpl.use('Agg')\n"
        "    from matplotlib import use\n"
        "    from matplotlib.figure import Figure\n"
        "    Figure().savefig('x.png')\n"
        "    pool.use(3)\n"
    )
    assert global_matplotlib_uses(source) == [
        "line 3: matplotlib.use()",
        "line 4: import matplotlib.pyplot",
        "line 5: import matplotlib.pyplot",
        "line 6: matplotlib.pyplot.switch_backend()",
        "line 8: mpl.use()",
        "line 9: import matplotlib.use",
    ]


def test_no_shipped_module_touches_the_backend_or_pyplot():
    files = sorted(p for d in SOURCES for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 100 and ROOT / "sdk" / "workflows" / "reports.py" in files
    found = {
        str(p.relative_to(ROOT)): uses
        for p in files
        if (text := p.read_text(encoding="utf-8")) and ("matplotlib" in text or "pylab" in text)
        if (uses := global_matplotlib_uses(text))
    }
    assert found == {}, "use posttrain.core.figures.new_figure instead: " + repr(found)


def test_new_figure_is_outside_pyplot_and_shows_as_one_png():
    from matplotlib.figure import Figure

    with pyplot_untouched():
        fig = new_figure(figsize=(3, 2), dpi=40)
        fig.add_subplot().plot([0, 1], [1, 0])
        png = figure_png(fig)
        assert isinstance(fig, Figure)
        assert _png_size(png) == (3 * 40, 2 * 40)
        assert fig._repr_png_() == png  # what IPython shows for the figure as a cell's value
    # savefig's dpi wins over the figure's: 3 in x 100 dpi
    buf = io.BytesIO()
    with pyplot_untouched():
        fig.savefig(buf, format="png", dpi=100)
    assert _png_size(buf.getvalue()) == (300, 200)
