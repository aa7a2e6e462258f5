"""Figures that are written to files and shown in notebooks without touching pyplot.

matplotlib has one process-wide switch, the backend, and pyplot keeps global state (its open
figures, which Jupyter's inline backend shows at the end of each cell). A library that calls
`matplotlib.use("Agg")` to write a PNG switches the backend of the whole process: in a Jupyter
kernel every later plot (a plain `plt.plot` as much as a displayed figure) then renders nothing.
So nothing in posttrain imports pyplot or calls `matplotlib.use` (tests/core/test_figures.py reads
every module of the package to keep it so). Figures are made here instead:

  - `new_figure(**kwargs)`: a `matplotlib.figure.Figure` built directly (the keyword arguments
    of `Figure`: figsize in inches, dpi, layout). `fig.savefig(path)` writes it with matplotlib's
    Agg canvas for that one call, whatever the backend; as a notebook cell's value or through
    `display(fig)` it shows itself as one PNG (`_repr_png_`), with or without the inline backend;
    in a script or a log it prints nothing. pyplot never holds it: there is nothing to close,
    the figure is freed with its last reference.
  - `figure_png(fig)`: the PNG bytes of any Figure.

matplotlib is imported on the first figure, not with this module.

Example:
    >>> fig = new_figure(figsize=(2, 1), dpi=50)
    >>> lines = fig.add_subplot().plot([0, 1], [1, 0])
    >>> png = figure_png(fig)
    >>> png[:8] == b"\\x89PNG\\r\\n\\x1a\\n", int.from_bytes(png[16:20], "big")  # 2 in x 50 dpi
    (True, 100)
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["new_figure", "figure_png"]

_INLINE_FIGURE: type | None = None


def _inline_figure_class() -> type:
    global _INLINE_FIGURE
    if _INLINE_FIGURE is None:
        from matplotlib.figure import Figure

        class InlineFigure(Figure):
            """A matplotlib Figure outside pyplot that displays itself as a PNG in IPython."""

            def _repr_png_(self) -> bytes:
                return figure_png(self)

        _INLINE_FIGURE = InlineFigure
    return _INLINE_FIGURE


def new_figure(**kwargs: Any) -> Figure:
    """A new `matplotlib.figure.Figure` that pyplot does not know about.

    Args:
        **kwargs: passed to `matplotlib.figure.Figure`, e.g. figsize=(width, height) in inches,
            dpi (dots per inch), layout ("constrained", "tight" or None).

    Returns:
        The figure, without axes (`fig.add_subplot()`, `fig.subplots(...)`). It shows as one
        PNG image when it is a notebook cell's value; `fig.savefig(path, dpi=...)` writes it.
    """
    return _inline_figure_class()(**kwargs)


def figure_png(fig: Figure) -> bytes:
    """The PNG bytes of `fig` at its own dpi (pixels = inches x dpi), drawn with the Agg canvas
    for this call only (the backend is left as it is)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
