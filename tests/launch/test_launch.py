"""posttrain.launch.submit without a job: the "debug" executor (in this process), what is refused
before anything is submitted (targets, timeouts, unpicklable configs and closures, named), the
resume flag a checkpoint sets, `posttrain launch` on the command line, and the watch loop.
Local job processes: tests/launch/test_launch_local.py; submission to a stub Slurm:
tests/launch/test_launch_slurm_stub.py."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any

import cloudpickle
import pytest
from _launch_helpers import Cfg, times_ten

from posttrain import cli
from posttrain.launch.pickling import LaunchPickleError
from posttrain.launch.submit import RUN_FILE, JobFailedError, Run, _Call, launch

# As in a notebook: the jobs cannot import this test module, so its functions and classes travel
# by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ----------------------------------------------------------------------------- debug executor


def test_debug_runs_the_function_in_this_process():
    run = launch(lambda cfg: (cfg["x"] + 1, os.getpid()), {"x": 41}, executor="debug")
    assert run.result() == (42, os.getpid())
    assert run.state == "COMPLETED" and run.done()
    assert run.folder is None and run.logs() == ""


def test_debug_failure_raises_job_failed_error_never_pdb(monkeypatch):
    import pdb

    monkeypatch.setattr(pdb, "post_mortem", lambda *a: pytest.fail("pdb.post_mortem was called"))
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115 (a kernel without stdin)
    calls = []

    def fails():
        calls.append(1)
        raise KeyError("no such column 'reward'")

    run = launch(fails, executor="debug")
    assert run.state == "FAILED"
    for _ in range(2):
        with pytest.raises(JobFailedError, match="no such column 'reward'") as info:
            run.result()
    assert "in fails" in str(info.value)  # the traceback's frame of the function
    assert isinstance(info.value.__cause__, KeyError)
    assert calls == [1]  # submitit's DebugJob.exception() would rerun a failed function


def test_debug_refuses_several_tasks():
    with pytest.raises(ValueError, match="executor='debug' runs one task.*tasks_per_node=2"):
        launch(times_ten, 1, executor="debug", tasks_per_node=2)
    with pytest.raises(ValueError, match="nodes must be 1"):
        launch(times_ten, 1, executor="local", nodes=2)
    with pytest.raises(ValueError, match="executor='cloud'; allowed: local, slurm, debug"):
        launch(times_ten, 1, executor="cloud")
    with pytest.raises(ValueError, match="slurm_kwargs are for executor='slurm'"):
        launch(times_ten, 1, executor="debug", slurm_kwargs={"qos": "high"})


@pytest.mark.parametrize("executor", ["debug", "local", "slurm"])
def test_a_non_callable_target_is_refused_at_launch(executor, tmp_path):
    with pytest.raises(TypeError, match="target=5 is not callable"):
        launch(5, 1, executor=executor, folder=tmp_path / "launch")
    assert not any(tmp_path.iterdir())


def test_debug_sys_exit_is_a_job_failure_and_ctrl_c_still_stops(monkeypatch):
    monkeypatch.setattr(sys, "stdin", open(os.devnull))  # noqa: SIM115 (as above)
    run = launch(sys.exit, 3, executor="debug")
    assert run.state == "FAILED"
    with pytest.raises(JobFailedError, match="SystemExit: 3") as info:
        run.result()
    assert isinstance(info.value.__cause__, SystemExit)

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch(interrupted, executor="debug")


@pytest.mark.parametrize("timeout_min", [float("inf"), float("nan"), 0, True])
def test_timeout_min_must_be_a_finite_number_and_nothing_is_written(timeout_min, tmp_path):
    with pytest.raises(ValueError, match=r"timeout_min=.*; must be a finite number of minutes"):
        launch(times_ten, 1, folder=tmp_path / "launch", timeout_min=timeout_min)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"jobs": [', "is not valid JSON"),
        ("{}", "not a launch record written by posttrain.launch.submit: it has no 'executor'"),
        ('{"model_type": "llama"}', "it has no 'executor'"),
        ("[1, 2]", "holds a JSON list"),
    ],
)
def test_attach_to_a_file_that_is_not_a_launch_record_says_so(text, message, tmp_path):
    (tmp_path / RUN_FILE).write_text(text)
    with pytest.raises(ValueError, match=f"{tmp_path / RUN_FILE}.*{message}"):
        Run.attach(tmp_path)


def test_metrics_before_the_first_row_say_so(tmp_path):
    run = launch(lambda cfg: None, Cfg(out_dir=str(tmp_path / "none")), executor="debug")
    frame = run.metrics()
    assert frame.empty and "no metrics yet" in repr(frame) and "does not exist" in repr(frame)
    with pytest.raises(ValueError, match="no out_dir"):
        launch(times_ten, 1, executor="debug").metrics()


def test_watch_prints_a_line_outside_jupyter(capsys):
    run = launch(times_ten, 4, executor="debug")
    assert run.watch(every_s=0.01) == "COMPLETED"
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("Run(job_id='DEBUG_") and "COMPLETED" in out[0]


def test_watch_updates_one_widget_in_jupyter(monkeypatch, capsys):
    import types

    import IPython
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))
    monkeypatch.setattr(IPython.display, "display", shown.append)
    run = launch(times_ten, 4, executor="debug")
    assert run.watch(every_s=0.01) == "COMPLETED"
    assert len(shown) == 1 and "<td>COMPLETED</td>" in shown[0].value
    assert capsys.readouterr().out == ""  # nothing printed around the widget


# ----------------------------------------------------------------------------- pickling


class _Tokenizer:
    def __init__(self):
        self.vocab = {"a": 0}
        self._lock = threading.Lock()


@dataclasses.dataclass
class _LockedCfg:
    out_dir: str
    tokenizer: Any


def test_unpicklable_cfg_is_named_before_anything_is_submitted(tmp_path):
    cfg = _LockedCfg(out_dir=str(tmp_path / "out"), tokenizer=_Tokenizer())
    with pytest.raises(LaunchPickleError, match=r"cfg\.tokenizer\._lock \(_thread\.lock\)") as info:
        launch(times_ten, cfg, executor="local")
    assert isinstance(info.value, TypeError)
    assert "define it in the notebook" in str(info.value)
    assert not (tmp_path / "out").exists()  # default folder <out_dir>/launch never created
    with pytest.raises(LaunchPickleError):
        launch(times_ten, cfg, folder=tmp_path / "explicit", executor="slurm")
    assert not (tmp_path / "explicit").exists()


def test_unpicklable_closure_variable_is_named(tmp_path):
    lock = threading.Lock()

    def uses_lock():
        with lock:
            return 1

    with pytest.raises(LaunchPickleError, match=r"target\.__closure__\['lock'\]"):
        launch(uses_lock, folder=tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_checkpoint_flips_resume_for_a_dataclass_cfg():
    cfg = Cfg(out_dir="o")
    call = _Call(
        times_ten, cfg, has_cfg=True, num_tasks=1, gpus_per_node=0, master_addr=None, in_job=True
    )
    resubmitted = call.checkpoint()
    assert resubmitted.function.cfg == Cfg(out_dir="o", resume=True)
    assert cfg.resume is False  # the original is untouched
    plain = _Call(
        times_ten,
        {"resume": False},
        has_cfg=True,
        num_tasks=1,
        gpus_per_node=0,
        master_addr=None,
        in_job=True,
    )
    assert plain.checkpoint().function.cfg == {"resume": False}  # restarts from scratch


# ----------------------------------------------------------------------------- command line


def test_cli_launch_debug(tmp_path, capsys):
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from dataclasses import dataclass\n@dataclass(kw_only=True)\nclass Config:\n"
        "    steps: int = 1\n    resume: bool = False\n"
        "def main(cfg):\n    return {'steps': cfg.steps}\n"
    )
    assert cli.main(["launch", str(recipe), "--executor", "debug", "steps=7"]) == 0
    out = capsys.readouterr().out
    assert "state='COMPLETED'" in out and "{'steps': 7}" in out


def test_cli_launch_refuses_an_infinite_timeout(tmp_path, capsys):
    recipe = tmp_path / "r.py"
    recipe.write_text(
        "from dataclasses import dataclass\n@dataclass(kw_only=True)\n"
        "class Config:\n    steps: int = 1\ndef main(cfg):\n    return 1\n"
    )
    assert (
        cli.main(
            ["launch", str(recipe), "--timeout-min", "inf", "--folder", str(tmp_path / "launch")]
        )
        == 1
    )
    assert "timeout_min=inf; must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "launch").exists()


def test_watch_until_done_prints_each_new_state_once_and_stops_when_done(capsys):
    """Outside a notebook the shared watch loop of Run.watch and Sweep.watch prints a state
    only when it changed, returns True once done() is, and False after a timeout."""
    from posttrain.launch.records import watch_until_done

    states = iter(["a", "a", "b", "c"])
    shown = {"now": None}

    def done():
        shown["now"] = next(states)
        return shown["now"] == "c"

    assert (
        watch_until_done(
            done,
            as_html=lambda: "",
            as_text=lambda: shown["now"],
            every_s=0.0,
            timeout=None,
            stopped="stopped",
        )
        is True
    )
    assert capsys.readouterr().out.split() == ["a", "b", "c"]
    assert (
        watch_until_done(
            lambda: False,
            as_html=lambda: "",
            as_text=lambda: "x",
            every_s=0.01,
            timeout=0.05,
            stopped="stopped",
        )
        is False
    )
