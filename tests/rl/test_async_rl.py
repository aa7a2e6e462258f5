"""AsyncRLTrainer on one Ray node for the module (`ray_cluster()`, started with its generous
start_timeout_s): with staleness 0 the run equals the synchronous RLTrainer bitwise (groups and
weights); with staleness 1 no consumed group lags the trainer by more than one version, and
rollout k+1 samples with the weights of version k. A run SIGKILLed after a checkpoint and
resumed equals an uninterrupted run bitwise, at staleness 0 and 1 (at 1 the checkpoint holds the
rollout sampled ahead, with its weights version)."""

import json
import os
from pathlib import Path

import async_rl_resume_run as resume_run
import pytest
import torch
from _ranks import ScriptProcess, start_script
from _run_helpers import finish, kill_after
from _train_helpers import assert_bitwise_equal

from posttrain.core import latest_checkpoint, load_checkpoint, read_metrics
from posttrain.envs import chain_sum_task
from posttrain.launch.ray_cluster import ray_cluster
from posttrain.policy import Policy
from posttrain.rl import RLAlgorithm, RLTrainer, collect_groups
from posttrain.rl.async_rl import AsyncRLTrainer, RolloutWorker, rollout_schedule, step_seed

ray = pytest.importorskip("ray")

STEPS = 3
SCRIPT = Path(resume_run.__file__)


@pytest.fixture(scope="module")
def ray_session():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # driver and workers (which copy it): no oversubscribed cores
    try:
        with ray_cluster(num_cpus_per_node=2) as cluster:
            yield cluster
    finally:
        torch.set_num_threads(threads)


def _trainer(**overrides):
    policy = Policy.from_spec("tiny-1m", seed=0)
    options = dict(
        task=chain_sum_task(size=32, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.0),
        prompts_per_step=2,
        max_new_tokens=4,
        progress=False,
        seed=3,
    )
    options.update(overrides)
    return RLTrainer(policy, torch.optim.AdamW(policy.model.parameters(), lr=1e-2), **options)


def _tokens(groups):
    return [(t.completion_ids, t.logprobs, t.reward) for g in groups for t in g]


def test_rollout_schedule_by_hand():
    """s = 0: rollout j uses version j; s = 1: versions 0, 0, 1, 2; s = 2 from version 5."""
    assert [v for _, v, _ in rollout_schedule(3, max_staleness=0)] == [0, 1, 2]
    assert [v for _, v, _ in rollout_schedule(4, max_staleness=1)] == [0, 0, 1, 2]
    assert rollout_schedule(3, max_staleness=2, start=5) == [(5, 5, 5), (6, 5, 6), (7, 5, 7)]
    assert step_seed(3, 2) == 3_000_011
    with pytest.raises(ValueError, match="max_staleness"):
        rollout_schedule(2, max_staleness=-1)


def test_worker_in_process_loads_weights_and_version():
    worker = RolloutWorker(Policy.from_spec("tiny-1m", seed=1), version=0)
    state = Policy.from_spec("tiny-1m", seed=0).model.state_dict()
    assert worker.load_weights(state, 4) == 4
    builders = chain_sum_task(size=8, held_out_size=2).builders(0, 1)
    groups, version, _ = worker.collect(builders, 7, dict(group_size=2, max_new_tokens=2))
    assert version == 4 and {t.policy_version for g in groups for t in g} == {4}
    assert all(
        torch.equal(a, b) for a, b in zip(worker.policy.model.state_dict().values(), state.values())
    )


def test_workers_run_at_the_drivers_priority(ray_session):
    """Ray's default worker niceness (+15) starves rollout workers beside any process at the
    default priority; the cluster starts them at the niceness of the process that started it
    (`os.nice(0)` reads a process's niceness)."""
    worker = ray.remote(RolloutWorker).remote(Policy.from_spec("tiny-1m", seed=0), version=0)
    assert ray.get(worker.__ray_call__.remote(lambda self: os.nice(0))) == os.nice(0)
    ray.kill(worker)


def test_bad_options_are_refused(ray_session):
    with pytest.raises(TypeError, match="RLTrainer"):
        AsyncRLTrainer(object())
    trainer = _trainer()
    with pytest.raises(ValueError, match="max_staleness"):
        AsyncRLTrainer(trainer, max_staleness=-1)
    with pytest.raises(ValueError, match="num_workers"):
        AsyncRLTrainer(trainer, num_workers=0)
    with pytest.raises(ValueError, match="worker_num_cpus"):
        AsyncRLTrainer(trainer, worker_num_cpus=0)
    with pytest.raises(ValueError, match="exceeds the 2 CPUs"):
        AsyncRLTrainer(trainer, num_workers=3)


def test_staleness_zero_equals_synchronous_trainer_bitwise(ray_session):
    sync = _trainer()
    sync_groups = []
    for _ in range(STEPS):
        sync.step()
        sync_groups.append(_tokens(sync.last_groups))
    trainer = _trainer()
    runner = AsyncRLTrainer(trainer, max_staleness=0, num_workers=2)
    rows, async_groups = [], []
    try:
        for _ in range(STEPS):
            rows.append(runner.step())
            async_groups.append(_tokens(trainer.last_groups))
    finally:
        runner.close()
    assert async_groups == sync_groups
    assert [r["policy_version"] for r in rows] == [0, 1, 2]
    assert [r["staleness"] for r in rows] == [0, 0, 0]
    for (name, a), b in zip(
        sync.policy.model.state_dict().items(), trainer.policy.model.state_dict().values()
    ):
        assert torch.equal(a, b), name
    # the weights moved (the equality is not that of two untouched models)
    fresh = Policy.from_spec("tiny-1m", seed=0).model.state_dict()
    assert any(not torch.equal(fresh[k], v) for k, v in trainer.policy.model.state_dict().items())


