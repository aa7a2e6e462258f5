"""The judge server under load and as a job: a small load run (benchmarks/judge_load.py
--quick) loses and duplicates no response, a server run as a local job and killed in the middle
of an RL run fails only the step it missed and serves again once restarted on its port, and the
same server as a job on the real local Slurm cluster. The judge is `rm_judge`
(tests/rewards/conftest.py); every deadline that is not the thing tested is generous."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch
from _judge_helpers import HTTP_TIMEOUT_S, ITEM, scores
from _ranks import run_script

from posttrain.envs import JudgedGroupBuilder, chain_sum_task
from posttrain.launch.judge import launch_judge
from posttrain.policy import Policy
from posttrain.rewards.judge_client import JudgeClient
from posttrain.rl import RLAlgorithm, RLTrainer

ROOT = Path(__file__).resolve().parents[2]

# The jobs cannot import this test module: whatever of it they get travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_small_load_and_limits_runs_lose_and_duplicate_nothing(tmp_path):
    script = ROOT / "benchmarks" / "judge_load.py"
    proc = run_script(script, ["--quick", "--json"], tmp_path, timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    [line] = [x for x in lines if "limits" not in x]
    assert line["lost"] == 0 and line["duplicated"] == 0 and line["wrong"] == 0
    assert sum(line["batch_requests"].values()) == line["batches"]
    assert sum(int(k) * v for k, v in line["batch_requests"].items()) == 48  # every request
    assert max(int(k) for k in line["batch_requests"]) > 1  # batched
    assert line["rejected_429"] > 0  # and retried
    limits = {x["limits"]["case"]: x["limits"] for x in lines if "limits" in x}
    assert limits["1.2 MB body, default limits"]["status"] == 413
    assert limits["1.2 MB body, limits raised"]["status"] in (200, 504)  # parsed and queued
    assert limits["2,000 completions, default cap"]["status"] == 422
    gone = limits["2,000 completions, cap raised, deadline 0.5 s"]
    assert gone["accounted"]  # every completion judged once or dropped, none lost
    assert {
        limits[f"small request (8) {when} the big one"]["outcome"] for when in ("during", "after")
    } == {"judged"}


def test_killing_and_restarting_the_server_mid_run(rm_judge, tmp_path):
    """The judge server runs as a local job. After step 2 it is killed (SIGKILL, no drain);
    step 3 is judged by nobody: both its groups are excluded and counted; after step 3 it is
    restarted on the same port; steps 4-5 are judged again. Every step is recorded, and every
    kept trajectory's reward is the in-process judge's score of its text."""
    job = launch_judge(rm_judge, folder=tmp_path / "judge", max_wait_s=0.002)
    url = job.url
    port = int(url.rsplit(":", 1)[1])
    client = JudgeClient(url, timeout_s=HTTP_TIMEOUT_S, retries=2, backoff_s=0.05)
    task = chain_sum_task(
        size=32, held_out_size=2, builder=functools.partial(JudgedGroupBuilder, judge=client)
    )
    jobs, seen = [job], {}

    def chaos(trainer, row):
        seen[row["step"]] = [list(g) for g in trainer.last_groups]
        if row["step"] == 2:
            jobs[-1].kill()
        if row["step"] == 3:
            jobs.append(
                launch_judge(rm_judge, folder=tmp_path / "judge", port=port, max_wait_s=0.002)
            )
            assert jobs[-1].url == url

    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-3),
        task=task,
        algo=RLAlgorithm.grpo(group_size=4, kl_coef=0.0),
        prompts_per_step=2,
        max_new_tokens=4,
        progress=False,
        callbacks=[chaos],
    )
    try:
        metrics = trainer.fit(5)
    finally:
        for j in jobs:
            j.kill()
    assert list(metrics["step"]) == [1, 2, 3, 4, 5] and trainer.step_count == 5
    assert list(metrics["groups_excluded_error"]) == [0, 0, 2, 0, 0]
    assert list(metrics["outcome_error"]) == [0, 0, 8, 0, 0]
    assert list(metrics["groups_kept"]) == [2, 2, 0, 2, 2]
    assert all(math.isfinite(v) for v in metrics["loss"][[0, 1, 3, 4]])
    for t in (t for g in seen[3] for t in g):
        assert t.outcome == "error" and "judge server at" in t.info["verifier_reason"]
    for step in (1, 2, 4, 5):
        items = task.builders(step - 1, 2)
        for group, builder in zip(seen[step], items):
            local = rm_judge.judge([t.text for t in group], [builder.item] * 4)
            assert [t.reward for t in group] == pytest.approx(scores(local), abs=1e-5)
    assert jobs[0].run.state == "CANCELLED" and "<table>" in jobs[0]._repr_html_()


@pytest.mark.slurm
def test_judge_server_as_a_slurm_job(slurm_cluster, rm_judge, tmp_path):
    job = launch_judge(
        rm_judge,
        executor="slurm",
        folder=tmp_path / "slurm-judge",
        partition=slurm_cluster.partition,
        timeout_min=10,
    )
    try:
        url = job.wait_ready(timeout_s=240)
        results = JudgeClient(url, timeout_s=HTTP_TIMEOUT_S).judge(["12", "13"], [ITEM] * 2)
        local = rm_judge.judge(["12", "13"], [ITEM] * 2)
        assert scores(results) == pytest.approx(scores(local), abs=1e-5)
        final = job.stop(timeout_s=240)
    finally:
        job.kill()
    assert final["requests"] == 1 and job.run.state == "COMPLETED"
