"""Watch a run: a live dashboard for notebooks.

`LiveDashboard` is a trainer callback (`Trainer(..., callbacks=[dash])`, or `dash.attach(trainer)`
for `Trainer` and `RLTrainer` alike). In a Jupyter kernel it shows ONE display, updated in place:

    header    run title, step / total, elapsed time, ETA, tokens/s (trained; for RL also
              sampled), the latest value of each plotted metric (`posttrain.notebook.run_pace`)
    progress  an ipywidgets IntProgress bar (DOM class `widget-hprogress`)
    plot      a matplotlib figure rendered to PNG inside a `widgets.Image` (loss; for RL also
              reward, KL, accuracy, held-out `eval/...` columns, the outcome counts and
              `TIME_PANEL`: where each step's seconds went, stacked by phase), all panels on
              one shared step axis; `logy` panels on a log y axis
    rollouts  RL only: a small table of the latest sampled rollouts (prompt, completion, reward,
              outcome), read from the trainer's `last_groups` (or a non-empty `buffer`)
    messages  an ipywidgets Output that only ever receives `append_stdout` (nbval-safe)

Redraws are throttled: at most one every `min_interval_s` seconds (counted from the end of the
previous redraw, so drawing takes at most draw_time / (draw_time + min_interval_s) of the run),
and only on every `every`-th step. The final state is always drawn: at step `total` (given here,
or the trainer's `target_steps` when it sets one), when the notebook cell finishes (an IPython
`post_run_cell` hook, so also after an interrupt or an exception), or on `flush()`.

Outside a Jupyter kernel (a script, pytest, a Slurm job) nothing is drawn: the trainers' own
text progress bar already prints; `log_every=N` adds one log line every N steps (with elapsed
time and ETA).

`posttrain.notebook.plots.plot_metrics` draws the same panels after a run; the RL-only parts
(the rollouts table, the `TIME_PANEL`) are drawn by `posttrain.notebook.rl_panels`.

Example:
    >>> dash = LiveDashboard(widget=False)       # what a script gets: no widgets, no output
    >>> dash.mode
    'text'
"""

from __future__ import annotations

import html
import math
import numbers
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pandas as pd