def test_staleness_one_never_trains_on_older_groups(ray_session):
    trainer = _trainer()
    initial = Policy.from_spec("tiny-1m", seed=0)
    runner = AsyncRLTrainer(trainer, max_staleness=1)
    rows, groups = [], []
    try:
        for _ in range(4):
            rows.append(runner.step())
            groups.append(_tokens(trainer.last_groups))
    finally:
        runner.close()
    # step 1 was sampled with the untrained weights (version 0), while update 0 ran
    expected = collect_groups(
        initial,
        trainer.task.builders(1, 2),
        group_size=2,
        max_new_tokens=4,
        seed=step_seed(3, 1),
        policy_version=0,
    )
    assert groups[1] == _tokens(expected)
    lags = [c["trainer_version"] - c["policy_version"] for c in runner.consumed]
    assert len(lags) == 4 * 2 and max(lags) <= 1
    versions = [(c["step"], c["policy_version"]) for c in runner.consumed[::2]]
    assert versions == [(0, 0), (1, 0), (2, 1), (3, 2)]  # one step off after the first
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    stats = trainer.buffer.stats()
    assert stats["rejected_stale"] == 0 and stats["evicted_stale"] == 0
    assert trainer.step_count == 4


def test_a_resumed_checkpoint_with_more_lag_than_the_bound_is_refused(ray_session, tmp_path):
    """A checkpoint of a one-step-off run holds the rollout of step 2 sampled with version 1;
    resuming it with max_staleness=0 names the setting and the value that would take it."""
    trainer = _trainer(run_dir=tmp_path, checkpoint_every=2)
    runner = AsyncRLTrainer(trainer, max_staleness=1)
    try:
        runner.fit(2)
    finally:
        runner.close()
    ahead = load_checkpoint(latest_checkpoint(tmp_path))["train_state"]["ahead"]
    assert [(r["step"], r["policy_version"]) for r in ahead["rollouts"]] == [(2, 1)]
    resumed = _trainer(run_dir=tmp_path, resume=True)
    assert resumed.step_count == 2 and resumed.buffer.max_staleness == 1
    with pytest.raises(
        ValueError,
        match=r"rollout of step 2 sampled with policy version 1 .*"
        r"max_staleness=0 would refuse it: resume with "
        r"max_staleness >= 1",
    ):
        AsyncRLTrainer(resumed, max_staleness=0)


# ------------------------------------------------------------------- SIGKILL and resume (process)


def _start(run_dir: Path, cluster, staleness: int, *args: str) -> ScriptProcess:
    """`python async_rl_resume_run.py RUN_DIR ...`, its output in RUN_DIR-<args>.log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # the Ray token too
    argv = [str(run_dir), "--address", cluster.address, "--staleness", str(staleness), *args]
    log = run_dir.parent / "-".join([run_dir.name, *args, "log"])
    return start_script(SCRIPT, argv, env, os.getcwd(), log)


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_resume_equals_an_uninterrupted_run(ray_session, tmp_path):
    """6 steps, a checkpoint every 2; killed after step 3, so the run resumes from step 2 and
    redoes step 3. At staleness 1 the checkpoint holds rollout 2, sampled with version 1 while
    update 1 ran; the resumed run trains on it, not on a new rollout with version 2. Both
    staleness values end bitwise equal to an uninterrupted run: the groups trained on at every
    step, the weights, the losses and the consumed versions."""
    runs = {s: (tmp_path / f"ref{s}", tmp_path / f"kill{s}") for s in (0, 1)}
    killed = {
        s: _start(kill, ray_session, s, "--pause-after", "3") for s, (_, kill) in runs.items()
    }
    # the uninterrupted references run here, on this module's Ray session, meanwhile
    for s, (ref, _) in runs.items():
        resume_run.run(ref, s)
    for s, (_ref, kill) in runs.items():
        kill_after(killed[s], kill, 3)
        checkpoint = latest_checkpoint(kill)
        assert checkpoint.name == "step_000002"
        ahead = load_checkpoint(checkpoint)["train_state"]["ahead"]
        assert [(r["step"], r["policy_version"]) for r in ahead["rollouts"]] == (
            [] if s == 0 else [(2, 1)]
        )
    resumed = {s: _start(kill, ray_session, s, "--resume") for s, (_, kill) in runs.items()}
    for s, (ref, kill) in runs.items():
        assert "starting at step 2" in finish(resumed[s])
        for step in range(1, 7):
            name = f"groups/step_{step}.json"
            assert json.loads((kill / name).read_text()) == json.loads((ref / name).read_text()), (
                s,
                step,
            )
        versions = [g[3] for g in json.loads((kill / "groups/step_3.json").read_text())]
        assert set(versions) == {2 - s}  # update 3 trained on rollout 2, of version 2 - s
        assert_bitwise_equal(
            torch.load(kill / "final.pt", weights_only=True),
            torch.load(ref / "final.pt", weights_only=True),
        )
        assert json.loads((kill / "consumed.json").read_text()) == json.loads(
            (ref / "consumed.json").read_text()
        )
        rows, expected = read_metrics(kill), read_metrics(ref)
        assert rows["step"].tolist() == list(range(1, 7))
        for column in ("loss", "reward_mean", "grad_norm", "lr"):
            assert rows[column].equals(expected[column]), (s, column)
