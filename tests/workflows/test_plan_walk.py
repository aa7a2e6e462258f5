"""The walk of a `parallel.*` override from the command line's parsing to the split model goes
down the layers and crosses each file once (docs/design/config_walkthrough.md, section 1).

Recorded with `sys.setprofile` on one process without a process group: `apply_overrides` with
a `parallel.*` override, `RecipeRun.start` (the config validated, the plan checked against the
world size and the model) and `run.parallelize` on a plan of one rank (activation
checkpointing, the plan that runs without a process group). For every Python call entered
in a file of the walk, the chain of walk files on the call stack (outermost first, consecutive
repeats collapsed) must name each file once and in layer order: a call never goes back up
into a file it came through (no A -> B -> A).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import posttrain
from posttrain import cli
from posttrain.models.specs import build_model, get_preset
from posttrain.train import PlanRuntime
from posttrain.workflows import RecipeRun
from posttrain.workflows.recipes import apply_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

SDK = Path(posttrain.__file__).resolve().parent

WALK = (
    "cli.py",
    "workflows/recipes.py",
    "workflows/recipe_run.py",
    "workflows/reports.py",
    "workflows/config_paths.py",
    "workflows/task_data.py",
    "workflows/parallel.py",
    "train/parallel.py",
    "train/sharding.py",
    "train/plan_checks.py",
    "train/runtime.py",
    "train/plan_value.py",
)
"""The walk's files in layer order (callers first): the command line; the recipe machinery of
workflows (a run's start, the config's validation, the checks of its sections against the task
and the model); the plan's module, what applies a plan and what it asks; the plan's value
type, read by all of them."""


def _walk_file(filename: str) -> str | None:
    try:
        name = Path(filename).resolve().relative_to(SDK).as_posix()
    except ValueError:
        return None
    return name if name in WALK else None


class _Recorder:
    """Every chain of walk files on the stack at a call into a walk file, and the functions
    entered, in order: `(file, function, caller's file or None, caller's function)`."""

    def __init__(self) -> None:
        self.chains: set[tuple[str, ...]] = set()
        self.calls: list[tuple[str, str, str | None, str]] = []

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        here = _walk_file(frame.f_code.co_filename)
        if here is None:
            return
        caller = frame.f_back
        self.calls.append(
            (
                here,
                frame.f_code.co_name,
                _walk_file(caller.f_code.co_filename) if caller else None,
                caller.f_code.co_name if caller else "",
            )
        )
        chain: list[str] = []
        f = frame
        while f is not None:
            name = _walk_file(f.f_code.co_filename)
            if name is not None and (not chain or chain[-1] != name):
                chain.append(name)
            f = f.f_back
        self.chains.add(tuple(reversed(chain)))

    def __enter__(self) -> _Recorder:
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def _check_one_way(chains: set[tuple[str, ...]]) -> None:
    for chain in sorted(chains):
        order = [WALK.index(name) for name in chain]
        assert len(set(chain)) == len(chain) and order == sorted(order), (
            "the walk goes back up: " + " -> ".join(chain)
        )


def test_a_parallel_override_walks_down_once_from_the_config_to_the_split_model(tmp_path):
    config = cli.load_recipe("sft").Config
    defaults = config()
    spec = get_preset(defaults.model.name)
    model = build_model(spec, seed=0)
    overrides = [
        "parallel.activation_checkpointing=true",
        "parallel.pp_schedule=gpipe",
        "task.eval_size=0",
        "task.train_size=64",
        f"out_dir={tmp_path / 'run'}",
    ]
    with _Recorder() as overriding:
        cfg = apply_overrides(defaults, overrides)
    with _Recorder() as starting:
        run = RecipeRun.start(cfg)
    with _Recorder() as splitting:
        runtime = run.parallelize(model, spec=spec)

    assert isinstance(runtime, PlanRuntime)
    assert runtime.plan is cfg.parallel and runtime.model is model
    _check_one_way(overriding.chains | starting.chains | splitting.chains)
    # the config is built, and validated, once from all the overrides, and once more at the
    # start of the run (a notebook may have changed it in place) ...
    assert _validations(overriding) == 1
    assert _validations(starting) == 1
    # ... where the plan is checked against the world size and the model in one call
    assert _entered(starting, "train/plan_checks.py", "check_plan") == 1
    assert run.checked is not None and run.checked.plan is cfg.parallel
    assert (run.checked.world_size, run.checked.spec) == (1, spec)
    # parallelize takes the checked plan: it goes back neither to the checks nor to the plan
    split_files = {call[0] for call in splitting.calls}
    assert "train/sharding.py" in split_files
    assert not split_files & {"train/plan_checks.py", "train/parallel.py", "workflows/parallel.py"}


def _entered(recorder: _Recorder, file: str, function: str) -> int:
    return sum(call[:2] == (file, function) for call in recorder.calls)


def _validations(recorder: _Recorder) -> int:
    """Calls of `config_paths.validate` on a whole config (its own recursion into the sections
    not counted)."""
    here = ("workflows/config_paths.py", "validate")
    return sum(call[:2] == here and call[2:] != here for call in recorder.calls)
