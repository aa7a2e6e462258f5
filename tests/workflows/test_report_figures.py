"""The plots a recipe saves to its run folder (`plot_curves`, `plot_eval_curve` behind
`HeldOutCurve.plot`): what each panel draws, the PNG written, and that making them leaves
matplotlib's backend and pyplot's figures as they were (`_figure_helpers.pyplot_untouched`), so
a notebook's plots stay inline after a recipe ran in its kernel (the kernel itself:
tests/notebook/test_inline_figures.py)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from _figure_helpers import pyplot_untouched

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    png = path.read_bytes()
    assert png[:8] == PNG_SIGNATURE
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def _xy(line) -> tuple[list[float], list[float]]:
    return [float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()]


def test_plot_curves_draws_each_present_column_and_leaves_pyplot_alone(tmp_path):
    frame = pd.DataFrame(
        {
            "step": [1, 2, 3, 4],
            "loss": [2.0, 1.5, 1.2, 1.0],
            "eval/acc": [math.nan, 0.5, math.nan, 0.75],  # sparse: NaN rows are skipped
        }
    )
    path = tmp_path / "curves.png"
    with pyplot_untouched():
        import posttrain
        from posttrain.workflows.reports import plot_curves

        assert posttrain.workflows.reports.plot_curves is plot_curves
        fig = plot_curves(
            frame,
            path,
            [("loss", "loss (token mean)"), ("absent", "x"), ("eval/acc", "accuracy")],
            xlabel="optimizer step",
            log_y=True,
        )
    loss_ax, acc_ax = fig.axes  # "absent" has no panel
    (loss,), (acc,) = loss_ax.lines, acc_ax.lines
    assert _xy(loss) == ([1, 2, 3, 4], [2.0, 1.5, 1.2, 1.0]) and loss.get_marker() == "None"
    assert _xy(acc) == ([2, 4], [0.5, 0.75]) and acc.get_marker() == "."
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss (token mean)", "accuracy"]
    assert {ax.get_xlabel() for ax in fig.axes} == {"optimizer step"}
    assert {ax.get_yscale() for ax in fig.axes} == {"log"}
    assert _png_size(path) == (2 * 4 * 100, 3 * 100)  # 4 x 3 inches a panel at 100 dpi


def test_plot_curves_without_any_present_column_names_them():
    from posttrain.workflows.reports import plot_curves

    frame = pd.DataFrame({"step": [1], "loss": [1.0]})
    with pytest.raises(ValueError, match=r"none of the columns \['kl'\].*'loss'"):
        plot_curves(frame, "unused.png", [("kl", "KL")], xlabel="step")


def test_the_held_out_curve_plot_draws_the_table_and_leaves_pyplot_alone(tmp_path):
    from posttrain.workflows.reports import write_table
    from posttrain.workflows.rl_evaluation import HeldOutCurve

    table = pd.DataFrame(
        {
            "step": [0, 2, 4],
            "accuracy": [0.25, 0.5, 0.625],
            "ci_low": [0.07, 0.22, 0.31],
            "ci_high": [0.59, 0.78, 0.86],
            "num_items": [8, 8, 8],
        }
    )
    write_table(table, tmp_path / "eval_curve.csv")
    curve = HeldOutCurve(
        None, [], None, every=2, max_new_tokens=4, path=tmp_path / "eval_curve.csv"
    )  # no policy, items nor scorer: plot reads only the table
    with pyplot_untouched():
        fig = curve.plot(tmp_path / "eval_curve.png", xlabel="GRPO step")
    (ax,) = fig.axes
    assert _xy(ax.lines[0]) == ([0, 2, 4], [0.25, 0.5, 0.625])
    assert ax.get_title() == "8 items, 95% Wilson interval"
    assert ax.get_xlabel() == "GRPO step"
    (band,) = ax.collections  # the interval: its path spans ci_low .. ci_high
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(0.07) and max(ys) == pytest.approx(0.86)
    assert _png_size(tmp_path / "eval_curve.png") == (500, 300)  # 5 x 3 inches at 100 dpi
