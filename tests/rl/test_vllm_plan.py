"""GRPO with `rollout_engine="vllm"` under a ParallelPlan of 2 gloo ranks
(posttrain.rl.engine_plan): rank 0 starts one server and syncs it, its URL reaches rank 1, every
data rank samples its share from it stamped with the version the ranks agreed, a failed sync or
request on the rank that made it stops every rank by name, and the server is stopped when fit
ends.

The ranks run once for the module (tests/vllm_plan_run.py): first on the stand-in server of
tests/_vllm_fake.py, which rank 0 starts and stops (seconds, no vLLM needed; its samples start
with a digest of the weights it holds, and its controls make a reload or a request fail), then,
with the vLLM venv, on the suite's shared real server (`vllm_server`), which rank 0 attaches to
by URL (`rollout_options={"url": ...}`, `VLLMServer.attach`) and leaves running: a server start
inside the ranks made the module take 210-237 s at load ~23. The shared server's contract lets
a test leave other weights on it; this one syncs its starting weights back. Between the two,
the grpo recipe runs under dp_shard=2 with `rollout.engine=vllm rollout.url=...` on a stand-in
server the test starts (its samples' log-probs are -1.0, so the mismatch columns tell its
samples from the policy's).

Independent checks: the model rank 0 exported from the gathered dp_shard=2 weights equals,
tensor for tensor, the one-process policy saved here; after each update, greedy tokens served by
the real server to each rank equal the gathered weights' builtin `Policy.generate` tokens (the
server holds the weights of the update, not older ones); the sampled-token log-probs of the
server agree with the split policy's recomputation within 1e-4 (fp32 gives ~5e-6;
tests/rl/test_vllm_rollout.py has the bound's derivation).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_plan_run as worker
from _policy_helpers import drawn_policy
from _ranks import run_ranks
from _vllm_fake import fake_venv, weights_digest
from _waits import WAIT_S, wait_for

from posttrain.policy.vllm_process import group_alive
from posttrain.policy.vllm_server import VLLMServer, vllm_unavailable_reason
from posttrain.rl.lowbit_rollout import SAMPLER_METRICS

REASON = vllm_unavailable_reason()
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, request) -> tuple[Path, list[dict], dict]:
    """(the ranks' folder, each rank's results, the recipe's stand-in server after the ranks)
    of the "fake" and "recipe" phases, and of "real" (on the shared `vllm_server`) with vLLM."""
    out = tmp_path_factory.mktemp("vllm-plan")
    server = request.getfixturevalue("vllm_server") if REASON is None else None
    venv = str(fake_venv(out / "stand-in-venv"))
    with VLLMServer.start(drawn_policy(0), out / "stand-in", venv=venv) as stand_in:
        phases = f"fake,recipe={stand_in.url}" + ("" if server is None else f",real={server.url}")
        try:
            run_ranks(worker.__file__, 2, out, str(out), phases)
        finally:
            if server is not None:
                server.sync_weights(drawn_policy(0))  # the weights it started with
        assert stand_in.log_path is not None and stand_in.pgid is not None
        after = {
            "alive": stand_in.alive and group_alive(stand_in.pgid),
            "received": (stand_in.log_path.parent / "received").exists(),
        }
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)], after


def _gone(pgid: int) -> None:
    wait_for(lambda: not group_alive(pgid), what=f"vLLM process group {pgid} gone", timeout=WAIT_S)


def test_rank_0_starts_one_server_and_every_rank_samples_the_synced_weights(ranks, tmp_path):
    out, results, _ = ranks
    runs = [r["fake"]["dp_shard2"] for r in results]
    assert [s["owner"] for s in runs[0]["steps"]] == [True, True]
    assert [s["owner"] for s in runs[1]["steps"]] == [False, False]
    urls = {s["url"] for run in runs for s in run["steps"]}
    assert len(urls) == 1 and urls.pop().startswith("http://127.0.0.1:")
    # every rank holds the step's global groups: rank r sampled groups 2r, 2r + 1
    assert [s["groups"] for s in runs[0]["steps"]] == [s["groups"] for s in runs[1]["steps"]]
    for step, record in enumerate(runs[0]["steps"]):
        assert [g[0] for g in record["groups"]] == [0, 1, 2, 3]
        assert {v for g in record["groups"] for v in g[1]} == {step}
    # the bit-for-bit check: rank 0 exported the gathered dp_shard=2 weights of step 0, and
    # those are the one-process policy's
    from safetensors.torch import load_file

    exported = out / "fake-dp_shard2" / "vllm" / "model"
    drawn_policy(0).save(tmp_path / "one-process")
    [mine] = sorted(exported.glob("*.safetensors"))
    [theirs] = sorted((tmp_path / "one-process").glob("*.safetensors"))
    a, b = load_file(str(mine)), load_file(str(theirs))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the stand-in's samples start with a digest of the weights it holds: the export at version
    # 0 on both ranks' prompts, then (after the sync) other weights
    first = [{t for g in s["groups"] for t in g[2]} for s in runs[0]["steps"]]
    assert first[0] == {weights_digest(exported) % 256}
    assert len(first[1]) == 1 and first[1] != first[0]


def test_a_failed_sync_on_rank_0_stops_every_rank_by_name_and_the_server_stops(ranks):
    rank0, rank1 = (r["fake"]["dp_shard2"] for r in ranks[1])
    assert rank0["raised"][0] == "VLLMRequestError" and "fail_reload" in rank0["raised"][1]
    assert rank1["raised"][0] == "SharedEngineError"
    assert "rank 0's weight sync of the vLLM server failed" in rank1["raised"][1]
    assert "fail_reload" in rank1["raised"][1]
    assert rank0["step_count"] == rank1["step_count"] == 2  # step 3 rolled back on both
    assert len(rank1["steps"]) == 2  # rank 1 sampled nothing after the failed sync
    assert rank0["engine_after"] is None and rank1["engine_after"] is None
    _gone(rank0["steps"][0]["pgid"])


def test_under_tp_one_rank_asks_for_its_data_rank_and_its_failure_stops_the_other(ranks):
    rank0, rank1 = (r["fake"]["tp2"] for r in ranks[1])
    assert rank0["steps"][0]["groups"] == rank1["steps"][0]["groups"]
    assert rank0["raised"][0] == "VLLMRequestError" and "fail_500" in rank0["raised"][1]
    assert rank1["raised"][0] == "SharedEngineError"
    assert "rank 0 asked the vLLM server" in rank1["raised"][1]
    assert rank0["step_count"] == rank1["step_count"] == 1
    _gone(rank0["steps"][0]["pgid"])


@pytest.mark.skipif(REASON is not None, reason=str(REASON))
def test_grpo_under_dp_shard_2_trains_on_one_real_vllm_server(ranks, vllm_server):
    _, results, _ = ranks
    runs = [r["real"] for r in results]
    for rank, run in enumerate(runs):
        assert run["raised"] is None and run["step_count"] == 2
        assert {s["url"] for s in run["steps"]} == {vllm_server.url}
        assert [s["attached"] for s in run["steps"]] == [True if rank == 0 else None] * 2
        versions = [{v for g in s["groups"] for v in g[1]} for s in run["steps"]]
        assert versions == [{0}, {1}]
        for k, greedy in enumerate(run["greedy"]):  # after update k + 1, synced to it
            assert greedy["versions"] == [k + 1] * 3
            assert greedy["served"] == greedy["builtin"], (rank, k, greedy)
        for row in run["rows"]:
            assert set(SAMPLER_METRICS) <= row.keys()
            assert row["rollout_logprob_delta_max"] < 1e-4 and row["rollout_kl_mean"] < 5e-9
    same = ("loss", "grad_norm", "reward_mean", *SAMPLER_METRICS)  # the ranks trained alike
    assert [[r[k] for k in same] for r in runs[0]["rows"]] == [
        [r[k] for k in same] for r in runs[1]["rows"]
    ]
    # rank 0 attached to the shared server and left it running when fit ended
    assert runs[0]["steps"][0]["pgid"] is None and vllm_server.alive


def test_the_grpo_recipe_under_a_plan_samples_from_the_server_at_its_url(ranks):
    out, results, stand_in = ranks
    rank0, rank1 = (r["recipe"] for r in results)
    assert rank0["results"]["rollout_engine"] == "vllm" and rank1["results"] is None
    rows = rank0["metrics"]
    assert [r["step"] for r in rows] == [1, 2]
    # the stand-in's log-probs are -1.0: a delta near the policy's own (0) would mean the
    # policy sampled; the second rollout's sync reached the server
    assert all(r["rollout_logprob_delta_max"] > 1.0 for r in rows)
    assert rows[0]["weight_sync_s"] == 0.0 and rows[1]["weight_sync_reload_s"] > 0.0
    assert stand_in["alive"] and stand_in["received"]  # attached to, left running
    assert not list((out / "recipe").rglob("server.log"))  # no server started in the ranks


def test_the_engine_is_shared_only_under_a_plan_of_several_ranks():
    """Without a process group, or without a plan (a trainer that needs no other rank), each
    process keeps an engine of its own; a wildcard host is broadcast as this machine's name."""
    import socket

    from posttrain.policy.engine_slot import EngineSlot
    from posttrain.rl.engine_plan import _reachable
    from posttrain.rl.engine_rollout import ManagedEngine
    from posttrain.train import LocalRuntime, ParallelPlan

    policy = drawn_policy(0)
    plain = LocalRuntime(policy.model)
    planned = ParallelPlan(dp_shard=1).parallelize(policy.model, spec=policy.spec)
    for runtime in (None, plain, planned):
        assert type(ManagedEngine("vllm", runtime=runtime).slot) is EngineSlot
    assert _reachable("http://0.0.0.0:8123") == f"http://{socket.getfqdn()}:8123"
    assert _reachable("http://127.0.0.1:8123") == "http://127.0.0.1:8123"
