"""GRPO with a vLLM rollout engine: a real vLLM server samples, the policy trains
(posttrain.rl.engine_rollout). The server is the suite's shared one (`vllm_server` in
tests/conftest.py), lent to the trainer as an engine it does not close; the trainer's own
lifecycle of an engine built by name ("vllm": started in `run_dir/vllm`, one server for the run,
stopped when `fit` ends) runs on the stand-in server (tests/_vllm_fake.py) in seconds.

Skipped without the vLLM venv (run scripts/vllm-up.sh, ~8 minutes), as
tests/policy/test_vllm_server.py is; that module covers the server itself (sampling settings,
log-probs against `Policy.logprobs`, the prefix cache after a sync, a failed sync).

The mismatch bound: fp32 sampled-token log-probs of vLLM agree with posttrain's teacher-forced
recomputation to ~5e-6 (docs/runbooks/vllm.md); with 20x margin |delta| < 1e-4 per token, so the
k3 KL, exp(d) - d - 1 ~ d^2 / 2, is below 5e-9. A server left on the previous weights would miss
it by orders of magnitude at lr 0.05 (tests/rl/test_rollout_engines.py shows a sampler with the
first weights at delta ~1.5 after one step).
"""

import math

import pytest
from _rl_helpers import toy_trainer
from _vllm_fake import fake_venv
from _vllm_helpers import SharedServerEngine
from _waits import WAIT_S, wait_for

from posttrain.policy import Policy
from posttrain.policy.vllm_process import group_alive
from posttrain.rl.lowbit_rollout import SAMPLER_METRICS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_grpo_trains_on_the_vllm_servers_samples(vllm_server):
    """The server starts on other weights than the policy's (`drawn_policy(0)`, or whatever the
    test before left): the trainer syncs a given engine before its first rollout."""
    policy = Policy.from_spec("tiny-1m", seed=0)
    engine = SharedServerEngine(vllm_server, version=7)
    trainer = toy_trainer(policy, rollout_engine=engine, lr=0.05)
    versions = []
    trainer.callbacks.append(
        lambda t, row: versions.append({x.policy_version for g in t.last_groups for x in g})
    )
    metrics = trainer.fit(3)
    assert versions == [{0}, {1}, {2}] and engine.version == 2
    assert set(SAMPLER_METRICS) <= set(metrics.columns)
    assert (metrics["rollout_logprob_delta_max"] < 1e-4).all(), metrics[list(SAMPLER_METRICS)]
    assert (metrics["rollout_kl_mean"] < 5e-9).all()
    assert all(math.isfinite(x) for x in metrics["loss"])
    assert not engine.closed and vllm_server.alive  # a given engine stays the caller's
    split = metrics[[f"weight_sync_{p}_s" for p in ("save", "reload", "reset")]]
    assert (metrics["weight_sync_s"] > 0).all()  # a given engine: synced before every rollout
    assert (split > 0).all().all() and (split.sum(axis=1) <= metrics["weight_sync_s"]).all()


def test_an_engine_built_by_name_starts_one_server_for_the_run_and_stops_it(tmp_path):
    """`rollout_engine="vllm"` on the stand-in server (`venv=` a fake vLLM venv): what is tested
    is the trainer starting and stopping a server it owns, which the shared server must not be."""
    policy = Policy.from_spec("tiny-1m", seed=0)
    # the stand-in's HTTP server queues 5 connections: 4 requests in flight at most
    options = {"venv": fake_venv(tmp_path / "venv"), "max_concurrency": 4}
    trainer = toy_trainer(
        policy, rollout_engine="vllm", run_dir=tmp_path / "run", rollout_options=options
    )
    seen, synced = [], []

    def record(t, row):
        server = t.rollout.engine.server
        seen.append(({x.policy_version for g in t.last_groups for x in g}, server.pgid))
        synced.append(row["weight_sync_s"])

    trainer.callbacks.append(record)
    trainer.fit(2)
    assert [versions for versions, _ in seen] == [{0}, {1}]
    assert synced[0] == 0.0 and synced[1] > 0  # the first rollout started the server
    assert (tmp_path / "run" / "vllm" / "server.log").is_file()
    pgid = seen[0][1]
    assert {p for _, p in seen} == {pgid}  # one server for the run
    assert trainer.rollout.engine is None
    wait_for(lambda: not group_alive(pgid), what=f"vLLM process group {pgid} gone", timeout=WAIT_S)
