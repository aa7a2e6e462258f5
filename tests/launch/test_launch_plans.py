"""`launch` with a ParallelPlan: the plan is checked against the job (nodes x tasks_per_node) and
the model the cfg names before anything is submitted; a dp_shard=2 x tp=2 SFT job of 4 ranks
equals one process, and a job preempted under that plan is requeued and resumes bitwise.

The jobs: one "local" job of 4 processes (runs everywhere) and, when the local Slurm cluster is
up (scripts/slurm-up.sh; otherwise those tests skip), one Slurm job of 2 emulated nodes x 2
tasks, both started together by the `jobs` fixture. Each job runs `sharded_sft` (below): a
TINY SFT run under the plan in its out_dir (tests/parallel_plan_run.py `run_plan`: 17 rows,
batch 8 x accumulation 2, SGD with momentum, clipping active), which a watcher thread preempts
with Slurm's warning signal (USR2 to every task) once step 2 is logged. After the requeue the
job resumes that run from the checkpoint taken at the signal, then runs the same 10 steps
uninterrupted. About 50-100 s with both jobs on a loaded 2-core machine (30-50 s for the local
job alone), most of it process start-up, twice per job (before and after the requeue).

Tolerances against one process, over the 10 steps: per-step losses 2e-6, relative to the loss
where that exceeds 1 (losses are ~5.6, where one float32 step is 4.8e-7; seen: 4.8e-7), weights
1e-6 (seen: 1.2e-7), gradient norms 2e-6 relative (seen: 1.9e-6 absolute on norms of 1-4, i.e.
6e-7 relative: a few float32 ulps that grow over 10 steps); the resumed run against the
uninterrupted one under the same plan: bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _train_helpers
import cloudpickle
import parallel_plan_run as worker
import pytest
import torch
from _train_helpers import TINY, last_step

from posttrain.launch import RUN_FILE, Run, launch, launch_array
from posttrain.launch.plans import plan_of, resolve_plan, spec_of
from posttrain.models import ModelSpec
from posttrain.train import ParallelPlan
from posttrain.workflows import ModelConfig
from posttrain.workflows.parallel import plan_of as workflow_plan_of

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# The jobs cannot import these test modules: their functions travel by value.
for _module in (sys.modules[__name__], worker, _train_helpers):
    cloudpickle.register_pickle_by_value(_module)

PLAN = ParallelPlan(dp_shard=2, tp=2)
LOSS_TOL, SGD_WEIGHT_ATOL, GRAD_NORM_RTOL = 2e-6, 1e-6, 2e-6
PREEMPT_AFTER_STEP = 2
DEADLINE_S = 600.0  # for a job to end (generous: the wait ends when the job does); fails the
# test, never skips it


@dataclasses.dataclass(kw_only=True)
class PlanJob:
    """The job's config: `launch` finds the plan in `plan` and the model in `model`."""

    out_dir: str
    plan: ParallelPlan | None = None
    model: ModelSpec = TINY
    steps: int = 10
    resume: bool = False


