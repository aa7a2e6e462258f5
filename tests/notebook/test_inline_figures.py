"""Figures stay inline in a real Jupyter kernel after a recipe's report ran in it.

A recipe run from a cell (directly, or by a sweep on the debug executor) saves its plots to the
run folder. If that switched matplotlib's backend (`matplotlib.use("Agg")`), every later plot of
the kernel would render nothing: pyplot's inline figures and `Figure` objects alike. This test
starts one kernel of this venv (nbval's current-environment kernel spec, as `make test` runs the
tutorials), runs the plotting functions the recipes call (`plot_curves`, the held-out curve)
inside a function, as a recipe does, and then checks that the next cells display PNG images:
a plain `plt.plot`, `plot_metrics` and the figure the report function returned.

One kernel, ~5-10 s on a loaded machine (kernel start, then importing torch with
posttrain.workflows).

The tutorials' plot cells are held to the same under nbval: a cell tagged `shows-figure` fails
unless it displayed an image (notebooks/conftest.py), and every cell that plots carries the tag.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
KERNEL_WAIT_S = 120  # a kernel start and each cell, on a loaded 2-core machine
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

CELLS = {
    "recipe": """
        import matplotlib
        import pandas as pd
        from pathlib import Path

        from posttrain.workflows.reports import plot_curves
        from posttrain.workflows.rl_evaluation import plot_eval_curve

        backend_before = matplotlib.get_backend()
        frame = pd.DataFrame({"step": [1, 2, 3], "loss": [2.0, 1.5, 1.2]})
        curve = pd.DataFrame({"step": [0, 2], "accuracy": [0.25, 0.5], "ci_low": [0.1, 0.3],
                              "ci_high": [0.5, 0.7], "num_items": [8, 8]})

        def recipe(out):   # what a recipe's main does at its end: files in its run folder
            plot_curves(frame, out / "loss.png", [("loss", "loss")], xlabel="step")
            plot_eval_curve(curve, out / "eval_curve.png", xlabel="GRPO step")
            return "done"

        recipe(Path(OUT))
    """,
    "backend": "print(matplotlib.get_backend() == backend_before, matplotlib.get_backend())",
    "pyplot": """
        import matplotlib.pyplot as plt

        plt.plot([1, 2, 3], [3, 1, 2]);
    """,
    "plot_metrics": """
        from posttrain.notebook import plot_metrics

        plot_metrics(frame, ["loss"])
    """,
    "returned": 'plot_curves(frame, Path(OUT) / "again.png", [("loss", "loss")], xlabel="step")',
}


def _images(cell) -> list[bytes]:
    return [
        base64.b64decode(out["data"]["image/png"])
        for out in cell.outputs
        if out.output_type in ("display_data", "execute_result")
        and "image/png" in out.get("data", {})
    ]


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict[str, nbformat.NotebookNode]:
    out = tmp_path_factory.mktemp("inline")
    sources = {"setup": f"OUT = {str(out)!r}", **CELLS}
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(s).strip()) for s in sources.values()]
    km = KernelManager(
        kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager()
    )
    client = NotebookClient(
        nb, km=km, timeout=KERNEL_WAIT_S, startup_timeout=KERNEL_WAIT_S, allow_errors=False
    )
    client.execute(cwd=str(out))
    return dict(zip(sources, nb.cells))


def test_a_recipe_report_leaves_the_kernel_backend_and_is_quiet(executed):
    # Saving the run folder's plots neither displays them in the cell nor switches the backend.
    assert _images(executed["recipe"]) == []
    text = "".join(o.get("text", "") for o in executed["backend"].outputs)
    assert text.startswith("True "), f"the backend changed after the recipe's plots: {text!r}"


@pytest.mark.parametrize("cell", ["pyplot", "plot_metrics", "returned"])
def test_plots_after_a_recipe_display_one_png(executed, cell):
    images = _images(executed[cell])
    kinds = [o.output_type for o in executed[cell].outputs]
    assert len(images) == 1, f"cell {cell!r}: expected one image/png output, got {kinds}"
    assert images[0].startswith(PNG_SIGNATURE)


# ------------------------------------------------------------------ the tutorials under nbval


def _hooks():
    """notebooks/conftest.py as a module of its own name (pytest registers it as "conftest")."""
    spec = importlib.util.spec_from_file_location("notebook_hooks", NOTEBOOKS / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tagged_cell_without_an_image_is_named_with_its_outputs():
    hooks = _hooks()
    tag = [hooks.FIGURE_TAG]
    text = {"output_type": "execute_result", "data": {"text/plain": "<Figure size 500x300>"}}
    png = {"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Fig>"}}
    result = {**png, "output_type": "execute_result"}
    assert hooks.missing_figure([], [text]) is None  # untagged: not checked
    assert hooks.missing_figure(tag, [text, png]) is None
    assert hooks.missing_figure(tag, [result]) is None
    reason = hooks.missing_figure(tag, [{"output_type": "stream", "text": "hi"}, text])
    assert "'shows-figure'" in reason and "['stream', 'execute_result']" in reason
    # The hook fails the nbval item after its cell ran (a fake item: nbval's cell and outputs).
    item = SimpleNamespace(name="Cell 7", cell=SimpleNamespace(metadata={"tags": tag}))
    item.test_outputs = [png]
    call = hooks.pytest_runtest_call(item)
    next(call)
    with pytest.raises(StopIteration):  # the hook returns: the cell passes
        call.send(None)
    item.test_outputs = [text]
    call = hooks.pytest_runtest_call(item)
    next(call)
    with pytest.raises(pytest.fail.Exception, match="^Cell 7: the cell is tagged 'shows-figure'"):
        call.send(None)


PLOTS = ("plot_metrics(", "compare_rewards(", "plt.show()", "s.plot()", ".plot.bar(")


def test_every_tutorial_cell_that_plots_is_tagged():
    hooks = _hooks()
    untagged, tagged = [], 0
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text(encoding="utf-8"))["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or not any(p in source for p in PLOTS):
                continue
            if hooks.FIGURE_TAG in cell["metadata"].get("tags", []):
                tagged += 1
            else:
                untagged.append(f"{path.name} cell {i}")
    assert untagged == [] and tagged >= 9, untagged