from posttrain.core.figures import figure_png
from posttrain.notebook.plots import (
    OUTCOMES_PANEL,
    _check_logy,
    _default_metrics,
    _draw,
    _new_figure,
    _outcome_columns,
)
from posttrain.notebook.rl_panels import (
    TIME_PANEL,
    _draw_time_split,
    _rollouts_table_html,
    _time_columns,
    latest_rollouts,
)
from posttrain.notebook.run_pace import PACE_WINDOW, RunPace, pace_parts, run_pace

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["LiveDashboard", "latest_rollouts", "in_notebook", "TIME_PANEL"]


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython with a kernel attached) where ipywidgets imports;
    False in a terminal IPython, a plain interpreter, pytest or a Slurm job."""
    shell = _ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _rank_zero() -> bool:
    """False on ranks other than 0 of an initialised torch.distributed job (trainers call their
    callbacks on every rank; one log line per step is enough)."""
    import sys

    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return True
    return dist.get_rank() == 0


def _display(obj: Any) -> None:
    """The one place that creates a notebook output (tests count calls here)."""
    from IPython.display import display

    display(obj)


# --------------------------------------------------------------------------------------------
# Live dashboard
# --------------------------------------------------------------------------------------------


class LiveDashboard:
    """A trainer callback that shows the run live in a notebook (see the module docstring).

    Args:
        metrics: columns to plot (and "outcomes", `TIME_PANEL`); None picks per run:
            `SFT_DEFAULT_METRICS` or, once a row has `reward_mean`, `RL_DEFAULT_METRICS` plus
            `TIME_PANEL` when the rows have time columns, plus `eval/...` columns.
            A requested column that has no value yet shows an empty "no data yet" panel; one
            missing from the first step's row (except `eval/...`, which appear at the first
            evaluation) is also reported once in `errors` (a typo would stay empty forever).
        every: consider redrawing only on every `every`-th step (the final state always).
        max_rows: rollouts shown in the RL table (one per group first).
        min_interval_s: seconds between redraws at least (0: every considered step).
        total: the run's last step, for the header and progress bar and to draw the final
            state at once; None: the trainer's `target_steps` attribute when it has one.
        smooth: EMA weight of the plotted curves, as in `plot_metrics` (raw points stay
            drawn under the smoothed curve).
        logy: panels drawn on a log y axis (e.g. "loss"); a panel whose values include one
            <= 0 is drawn linear, and its title says so.
        widget: True forces the widget display, False the text fallback; None (default)
            chooses widgets inside a Jupyter kernel (`in_notebook()`).
        log_every: in text mode, print one line with the latest metrics every `log_every`
            steps and at `total` (0: print nothing; the trainers' own progress bar already
            shows progress). Only rank 0 of a torch.distributed job prints.
        title: shown in the header.
        ncols, figsize, dpi: the plot's layout (as in `plot_metrics`; dpi 72 keeps redraws
            cheap: ~0.1-0.3 s for 4-6 panels on one CPU core).

    Attributes:
        mode: "widget" or "text".
        widget: the `ipywidgets.VBox` (None in text mode, and before the first step or `show()`);
            its children are `header` (HTML), `progress` (IntProgress), `image` (Image, PNG),
            `table` (HTML) and `out` (Output).
        renders: how many times the widgets were redrawn. displays: outputs created (0 or 1).
        errors: messages of redraws that failed, of requested metrics the run does not have
            and of rows whose step is not a number (none of these stops training; each message
            also goes to `out` with `append_stdout` in widget mode, to a warning in text mode).

    Raises:
        ValueError: for out-of-range options, or a `logy` name that is not one of `metrics`
            (when given). ImportError: `widget=True` without ipywidgets.
    """

    def __init__(
        self,
        metrics: Sequence[str] | None = None,
        *,
        every: int = 1,
        max_rows: int = 5,
        min_interval_s: float = 1.0,
        total: int | None = None,
        smooth: float = 0.0,
        widget: bool | None = None,
        log_every: int = 0,
        title: str = "training",
        ncols: int = 3,
        figsize: tuple[float, float] | None = None,
        dpi: int = 72,
        logy: str | Sequence[str] = (),
    ) -> None:
        for name, value, minimum in (
            ("every", every, 1),
            ("max_rows", max_rows, 0),
            ("log_every", log_every, 0),
            ("ncols", ncols, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name}={value!r}; must be an integer >= {minimum}")
        if total is not None and (not isinstance(total, int) or total < 1):
            raise ValueError(f"total={total!r}; must be a positive integer or None")
        if not (isinstance(min_interval_s, (int, float)) and min_interval_s >= 0):
            raise ValueError(f"min_interval_s={min_interval_s!r}; must be a number >= 0")
        if not 0.0 <= smooth < 1.0:
            raise ValueError(f"smooth={smooth!r}; must be in [0, 1) (0: raw values)")
        self.metrics = (
            None if metrics is None else ([metrics] if isinstance(metrics, str) else list(metrics))
        )
        self.logy = [logy] if isinstance(logy, str) else list(logy)
        if not all(isinstance(n, str) for n in self.logy):
            raise ValueError(f"logy={logy!r}; must be metric names (strings)")
        if self.metrics is not None:
            _check_logy(
                self.logy, [m for m in self.metrics if m not in (OUTCOMES_PANEL, TIME_PANEL)]
            )
        self.every, self.max_rows, self.min_interval_s = every, max_rows, float(min_interval_s)
        self.total, self.smooth, self.log_every, self.title = total, smooth, log_every, title
        self.ncols, self.figsize, self.dpi = ncols, figsize, dpi
        if widget is None:
            widget = in_notebook()
        elif widget:
            import ipywidgets  # noqa: F401  (fail here, with the real ImportError)
        self.mode = "widget" if widget else "text"
        self.widget = None
        unmade: Any = None  # ipywidgets (no type information), made by `display()`
        self.header = self.progress = self.image = self.table = self.out = unmade
        self.renders = 0
        self.displays = 0
        self.errors: list[str] = []
        self._trainer = None
        self._row: dict | None = None
        self._pending = False
        self._next_time = -math.inf
        self._fig: Figure | None = None
        self._fig_metrics: list[str] | None = None
        self._hooked: Callable | None = None
        self._metrics_checked = False
        self._started: float | None = None  # time.monotonic() when the first step seen began
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=PACE_WINDOW + 1)

    # ------------------------------------------------------------------ callback protocol

    def attach(self, trainer) -> LiveDashboard:
        """Add this dashboard to `trainer.callbacks` (once) and return it. In widget mode it
        also sets `trainer.progress = False`: the dashboard shows progress, so the trainer's
        tqdm bar would be a second display."""
        callbacks = getattr(trainer, "callbacks", None)
        if not isinstance(callbacks, list):
            raise TypeError(
                f"{type(trainer).__name__} has no callbacks list; pass the dashboard "
                "as callbacks=[dash] or call dash(trainer, row) after each step"
            )
        if not any(c is self for c in callbacks):
            callbacks.append(self)
        if self.mode == "widget" and hasattr(trainer, "progress"):
            trainer.progress = False
        return self

    def __call__(self, trainer, row: dict) -> None:
        """Record step `row` of `trainer`; redraw if due (see the module docstring)."""
        step = row.get("step", 0)
        if not isinstance(step, numbers.Real) or isinstance(step, bool) or not math.isfinite(step):
            self._report(f"dashboard: a row with step={step!r} (not a number) was not shown")
            return
        step = step if isinstance(step, int) else int(float(step))
        if self._started is None:
            seconds = row.get("step_time_s")
            took = float(seconds) if isinstance(seconds, numbers.Real) else 0.0
            self._started = time.monotonic() - (took if math.isfinite(took) else 0.0)
        self._arrivals.append((step, time.monotonic()))
        self._trainer, self._row = trainer, {**row, "step": step}
        total = self._total()
        final = total is not None and step >= total
        if self.mode == "text":
            self._check_metrics(self._frame())
            if self.log_every and (step % self.log_every == 0 or final) and _rank_zero():
                print(self._log_line(step, total), flush=True)
            return
        self._pending = True
        due = step % self.every == 0 and time.monotonic() >= self._next_time
        if final or due:
            self.render()
        else:
            self._hook_cell_end()

    def flush(self) -> None:
        """Draw the latest state now if a step arrived since the last redraw."""
        if self.mode == "widget" and self._pending and self._row is not None:
            self.render()

    def close(self) -> None:
        """Draw the final state, stop listening to cell ends and free the figure."""
        self.flush()
        self._unhook_cell_end()
        self._fig = None

    # ------------------------------------------------------------------ display

    def show(self) -> None:
        """Create the widgets and display them (once; later calls do nothing)."""
        if self.mode != "widget":
            return
        self._build()
        if self.displays == 0:
            _display(self.widget)
            self.displays += 1

    def _ipython_display_(self) -> None:
        if self.mode == "widget":
            self.show()
        else:
            print(repr(self))

    def _build(self) -> None:
        if self.widget is not None:
            return
        import ipywidgets as widgets

        self.header = widgets.HTML(
            value=f"<b>{html.escape(self.title)}</b> waiting for the first step"
        )
        self.progress = widgets.IntProgress(
            value=0, min=0, max=self.total or 1, layout=widgets.Layout(width="100%")
        )
        # flex-start: a VBox column stretches its children to full width, which would blur the
        # PNG; hidden until the first plot (an empty Image shows as a broken picture).
        self.image = widgets.Image(
            format="png",
            layout=widgets.Layout(max_width="100%", align_self="flex-start", display="none"),
        )
        self.table = widgets.HTML(value="")
        self.out = widgets.Output()
        self.widget = widgets.VBox([self.header, self.progress, self.image, self.table, self.out])

    def render(self) -> None:
        """Redraw every part from the latest row now (no throttling). A failure is recorded in
        `errors` and shown in `out`, never raised: a broken plot must not stop a run."""
        if self.mode != "widget" or self._row is None:
            return
        self.show()
        row, trainer = self._row, self._trainer
        step = int(row.get("step", 0))
        total = self._total()
        self._pending = False
        try:
            frame = self._frame()
            self._check_metrics(frame)
            metrics = self._metrics(frame)
            self.header.value = self._header_html(step, total, row, metrics, self._pace(frame))
            self.progress.max = max(total or step, step, 1)
            self.progress.value = step
            self.progress.bar_style = "success" if total is not None and step >= total else ""
            self.image.value = self._plot(frame, metrics)
            self.image.layout.display = None
            self.table.value = _rollouts_table_html(trainer, self.max_rows)
        except Exception as e:  # noqa: BLE001 - a dashboard bug must not kill the run
            self._report(f"dashboard: step {step} not drawn ({type(e).__name__}: {e})")
        self.renders += 1
        self._next_time = time.monotonic() + self.min_interval_s
        self._unhook_cell_end()

    # ------------------------------------------------------------------ pieces

    def _total(self) -> int | None:
        if self.total is not None:
            return self.total
        target = getattr(self._trainer, "target_steps", None)
        return target if isinstance(target, int) and target > 0 else None

    def _frame(self) -> pd.DataFrame:
        frame = getattr(self._trainer, "metrics", None)
        if isinstance(frame, pd.DataFrame) and not frame.empty:
            return frame
        return pd.DataFrame([self._row])

    def _pace(self, frame: pd.DataFrame) -> RunPace:
        """`run_pace` of the rows so far: elapsed = wall clock since the first step seen
        began, the ETA at the wall-clock pace of the rows' arrivals."""
        started = self._started
        elapsed = None if started is None else max(time.monotonic() - started, 0.0)
        return run_pace(
            frame, total=self._total(), elapsed_s=elapsed, step_clock=list(self._arrivals)
        )

    def _metrics(self, frame: pd.DataFrame) -> list[str]:
        if self.metrics is not None:
            return list(self.metrics)
        chosen = _default_metrics(frame.columns)
        if "reward_mean" in frame.columns and _time_columns(frame.columns):
            chosen.insert(len([m for m in chosen if not m.startswith("eval/")]), TIME_PANEL)
        return chosen

    def _check_metrics(self, frame: pd.DataFrame) -> None:
        """Once: report requested metrics (or `logy` names) that the run's first rows lack."""
        if self._metrics_checked or (self.metrics is None and not self.logy):
            return
        self._metrics_checked = True
        unknown = [
            m
            for m in (self.metrics if self.metrics is not None else self.logy)
            if m not in frame.columns
            and not m.startswith("eval/")
            and not (m == OUTCOMES_PANEL and _outcome_columns(frame.columns))
            and not (m == TIME_PANEL and _time_columns(frame.columns))
        ]
        if unknown:
            available = sorted(c for c in frame.columns if c != "step")
            effect = "panels stay empty" if self.metrics is not None else "logy names no panel"
            self._report(
                f"dashboard: no column {unknown} in this run's metrics; available: "
                f"{available} ({effect})"
            )

    def _report(self, message: str) -> None:
        """Record a problem without stopping training: `errors`, plus `out` or a warning."""
        self.errors.append(message)
        if self.out is not None:
            self.out.append_stdout(message + "\n")
        else:
            warnings.warn(message, stacklevel=3)

    def _plot(self, frame: pd.DataFrame, metrics: list[str]) -> bytes:
        if self._fig is None or self._fig_metrics != metrics:
            self._fig = _new_figure(len(metrics), self.ncols, self.figsize, self.dpi)
            self._fig_metrics = list(metrics)
        with warnings.catch_warnings():  # constrained layout on tiny panels warns; harmless
            warnings.simplefilter("ignore", UserWarning)
            _draw(self._fig, frame, metrics, smooth=self.smooth, ncols=self.ncols, logy=self.logy)
            for ax, name in zip(self._fig.axes, metrics):  # subplots are created row-major
                if name == TIME_PANEL:
                    _draw_time_split(ax, frame)
            return figure_png(self._fig)

    def _header_html(
        self, step: int, total: int | None, row: dict, metrics: list[str], pace: RunPace
    ) -> str:
        where = f"step {step}/{total}" if total is not None else f"step {step}"
        parts = [f"<b>{html.escape(self.title)}</b>", where, *pace_parts(pace)]
        for name in metrics:
            value = row.get(name)
            if (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                parts.append(f"{html.escape(name)} {value:.4g}")
        return " &middot; ".join(parts)

    def _log_line(self, step: int, total: int | None) -> str:
        row = self._row or {}
        where = f"step {step}/{total}" if total is not None else f"step {step}"
        names = self.metrics or _default_metrics(list(row))
        values = [
            f"{n} {row[n]:.4g}"
            for n in names
            if isinstance(row.get(n), (int, float)) and not isinstance(row.get(n), bool)
        ]
        pace = pace_parts(self._pace(self._frame()))
        return "  ".join([f"[{self.title}] {where}", *pace, *values])

    # ------------------------------------------------------------------ notebook cell end

    def _hook_cell_end(self) -> None:
        """Draw the pending state when the running cell ends (fit returned, was interrupted
        or raised); a no-op outside IPython."""
        if self._hooked is not None:
            return
        shell = _ipython()
        events = getattr(shell, "events", None)
        if events is None:
            return

        def on_cell_end(*args, **kwargs) -> None:
            self._unhook_cell_end()
            self.flush()

        events.register("post_run_cell", on_cell_end)
        self._hooked = on_cell_end
        self._hook_events = events

    def _unhook_cell_end(self) -> None:
        if self._hooked is None:
            return
        try:
            self._hook_events.unregister("post_run_cell", self._hooked)
        except ValueError:
            pass
        self._hooked = None

    def __repr__(self) -> str:
        return (
            f"LiveDashboard(mode={self.mode!r}, metrics={self.metrics}, renders="
            f"{self.renders}, total={self._total()})"
        )
