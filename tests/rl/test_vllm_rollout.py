"""GRPO with `rollout_engine="vllm"`: a real vLLM server samples, the policy trains
(posttrain.rl.engine_rollout). One server, started by the trainer from the policy; ~2 minutes on
a loaded 2-core machine, mostly its imports.

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
from _waits import WAIT_S, wait_for

from posttrain.policy import Policy
from posttrain.policy.vllm_process import group_alive
from posttrain.policy.vllm_server import vllm_unavailable_reason
from posttrain.rl.lowbit_rollout import SAMPLER_METRICS

REASON = vllm_unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


def test_grpo_trains_on_the_vllm_servers_samples_and_stops_it(tmp_path):
    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = toy_trainer(policy, rollout_engine="vllm", run_dir=tmp_path / "run", lr=0.05)
    seen = []

    def record(t, row):
        server = t.rollout.engine.server
        seen.append(({x.policy_version for g in t.last_groups for x in g}, server.pgid))

    trainer.callbacks.append(record)
    metrics = trainer.fit(3)
    assert [versions for versions, _ in seen] == [{0}, {1}, {2}]
    assert set(SAMPLER_METRICS) <= set(metrics.columns)
    assert (metrics["rollout_logprob_delta_max"] < 1e-4).all(), metrics[list(SAMPLER_METRICS)]
    assert (metrics["rollout_kl_mean"] < 5e-9).all()
    assert all(math.isfinite(x) for x in metrics["loss"])
    assert (tmp_path / "run" / "vllm" / "server.log").is_file()
    pgid = seen[0][1]
    assert {p for _, p in seen} == {pgid}  # one server for the run
    assert trainer.rollout.engine is None
    wait_for(lambda: not group_alive(pgid), what=f"vLLM process group {pgid} gone", timeout=WAIT_S)
