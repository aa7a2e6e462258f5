"""Every trainer under a ParallelPlan on 2 (and 4) gloo processes equals one process on the same
global batch: DPO (policy and frozen reference both split), the Bradley-Terry reward model (head
in the plan), GRPO (split reference) and PPO (value head, split reference), under dp_shard=2 and
tp=2, and the sp=2 / ep=2 cases of `worker.CASES_SP_EP` (PPO under sp is refused); an RL run under
dp_shard=2 resumes bitwise from its sharded checkpoint; misused plans are refused.

The multi-process runs happen once per fixture (tests/plans_trainers_run.py: 2 ranks, ~20-30 s,
then three recipes under a plan on the same ranks; the 4-rank dp_shard=2 x tp=2 phase, ~40 s,
only for the test marked slow); each test compares them with the one-process run done here.

RL rollouts: with tp only (one data rank) a plan samples exactly what one process samples. With
W > 1 data ranks each rank samples its slice of the prompts with its own seed
(`posttrain.rl.parallel.rollout_seed`), so the one-process reference samples the same W slices
with the same seeds (`SlicedRollouts` in the runner) and trains on their union: the first
step's rollouts are then bitwise those of the plan, and the update is compared on them.

Tolerances, from the float rounding of sharded sums (reductions in another order) and of
batches cut differently (the reference forward and the micro-batches of a data rank's share):
  * per-step losses, gradient norms and every other per-step metric: 2e-6 absolute (seen: at
    most 1.8e-7);
  * weights (and the value head) after SGD-with-momentum steps: 1e-6 (seen: at most 1.2e-7;
    SGD moves weights linearly in the gradients, so rounding stays at its own size);
  * DPO reference log-probs (summed over up to ~20 response tokens): 1e-5 (seen: 0.0 under
    dp_shard=2, whose forwards are those of one process; 3.8e-6 under tp=2);
  * rollouts: step 1 bitwise; later steps the same tokens, sampler log-probs within 1e-5
    (seen 9.5e-7: the weights they are sampled from differ by the rounding above);
  * the sampler-consistent log-prob contract: max |sampler log-prob - training log-prob of the
    split policy| on the first rollouts <= 1e-5, the bound of tests/policy/test_policy.py (seen:
    9.5e-7 under dp_shard=2, tp=2 and dp_shard=2 x tp=2, as in one process);
  * pair/row counts (the step normaliser): exactly equal; the resumed RL run: bitwise.
"""

from __future__ import annotations

import math
from pathlib import Path

import plans_trainers_run as worker
import pytest
import torch
from _ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LOSS_ATOL, SGD_WEIGHT_ATOL, REFERENCE_ATOL, LOGP_ATOL = 2e-6, 1e-6, 1e-5, 1e-5


def _launch(out: Path, world_size: int, phase: str) -> list[dict]:
    run_ranks(worker.__file__, world_size, out, str(out), phase, log_prefix=phase)
    return [torch.load(out / f"{phase}-rank{r}.pt", weights_only=False) for r in range(world_size)]


