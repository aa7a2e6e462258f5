"""posttrain.launch.submit with the "local" executor: job processes on this machine (a closure's
result, live metrics, a remote traceback, an unpicklable result, two tasks sharing a gloo
process group, arrays, attaching from another process, preemption and requeue with resume,
refusing a second launch into a running job's folder, cancel, and no traceback at exit).

A local job takes 1-6 s to start on a quiet 2-core machine (a minute or more beside busy
neighbours), so `local_runs` starts every local job of the module at once and the tests read
them, in any order and however late: the jobs a test acts on (`sleep_long`, `preemptible`) wait
for it, up to the generous JOB_S, and each wait names what it waited for. Tests against a real Slurm
cluster live elsewhere (fixture `slurm_cluster`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
from _launch_helpers import Cfg, times_ten
from _waits import wait_for

from posttrain.launch.submit import RUN_FILE, JobFailedError, Run, launch, launch_array

# As in a notebook: the jobs cannot import this test module, so its functions and classes travel
# by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEADLINE_S = 300.0  # for a local job to end: generous, the wait ends when the job does
JOB_S = 900.0  # how long the jobs a test acts on wait for it (they are cancelled at the end)
TIMEOUT_MIN = 20  # the jobs' time limit, above JOB_S


def boom(cfg):
    raise ValueError(f"boom {cfg['code']}")


def make_generator():
    return (i for i in range(3))


def all_reduce_rank():
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), dist.get_backend()


def sleep_long():
    """Like `Trainer.fit`, treats Ctrl-C as a clean stop and returns: a cancel must still end
    the job as CANCELLED, not let it finish (the recipe would go on to evaluate and save)."""
    print("sleeping", flush=True)
    try:
        time.sleep(JOB_S)
    except KeyboardInterrupt:
        time.sleep(0.2)  # e.g. a quick evaluation after fit returned
        return "stopped cleanly"


def preemptible(cfg):
    """Steps until Slurm's warning signal (USR2), then saves at the step boundary and lets
    submitit requeue; the requeued call has cfg.resume=True. Its pid appears (whole, by rename)
    only once it defers the signal, and it steps for up to JOB_S: a test that comes late still
    finds it stepping."""
    from posttrain.core import preemption

    out = Path(cfg.out_dir)
    if cfg.resume:
        return f"resumed after step {(out / 'saved').read_text()}"
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + JOB_S
    with preemption.deferring():
        (out / "pid.tmp").write_text(str(os.getpid()))
        os.replace(out / "pid.tmp", out / "pid")
        step = 0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            step += 1
            preemption.step_boundary(lambda step=step: (out / "saved").write_text(str(step)))
    return "never preempted"


def _wait_all(runs, timeout=DEADLINE_S):
    for run in runs:
        run.wait(timeout=timeout, poll_s=0.1)


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """Every local job of this module, started together."""
    tmp = tmp_path_factory.mktemp("launch")
    offset = 100  # captured by the closure below, which travels by value

    def train(cfg):
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "metrics.jsonl", "w") as f:
            for step in range(1, cfg.n + 1):
                f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
            f.write('{"step": 4, "lo')  # a row still being written
        print("train ran in", os.getpid(), flush=True)
        return {"total": cfg.n + offset, "resume": cfg.resume}

    limit = {"timeout_min": TIMEOUT_MIN}
    runs = {
        "ok": launch(train, Cfg(out_dir=str(tmp / "ok_out")), **limit),
        "fail": launch(boom, {"code": 1234}, folder=tmp / "fail", **limit),
        "generator": launch(make_generator, folder=tmp / "generator", **limit),
        "dist": launch(all_reduce_rank, folder=tmp / "dist", tasks_per_node=2, **limit),
        "sleep": launch(sleep_long, folder=tmp / "sleep", **limit),
        "preempt": launch(preemptible, Cfg(out_dir=str(tmp / "preempt_out")), **limit),
    }
    runs["array"] = launch_array(times_ten, [1, 2], folder=tmp / "array", **limit)
    runs["tmp"] = tmp
    yield runs
    for key in ("sleep", "preempt"):  # no-ops for jobs that have ended
        runs[key].cancel()


def test_local_job_runs_a_closure_and_returns(local_runs):
    run = local_runs["ok"]
    run.wait(timeout=DEADLINE_S, poll_s=0.1)
    assert run.result() == {"total": 103, "resume": False}
    assert run.state == "COMPLETED"
    assert run.folder == local_runs["tmp"] / "ok_out" / "launch"  # default: <out_dir>/launch
    assert (run.folder / RUN_FILE).exists() and not (run.folder / "%j").exists()
    assert "train ran in" in run.logs()
    # the submitted callable resubmits itself with resume=True on preemption
    assert run.job.submission().function.checkpoint().function.cfg.resume is True


def test_local_metrics_are_read_live(local_runs):
    run = local_runs["ok"]
    run.wait(timeout=DEADLINE_S, poll_s=0.1)
    frame = run.metrics()
    assert frame["step"].tolist() == [1, 2, 3]  # the half-written 4th row is left out
    assert frame["loss"].tolist() == pytest.approx([1.0, 0.5, 1 / 3])
    text = repr(run)
    assert "\n" not in text and f"job_id='{run.job_id}'" in text and "step=3" in text
    table = run._repr_html_()
    assert table.startswith("<table") and run.job_id in table and "0.3333" in table


def test_local_failure_surfaces_the_remote_traceback(local_runs):
    run = local_runs["fail"]
    with pytest.raises(JobFailedError) as info:
        run.result()
    message = str(info.value)
    assert "ValueError: boom 1234" in message and "in boom" in message
    assert f"{run.job_id}_0_log.err" in message
    assert run.state == "FAILED"


def test_unpicklable_result_names_its_type_and_leaves_no_temp_file(local_runs):
    run = local_runs["generator"]
    with pytest.raises(JobFailedError, match="returned a generator that cannot be pickled"):
        run.result()
    assert [p for p in run.folder.rglob("*") if "tmp" in p.name] == []


def test_local_two_tasks_share_a_gloo_process_group(local_runs):
    run = local_runs["dist"]
    assert run.results() == [(0, 2, 3.0, "gloo"), (1, 2, 3.0, "gloo")]
    assert run.result() == (0, 2, 3.0, "gloo")
    assert "joining a gloo process group" in run.logs(stream="stderr", task=1)


def test_local_array_and_attach(local_runs):
    runs = local_runs["array"]
    _wait_all(runs)
    assert [r.result() for r in runs] == [10, 20]
    with pytest.raises(ValueError, match="job array of 2 jobs"):
        Run.attach(runs[0].folder)
    assert [r.result() for r in Run.attach_array(runs[0].folder)] == [10, 20]


def test_attach_from_another_process(local_runs):
    run = local_runs["ok"]
    run.wait(timeout=DEADLINE_S, poll_s=0.1)
    code = (
        "import sys; from posttrain.launch.submit import Run; r = Run.attach(sys.argv[1]); "
        "print(r.job_id, r.state, r.result()['total'], len(r.metrics()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(local_runs["tmp"] / "ok_out")],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [run.job_id, "COMPLETED", "103", "3"]


def test_preempted_local_job_is_requeued_with_resume(local_runs):
    """USR2 (as Slurm sends before preemption) -> save at the step boundary -> checkpoint() ->
    requeue (the local controller starts the task again) -> target(cfg with resume=True)."""
    run = local_runs["preempt"]
    pid_file = local_runs["tmp"] / "preempt_out" / "pid"
    pid = wait_for(
        lambda: pid_file.exists() and int(pid_file.read_text()),
        what=f"job {run.job_id} to write {pid_file} (it defers USR2 from then on)",
        timeout=DEADLINE_S,
        detail=lambda: f"state {run.state}, log: {run.logs()}",
    )
    assert run.state == "RUNNING", run.logs(tail=None)
    os.kill(pid, signal.SIGUSR2)
    assert run.wait(timeout=DEADLINE_S, poll_s=0.1) == "COMPLETED", run.logs(tail=None)
    saved = (local_runs["tmp"] / "preempt_out" / "saved").read_text()
    assert run.result() == f"resumed after step {saved}"
    assert "Requeued job" in run.logs(tail=None)


def test_unresolvable_master_host_falls_back_to_loopback(caplog):
    from posttrain.launch.submit import _resolvable

    assert _resolvable("localhost") == "localhost"
    with caplog.at_level("WARNING"):
        assert _resolvable("n1.invalid") == "127.0.0.1"
    assert "does not resolve" in caplog.text


def test_a_second_launch_into_a_running_jobs_folder_is_refused(local_runs):
    """Launching again into the folder (here the out_dir's launch/) of a job that still runs
    would overwrite its run.json; a folder whose job has ended is reused."""
    run = local_runs["sleep"]
    record = (run.folder / RUN_FILE).read_text()
    with pytest.raises(ValueError, match=f"belongs to job {run.job_id} \\(RUNNING\\).*Cancel it"):
        launch(sleep_long, folder=run.folder, timeout_min=TIMEOUT_MIN)
    assert (run.folder / RUN_FILE).read_text() == record and not run.done()

    ended = local_runs["generator"]
    ended.wait(timeout=DEADLINE_S, poll_s=0.1)
    again = launch(times_ten, 5, folder=ended.folder, timeout_min=TIMEOUT_MIN)
    assert Run.attach(ended.folder).job_id == again.job_id != ended.job_id
    assert again.result() == 50


def test_cancel_stops_a_sleeping_local_job(local_runs):
    run = local_runs["sleep"]
    assert run.state == "RUNNING"
    with pytest.raises(TimeoutError, match=f"job {run.job_id} .* still RUNNING"):
        run.wait(timeout=0.2, poll_s=0.1)
    wait_for(
        lambda: "sleeping" in run.logs(),
        timeout=DEADLINE_S,
        poll_s=0.1,
        what=f"job {run.job_id} to print 'sleeping' (inside the function, where Ctrl-C "
        "would be caught)",
        detail=lambda: f"state {run.state}",
    )
    run.cancel()
    assert run.wait(timeout=DEADLINE_S, poll_s=0.1) == "CANCELLED"
    with pytest.raises(JobFailedError, match="ended in state CANCELLED without a result"):
        run.result()
    assert Run.attach(run.folder).state == "CANCELLED"


def test_a_local_run_alive_at_exit_prints_no_traceback(tmp_path):
    """A script that launches a local job and exits with the handle alive: submitit's
    LocalJob.__del__ used to print "Exception ignored ... TypeError" at interpreter exit."""
    script = (
        f"from posttrain.launch import launch\n"
        f"run = launch(abs, -3, executor='local', folder={str(tmp_path / 'l')!r})\n"
        f"assert run.result() == 3\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
