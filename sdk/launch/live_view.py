"""A view of a job's or a sweep's state that refreshes in place in a notebook and stays quiet in
a log: in a Jupyter kernel one `ipywidgets.HTML` output, displayed on the first update and
replaced in place on each later one (the convention of `tqdm.auto` and the live dashboard: a
widget in a notebook, never one output per refresh); anywhere else (a terminal, a script's log,
a Slurm job, pytest) nothing is shown, so a log does not fill with tables.

`posttrain.workflows.sweep.sweep` shows its table through one while the "debug" executor runs
the runs of a sweep in turn in this process (`posttrain.launch.submit.launch_array`'s
`on_run` calls it between runs); `Run.watch` and `Sweep.watch` poll through
`posttrain.launch.records.watch_until_done`, which uses `in_kernel` too.

Example (outside a kernel an update shows nothing and counts nothing):
    >>> view = LiveHTML(lambda: "<p>3 of 6 runs finished</p>")
    >>> view.update()
    >>> view.widget is None, view.updates
    (True, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LiveHTML", "in_kernel"]


def in_kernel() -> bool:
    """True inside a Jupyter (IPython kernel) process where ipywidgets imports."""
    try:
        from IPython import get_ipython

        if getattr(get_ipython(), "kernel", None) is None:
            return False
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def _display(obj: Any) -> None:
    """The one place that creates a notebook output (tests count calls here)."""
    from IPython.display import display

    display(obj)


class LiveHTML:
    """HTML refreshed in place in a notebook (see the module docstring).

    Args:
        render: returns the HTML to show; called on every update in a kernel only.

    Attributes:
        widget: the displayed `ipywidgets.HTML` (None outside a kernel and before the first
            update).
        updates: how many times the widget's content was set.
    """

    def __init__(self, render: Callable[[], str]) -> None:
        self.render = render
        self.widget: Any = None
        self.updates = 0
        self._live = in_kernel()

    def update(self) -> None:
        """Show `render()` now: display the widget on the first call, replace its content on
        later ones. Outside a kernel: nothing. What `render` raises is raised."""
        if not self._live:
            return
        value = self.render()
        if self.widget is None:
            import ipywidgets

            self.widget = ipywidgets.HTML(value)
            _display(self.widget)
        else:
            self.widget.value = value
        self.updates += 1