@pytest.fixture(scope="module")
def two_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The 2-rank phase: (its output folder, each rank's results)."""
    out = tmp_path_factory.mktemp("plans2")
    return out, _launch(out, 2, "two")


@pytest.fixture(scope="module")
def two(two_run) -> list[dict]:
    return two_run[1]


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return _launch(tmp_path_factory.mktemp("plans4"), 4, "four")


_SINGLE: dict = {}


def _single(trainer: str, data_ranks: int, spec=worker.TINY) -> dict:
    """The one-process run of `trainer` (RL: of `spec`, sampling in the plan's `data_ranks`
    slices)."""
    rl = trainer in ("grpo", "ppo")
    key = (trainer, data_ranks if rl else 1, repr(spec) if rl else None)
    if key not in _SINGLE:
        run = {"dpo": worker.run_dpo, "reward_model": worker.run_reward_model}.get(
            trainer, lambda plan: worker.run_rl(plan, trainer, rollout_ranks=data_ranks, spec=spec)
        )
        _SINGLE[key] = run(None)
    return _SINGLE[key]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _close(xs, ys, atol, what="value"):
    assert len(xs) == len(ys)
    worst = max(abs(x - y) for x, y in zip(xs, ys))
    assert worst <= atol, f"{what}: largest difference {worst:.3g} > {atol}"


def _check_preference(ranks: list[dict], key: tuple[str, str], plan) -> None:
    trainer = key[0]
    single = _single(trainer, plan.data_parallel_size)
    for rank in ranks:
        result = rank["runs"][key]
        assert result["units"] == single["units"]
        _close(result["losses"], single["losses"], LOSS_ATOL, "loss")
        _close(result["grad_norms"], single["grad_norms"], LOSS_ATOL, "grad_norm")
        assert _max_diff(result["params"], single["params"]) <= SGD_WEIGHT_ATOL
        if trainer == "dpo":
            assert _max_diff(result["reference"], single["reference"]) <= REFERENCE_ATOL
    first = ranks[0]["runs"][key]
    assert all(r["runs"][key]["losses"] == first["losses"] for r in ranks)
    assert _max_diff(ranks[-1]["runs"][key]["params"], first["params"]) == 0.0


def _same_or_close(x: float, y: float, atol: float) -> bool:
    return (math.isnan(x) and math.isnan(y)) or abs(x - y) <= atol


def _check_rl(ranks: list[dict], key: tuple[str, str], plan, spec=worker.TINY) -> None:
    single = _single(key[0], plan.data_parallel_size, spec)
    for rank in ranks:
        result = rank["runs"][key]
        # rollouts: step 1 bitwise; later steps the same tokens, log-probs within rounding
        assert result["rollouts"][0] == single["rollouts"][0]
        for ours, theirs in zip(result["rollouts"], single["rollouts"]):
            assert [t["completion_ids"] for t in ours] == [t["completion_ids"] for t in theirs]
            assert [t["reward"] for t in ours] == [t["reward"] for t in theirs]
            _close(
                [x for t in ours for x in t["logprobs"]],
                [x for t in theirs for x in t["logprobs"]],
                LOGP_ATOL,
                "sampler logprob",
            )
        assert len(result["rows"]) == len(single["rows"]) == worker.RL_STEPS
        for ours, theirs in zip(result["rows"], single["rows"]):
            assert ours.keys() == theirs.keys()
            bad = {
                k: (ours[k], theirs[k])
                for k in ours
                if not _same_or_close(ours[k], theirs[k], LOSS_ATOL)
            }
            assert not bad, f"step {ours['step']}: metrics differ: {bad}"
        assert _max_diff(result["params"], single["params"]) <= SGD_WEIGHT_ATOL
        if single["value_head"] is not None:
            assert _max_diff(result["value_head"], single["value_head"]) <= SGD_WEIGHT_ATOL
        assert result["delta_logp"] <= LOGP_ATOL
    first = ranks[0]["runs"][key]
    assert all(r["runs"][key]["rows"] == first["rows"] for r in ranks)
    assert _max_diff(ranks[-1]["runs"][key]["params"], first["params"]) == 0.0


CASES_2 = [(trainer, name) for name in worker.PLANS_2 for trainer in worker.TRAINERS]


@pytest.mark.parametrize("key", CASES_2, ids=lambda k: f"{k[0]}-{k[1]}")
def test_trainer_under_a_2_rank_plan_equals_one_process(two, key):
    plan = worker.PLANS_2[key[1]]
    check = _check_rl if key[0] in ("grpo", "ppo") else _check_preference
    check(two, key, plan)


def test_chunked_rl_scoring_under_tp2_equals_one_unchunked_process(two):
    """PPO with `loss_chunk_tokens=3` under tp=2 (policy and reference split, value head) against
    one process with full logits: the same checks and tolerances as the unchunked tp=2 run
    (chunking changes only the order of float sums: seen 3.6e-7 on the metrics against the
    unchunked tp=2 run), the sampler's log-probs included."""
    ranks = [{"runs": {("ppo", "tp2"): rank["ppo_tp2_chunked"]}} for rank in two]
    _check_rl(ranks, ("ppo", "tp2"), worker.PLANS_2["tp2"])


@pytest.mark.parametrize("key", list(worker.CASES_SP_EP), ids=lambda k: f"{k[0]}-{k[1]}")
def test_trainer_under_sp2_or_ep2_equals_one_process(two, key):
    """DPO (policy and reference split), the reward model (head after the sequence gather) and
    GRPO under Ulysses sp=2 on TINY (one data rank: both sp ranks sample and train the same
    rows); GRPO and PPO (value head) under ep=2 on the MoE `worker.MOE` (two data ranks; router
    aux loss off, as it is per rank): the same checks and tolerances as the dp_shard / tp
    cases (seen: losses and metrics within 4.8e-7, grad norms 1.3e-6 for DPO under sp, weights
    1.2e-7, reference log-probs 0.0, sampler-vs-training log-prob 9.5e-7)."""
    plan = worker.PLANS_SP_EP[key[1]]
    if key[0] in ("dpo", "reward_model"):
        _check_preference(two, key, plan)
    else:
        _check_rl(two, key, plan, worker.CASES_SP_EP[key])


@pytest.mark.slow
@pytest.mark.parametrize("trainer", worker.TRAINERS_4)
def test_trainer_under_dp_shard2_x_tp2_on_4_ranks_equals_one_process(four, trainer):
    plan = worker.PLANS_4["dp_shard2_tp2"]
    check = _check_rl if trainer in ("grpo", "ppo") else _check_preference
    check(four, (trainer, "dp_shard2_tp2"), plan)


def test_dpo_with_the_policy_as_its_own_reference_eval_and_checkpoints(two):
    """The DPO recipe's order: the split policy scores the reference log-probs (no-grad
    forwards, after which FSDP2 would leave the root gathered) before its optimizer is built;
    an eval_fn runs before each sharded checkpoint. Both must leave the optimizer holding the
    parameters FSDP2 trains."""
    single = worker.run_dpo(None, self_reference=True)
    for rank in two:
        result = rank["dpo_self_reference"]
        assert result["found"] == ["step_000001", "step_000002"]
        assert result["units"] == single["units"]
        _close(result["losses"], single["losses"], LOSS_ATOL, "loss")
        assert _max_diff(result["params"], single["params"]) <= SGD_WEIGHT_ATOL
        assert _max_diff(result["reference"], single["reference"]) <= REFERENCE_ATOL


def test_reward_model_after_a_no_grad_forward_trains_every_parameter(two):
    """Rewards looked at under torch.no_grad() between apply_plan_to_reward_model and building
    the optimizer (the RewardModel is FSDP2's root, holding the head): the run equals one
    process, the head and the backbone's embedding and final norm included."""
    from posttrain.rewards import RewardModel

    single = _single("reward_model", 1)
    initial = RewardModel.from_spec(worker.TINY, seed=0).state_dict()
    moved = {k: float((single["params"][k] - initial[k]).abs().max()) for k in initial}
    # every parameter moves by over 10x the tolerance (least: a k_proj bias, ~3e-5; the head
    # ~4e-2, the final norm ~1e-3), so one left unchanged fails the comparison below
    assert min(moved.values()) > 10 * SGD_WEIGHT_ATOL, moved
    for rank in two:
        result = rank["reward_model_looked"]
        assert result["units"] == single["units"]
        _close(result["losses"], single["losses"], LOSS_ATOL, "loss")
        _close(result["grad_norms"], single["grad_norms"], LOSS_ATOL, "grad_norm")
        assert _max_diff(result["params"], single["params"]) <= SGD_WEIGHT_ATOL


def test_sampler_logprobs_match_the_split_policy(two):
    """The contract of `posttrain.policy`: the log-prob the sampler recorded (plain rollout
    copy, KV cache) and the one the split policy computes for training agree to rounding."""
    deltas = {
        key: rank["runs"][key]["delta_logp"]
        for rank in two
        for key in rank["runs"]
        if key[0] in ("grpo", "ppo")
    }
    assert deltas and max(deltas.values()) <= LOGP_ATOL, deltas


def test_rl_under_dp_shard2_resumes_bitwise_from_its_sharded_checkpoint(two):
    for rank in two:
        resume = rank["resume"]
        assert resume["found"] == ["step_000002", "step_000003"]
        assert resume["resumed"]["rows"][:2] == resume["first"]["rows"]
        assert resume["resumed"]["rows"] == resume["uninterrupted"]["rows"]
        assert _max_diff(resume["resumed"]["params"], resume["uninterrupted"]["params"]) == 0.0
        assert (
            _max_diff(resume["resumed"]["value_head"], resume["uninterrupted"]["value_head"]) == 0.0
        )
        assert resume["resumed"]["rollouts"][-1] == resume["uninterrupted"]["rollouts"][-1]


def test_misused_rl_plans_are_refused_with_what_to_do(two):
    errors = two[0]["errors"]
    assert "built before ParallelPlan(dp_shard=2) was applied" in errors["optimizer_before_apply"]
    assert (
        "prompts_per_step=3 must be divisible by the data-parallel size 2"
        in errors["prompts_not_divisible"]
    )
    assert "a value head with sp=2 is not supported" in errors["value_head_under_sp"]
    # the trainer applies no plan: a reference must come split as the policy is, and is named
    how = "then plan.parallelize(reference, spec=policy.spec, mesh=runtime.mesh)"
    assert errors["reference_plain"].startswith(
        "reference is a plain module, but policy.model is split by ParallelPlan(dp_shard=2)"
    )
    assert "with a KL term needs reference=" in errors["reference_none"]
    assert how in errors["reference_plain"] and how in errors["reference_none"]
    assert "policy.model is already split" in errors["reference_taken_after_the_split"]


def test_recipes_run_under_a_plan_and_rank_0_writes(two_run):
    """grpo and dpo (KTO) under dp_shard=2, reward_model under tp=2, below TINY size
    (`worker.RECIPE_RUNS`, on the ranks of the 2-rank phase): rank 0 returns the results and
    writes the run folder, the other rank returns None; the saved policy / reward model is a
    plain one that loads."""
    from posttrain.policy import Policy
    from posttrain.rewards import load_reward_model

    out, ranks = two_run
    for name in worker.RECIPE_RUNS:
        assert ranks[0]["recipes"][name] is not None and ranks[1]["recipes"][name] is None
        assert (out / name / "results.json").is_file()
        assert (out / name / "checkpoints").is_dir()
    Policy.from_pretrained(out / "grpo" / "policy")
    Policy.from_pretrained(out / "dpo" / "policy")
    load_reward_model(out / "reward_model" / "reward_model")


# ---------------------------------------------------------------------- no processes
def test_recipe_parallel_sections_are_checked_before_any_work(tmp_path, monkeypatch):
    from posttrain import cli
    from posttrain.workflows import override, plan_of

    dpo, grpo = cli.load_recipe("dpo"), cli.load_recipe("grpo")
    assert plan_of(dpo.Config()) is None  # the default: no plan
    with pytest.raises(
        ValueError,
        match=r"Config\.parallel does not fit Config\.model: "
        r"Config\.parallel\.tp=3 must divide num_heads",
    ):
        override(dpo.Config(), {"parallel.tp": 3})
    with pytest.raises(ValueError, match=r"Config\.parallel\.dp_shard=0; must be an integer >= 1"):
        override(dpo.Config(), {"parallel.dp_shard": 0})
    with pytest.raises(
        ValueError,
        match=r"Config\.rl\.prompts_per_step=3; must be divisible "
        r"by the data-parallel size 2",
    ):
        override(grpo.Config(), {"parallel.dp_shard": 2, "rl.prompts_per_step": 3})
    with pytest.raises(ValueError, match=r"Config\.parallel\.pp=2; must be 1"):
        override(grpo.Config(), {"parallel.pp": 2})
    monkeypatch.chdir(tmp_path)
    cfg = override(
        dpo.Config(), {**dpo.TINY, "out_dir": str(tmp_path / "run"), "parallel.dp_shard": 2}
    )
    with pytest.raises(ValueError, match="no torch.distributed process group is initialised"):
        dpo.main(cfg)
    assert not (tmp_path / "run").exists()


def test_data_shares_are_contiguous_and_cover_every_row():
    from posttrain.rl.parallel import data_shares, rollout_seed

    assert data_shares(5, 2) == [range(0, 3), range(3, 5)]
    assert data_shares(1, 2) == [range(0, 1), range(1, 1)]
    assert [list(r) for r in data_shares(4, 1)] == [[0, 1, 2, 3]]
    assert rollout_seed(7, 0, 1) == 7
    assert len({rollout_seed(s, r, 4) for s in range(10) for r in range(4)}) == 40


def test_sharded_preference_loader_shares_make_up_the_one_process_batches():
    from posttrain.data import PreferenceDataset, PreferenceLoader
    from posttrain.models import ByteTokenizer
    from posttrain.preference import (
        BradleyTerryLoss,
        DPOLoss,
        ShardedPreferenceLoader,
        trains_nothing,
    )

    dataset = PreferenceDataset(worker.preference_rows(), ByteTokenizer(), max_seq_len=48)
    one = PreferenceLoader(dataset, batch_size=4, seed=0)
    shards = [
        ShardedPreferenceLoader(dataset, batch_size=4, seed=0, rank=r, world_size=2)
        for r in range(2)
    ]
    key = lambda batch: [
        tuple(row[m].tolist())
        for row, m in zip(batch.chosen_input_ids, batch.chosen_attention_mask)
    ]
    for _ in range(4):  # 9 pairs: batches of 4, 4, 1, then the next epoch
        whole, parts = one.next_batch(), [s.next_batch() for s in shards]
        real = [p for p in parts if not trains_nothing(p)]
        assert sorted(k for p in real for k in key(p)) == sorted(key(whole))
        for p in parts:
            units = DPOLoss().num_units(p)
            assert int(units) == (0 if trains_nothing(p) else p.chosen_input_ids.shape[0])
            assert int(BradleyTerryLoss().num_units(p)) == int(units)
    assert shards[0].state_dict() == shards[1].state_dict() == one.state_dict()
    with pytest.raises(ValueError, match="not divisible by world_size=2"):
        ShardedPreferenceLoader(dataset, batch_size=3, rank=0, world_size=2)