def sharded_sft(cfg: PlanJob) -> dict:
    """One rank of the job (the process group is up): the preemptible run in `cfg.out_dir`
    (resumed from its checkpoint when `cfg.resume`), then the same run uninterrupted. Returns
    this rank's losses of both, the full weights and step statistics of the uninterrupted one
    (compared with one process), the checkpoints found when it started, and its peak RSS in
    MiB."""
    torch.set_num_threads(1)
    rank, out = torch.distributed.get_rank(), Path(cfg.out_dir)
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / str(rank)).write_text(str(os.getpid()))  # the local watcher signals these
    found = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    preempted = worker.run_plan(
        cfg.plan, cfg.model, steps=cfg.steps, run_dir=out, resume=cfg.resume
    )
    uninterrupted = worker.run_plan(cfg.plan, cfg.model, steps=cfg.steps)
    return {
        "rank": rank,
        "resumed": cfg.resume,
        "found": found,
        "rows": preempted["trainer"].metrics["step"].tolist(),
        "preempted": preempted["losses"],
        "uninterrupted": {
            k: uninterrupted[k] for k in ("losses", "trained_tokens", "grad_norms", "params")
        },
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---------------------------------------------------------------------- the jobs


def _preempt(run: Run, send, record: dict, stop: threading.Event) -> None:
    """Watcher thread: once `run` has logged step PREEMPT_AFTER_STEP, `send(run)` the warning
    signal; `record` gets the step seen (or an error)."""
    deadline = time.monotonic() + DEADLINE_S
    while not stop.is_set() and time.monotonic() < deadline:
        seen = last_step(run.out_dir)
        if seen >= PREEMPT_AFTER_STEP:
            record["step_seen"] = seen
            try:
                send(run)
            except Exception as e:  # noqa: BLE001 - reported by the test
                record["error"] = f"sending the signal failed: {e!r}"
            return
        stop.wait(0.05)
    record["error"] = f"job {run.job_id} never logged step {PREEMPT_AFTER_STEP}"


def _signal_local_tasks(run: Run) -> None:
    """USR2 to every task, as Slurm sends it to every task of a job."""
    for pid_file in sorted((run.out_dir / "pids").iterdir()):
        os.kill(int(pid_file.read_text()), signal.SIGUSR2)


def _signal_slurm_job(run: Run) -> None:
    subprocess.run(
        ["scancel", "--signal=USR2", run.job_id], check=True, capture_output=True, timeout=60
    )


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The local job and (when the cluster is up) the Slurm job, started together, each with a
    watcher thread that preempts it after step 2."""
    tmp = tmp_path_factory.mktemp("launch_plans")
    try:
        cluster = request.getfixturevalue("slurm_cluster")
    except pytest.skip.Exception:
        cluster = None
    runs = {
        "local": launch(
            sharded_sft,
            PlanJob(out_dir=str(tmp / "local"), plan=PLAN),
            tasks_per_node=4,
            timeout_min=5,
        )
    }
    sends = {"local": _signal_local_tasks}
    if cluster is not None:
        runs["slurm"] = launch(
            sharded_sft,
            PlanJob(out_dir=str(tmp / "slurm"), plan=PLAN),
            executor="slurm",
            partition=cluster.partition,
            nodes=2,
            tasks_per_node=2,
            timeout_min=10,
            slurm_kwargs={"setup": ["export OMP_NUM_THREADS=1"]},
        )
        sends["slurm"] = _signal_slurm_job
    stop, records, watchers = threading.Event(), {}, []
    for key, run in runs.items():
        records[key] = {}
        watchers.append(
            threading.Thread(
                target=_preempt, daemon=True, args=(run, sends[key], records[key], stop)
            )
        )
        watchers[-1].start()
    yield {"runs": runs, "records": records}
    stop.set()
    for watcher in watchers:
        watcher.join(timeout=10)
    for run in runs.values():
        if not run.done():
            run.cancel()


def _results(jobs, executor: str) -> tuple[Run, list[dict]]:
    if executor not in jobs["runs"]:
        from _waits import SKIP_NO_SLURM

        pytest.skip(SKIP_NO_SLURM)
    run = jobs["runs"][executor]
    run.wait(timeout=DEADLINE_S, poll_s=0.2)
    record = jobs["records"][executor]
    assert "error" not in record, record["error"]
    return run, run.results()


_SINGLE: dict = {}


def _single_process() -> dict:
    if not _SINGLE:
        _SINGLE.update(worker.run_plan(None, TINY, steps=PlanJob(out_dir="-").steps))
    return _SINGLE


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


EXECUTORS = ["local", pytest.param("slurm", marks=pytest.mark.slurm)]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_dp_shard_x_tp_job_equals_one_process(jobs, executor):
    """dp_shard=2 x tp=2 on 4 ranks (local: one node; Slurm: 2 nodes x 2 tasks, each tp pair
    on one node) == one process on the same global batch."""
    run, results = _results(jobs, executor)
    single = _single_process()
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        sharded = r["uninterrupted"]
        assert sharded["trained_tokens"] == single["trained_tokens"]
        worst = max(
            abs(a - b) / max(1.0, abs(b))
            for a, b in zip(sharded["losses"], single["losses"], strict=True)
        )
        assert worst <= LOSS_TOL, (
            f"rank {r['rank']}: losses differ by up to {worst:.3g} "
            "(relative where the loss exceeds 1)"
        )
        assert sharded["grad_norms"] == pytest.approx(single["grad_norms"], rel=GRAD_NORM_RTOL)
        assert _max_diff(sharded["params"], single["params"]) <= SGD_WEIGHT_ATOL
    assert run.plan == PLAN
    if executor == "slurm":
        out = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-j", run.job_id, "-o", "NodeList"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
        assert out and out[-1] == "n[1-2]"


@pytest.mark.parametrize("executor", EXECUTORS)
def test_preempted_sharded_job_is_requeued_and_resumes_bitwise(jobs, executor):
    """USR2 to every task after step >= 2 -> the ranks agree, finish the step and save one
    sharded checkpoint -> rank 0 requeues the job, the other ranks leave without a result ->
    the job runs again with resume=True: every rank's losses equal the uninterrupted run's."""
    run, results = _results(jobs, executor)
    seen = jobs["records"][executor]["step_seen"]
    steps = PlanJob(out_dir="-").steps
    for r in results:
        assert r["resumed"] is True, "the job was not requeued with resume=True"
        assert len(r["found"]) == 1 and seen <= int(r["found"][0].split("_")[1]) < steps
        assert r["rows"] == list(range(1, steps + 1))
        assert r["preempted"] == r["uninterrupted"]["losses"]  # bitwise
    log = run.logs(tail=None)
    # two starts of the same job (the requeue itself is `resumed` above); submitit's own
    # "Requeued job" line is not asserted: the first attempt is killed right after writing it,
    # and on a loaded machine the line was missing from the log while the requeue had happened
    assert log.count("Starting with JobEnvironment") == 2
    for task in (1, 2, 3):
        assert "leaves after the preemption signal" in run.logs(
            tail=None, stream="stderr", task=task
        )
    assert run.state == "COMPLETED"


def test_launch_records_the_plan_and_attach_gives_it_back(jobs):
    run = jobs["runs"]["local"]
    run.wait(timeout=DEADLINE_S, poll_s=0.2)
    record = json.loads((run.folder / RUN_FILE).read_text())
    assert record["jobs"][0]["plan"] == PLAN.to_dict()
    again = Run.attach(run.folder)
    assert again.plan == PLAN and "<td>ParallelPlan(dp_shard=2, tp=2)</td>" in again._repr_html_()


# ---------------------------------------------------------------------- checks before submitting


@pytest.mark.parametrize(
    "executor, nodes, tasks, match",
    [
        (
            "local",
            1,
            2,
            r"cfg\.plan=ParallelPlan\(dp_shard=2, tp=2\) needs 4 ranks .* nodes=1 x "
            r"tasks_per_node=2 = 2 ranks; the axes must multiply to 2 \(e\.g\. dp_shard=1 "
            r"with the other axes as they are\), or launch nodes x tasks_per_node = 4",
        ),
        (
            "slurm",
            2,
            4,
            r"must multiply to 8 \(e\.g\. dp_shard=4 with the other axes as they are\)",
        ),
    ],
)
def test_a_plan_that_does_not_multiply_to_the_world_size_is_refused(
    tmp_path, executor, nodes, tasks, match
):
    cfg = PlanJob(out_dir=str(tmp_path / "out"), plan=PLAN)
    with pytest.raises(ValueError, match=match):
        launch(sharded_sft, cfg, executor=executor, nodes=nodes, tasks_per_node=tasks)
    assert not any(tmp_path.iterdir())  # no out_dir, no launch folder


@pytest.mark.parametrize(
    "plan, tasks, match",
    [
        (
            ParallelPlan(tp=3),
            3,
            r"cfg\.plan\.tp=3 must divide num_heads=4 and num_kv_heads=2 of the "
            r"model \(cfg\.model\); allowed tp: 1, 2",
        ),
        (
            ParallelPlan(pp=3),
            3,
            r"cfg\.plan\.pp=3 exceeds the model's num_layers=2; allowed pp: 1\.\.2",
        ),
        (ParallelPlan(ep=2), 2, r"cfg\.plan\.ep=2 needs a model with experts.*allowed ep: 1"),
    ],
)
def test_a_plan_that_does_not_fit_the_model_is_refused(tmp_path, plan, tasks, match):
    with pytest.raises(ValueError, match=match):
        launch(
            sharded_sft,
            PlanJob(out_dir=str(tmp_path / "out"), plan=plan),
            tasks_per_node=tasks,
            folder=tmp_path / "launch",
        )
    assert not any(tmp_path.iterdir())


@dataclasses.dataclass(kw_only=True)
class RecipeLike:
    """A recipe-style Config: a `parallel` section and a `model` section naming a preset."""

    parallel: dict | None = None
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    out_dir: str = "runs/never"
    resume: bool = False


def test_a_recipe_section_is_read_and_errors_name_its_dotted_field(tmp_path):
    cfg = RecipeLike(parallel={"dp_shard": 2, "tp": 8}, out_dir=str(tmp_path / "out"))
    with pytest.raises(
        ValueError,
        match=r"cfg\.parallel\.tp=8 must divide num_heads=4 and "
        r"num_kv_heads=2 of the model \(cfg\.model\.name="
        r"'tiny-1m'\); allowed tp: 1, 2",
    ):
        launch(print, cfg, tasks_per_node=16, executor="slurm")
    with pytest.raises(ValueError, match=r"cfg\.parallel\.tp=0; must be an integer >= 1"):
        launch(print, RecipeLike(parallel={"tp": 0}), executor="debug")
    with pytest.raises(
        ValueError,
        match=r"cfg\['plan'\] has unknown plan field\(s\) tpp; "
        r"allowed: dp_replicate, dp_shard, tp",
    ):
        launch(print, {"plan": {"tpp": 2}}, executor="debug")
    assert not any(tmp_path.iterdir())


def test_plan_keyword_goes_into_the_cfg_or_is_refused(tmp_path):
    def job_plan(cfg):
        return cfg.parallel

    one_rank = ParallelPlan()
    run = launch(job_plan, RecipeLike(), plan=one_rank, executor="debug")
    assert run.result() == one_rank and run.plan == one_rank
    with pytest.raises(
        ValueError,
        match=r"plan=ParallelPlan\(tp=2\) needs a cfg with a plan or "
        r"parallel field .* got a dict without one",
    ):
        launch(
            print, {"lr": 1e-3}, plan=ParallelPlan(tp=2), tasks_per_node=2, folder=tmp_path / "a"
        )
    with pytest.raises(
        ValueError,
        match=r"plan=ParallelPlan\(dp_shard=2\) and cfg\.plan="
        r"ParallelPlan\(tp=2\) disagree",
    ):
        launch(
            print,
            PlanJob(out_dir="x", plan=ParallelPlan(tp=2)),
            tasks_per_node=2,
            plan=ParallelPlan(dp_shard=2),
            folder=tmp_path / "b",
        )
    with pytest.raises(ValueError, match=r"plan\.tp=4 must divide num_heads=4 and num_kv_heads=2"):
        launch(
            print,
            PlanJob(out_dir="x"),
            plan=ParallelPlan(tp=4),
            tasks_per_node=4,
            folder=tmp_path / "c",
        )
    with pytest.raises(TypeError, match="must be a posttrain.train.ParallelPlan"):
        launch(print, PlanJob(out_dir="x"), plan={"tp": 2}, folder=tmp_path / "d")
    assert not any(tmp_path.iterdir())


def test_a_sweep_checks_every_cfg_and_names_the_bad_one(tmp_path):
    cfgs = [
        PlanJob(out_dir=str(tmp_path / "a"), plan=PLAN),
        PlanJob(out_dir=str(tmp_path / "b"), plan=ParallelPlan(dp_shard=2, tp=4)),
    ]
    with pytest.raises(
        ValueError,
        match=r"cfgs\[1\]: cfg\.plan=ParallelPlan\(dp_shard=2, "
        r"tp=4\) needs 8 ranks.*= 4 ranks",
    ):
        launch_array(sharded_sft, cfgs, tasks_per_node=4, folder=tmp_path / "sweep")
    assert not any(tmp_path.iterdir())


def test_the_rule_for_finding_a_plan_and_a_spec():
    @dataclasses.dataclass(kw_only=True)
    class Section:  # a recipe section with the plan's axis fields
        dp_shard: int = 1
        tp: int = 1

    class Converts:
        def to_plan(self):
            return ParallelPlan(tp=2)

    assert plan_of({"parallel": Section(dp_shard=2, tp=2)}) == ("cfg['parallel']", PLAN)
    assert plan_of({"plan": Converts()})[1] == ParallelPlan(tp=2)
    assert plan_of({"plan": None, "parallel": PLAN}) == ("cfg['parallel']", PLAN)
    assert plan_of({"lr": 1.0}) == (None, None) and plan_of(42) == (None, None)
    with pytest.raises(ValueError, match=r"cfg\['plan'\] and cfg\['parallel'\] both hold a plan"):
        plan_of({"plan": PLAN, "parallel": PLAN})
    with pytest.raises(ValueError, match=r"cfg\['plan'\] holds a str"):
        plan_of({"plan": "dp_shard=2"})
    assert spec_of({"model": "tiny-1m"})[0] == "cfg['model']='tiny-1m'"
    assert spec_of({"model": {"name": "tiny-1m"}})[0] == "cfg['model'].name='tiny-1m'"
    assert spec_of(PlanJob(out_dir="x")) == ("cfg.model", TINY)
    assert spec_of({"model": ModelConfig(name="no-such-preset")}) == (None, None)
    # a plan at its defaults is no plan: plain data-parallel replicas over any number of ranks
    cfg = PlanJob(out_dir="x", plan=ParallelPlan())
    assert resolve_plan(cfg, None, nodes=2, tasks_per_node=4) == (cfg, ParallelPlan())
    # any other plan of one rank is a plan, as a recipe reads it (workflows.plan_of): it needs a
    # job of one rank, refused before submitting (each task's check_world_size would refuse it)
    bf16 = ParallelPlan(param_dtype="bfloat16")
    assert workflow_plan_of(RecipeLike(parallel=bf16)) == bf16
    assert workflow_plan_of(RecipeLike(parallel=ParallelPlan())) is None
    one = PlanJob(out_dir="x", plan=bf16)
    assert resolve_plan(one, None, nodes=1, tasks_per_node=1) == (one, bf16)
    with pytest.raises(ValueError, match=r"cfg\.plan=.*needs 1 ranks .* = 2 ranks"):
        resolve_plan(one, None, nodes=1, tasks_per_node=2)
    # the plan keyword fills a section of the cfg's own type
    filled, plan = resolve_plan({"parallel": Section()}, PLAN, nodes=1, tasks_per_node=4)
    assert filled["parallel"] == Section(dp_shard=2, tp=2) and plan == PLAN


def test_a_plan_whose_memory_floor_cannot_fit_this_machine_is_refused(tmp_path, monkeypatch):
    """qwen2.5-0.5b under dp_shard=2: about 4 GiB of parameters, gradients and AdamW state per
    rank, on a machine that offers each of its 2 ranks 1 GiB: refused before submitting."""
    import posttrain.train.memory_plan as memory_plan
    from posttrain.models import get_preset

    monkeypatch.setattr(memory_plan, "device_memory_bytes", lambda: 2 * 2**30)
    cfg = PlanJob(
        out_dir=str(tmp_path / "out"),
        plan=ParallelPlan(dp_shard=2),
        model=get_preset("qwen2.5-0.5b"),
    )
    with pytest.raises(ValueError, match=r"the device has 1\.0 GiB.*raise dp_shard") as info:
        launch(sharded_sft, cfg, tasks_per_node=2, folder=tmp_path / "launch")
    assert "a batch of one token" in str(info.value)
    assert not any(tmp_path.iterdir())
