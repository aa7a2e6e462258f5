"""Data-parallel SFT on 2 gloo processes equals one process on the same global batch; the 2-rank
run checkpoints once (rank 0) and resumes exactly; preemption checkpoints at a step boundary.

The 2-rank runs happen once per module (tests/distributed_sft_run.py, ~10 s); each test compares
them with the single-process path run here, never with pinned numbers.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import distributed_sft_run as worker
import pytest
import torch
from _ranks import run_ranks
from _train_helpers import assert_bitwise_equal, sft_dataset, sft_loader, tiny_model

from posttrain.core import list_checkpoints, preemption, read_metrics
from posttrain.data import SFTLoader
from posttrain.train import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    """Run tests/distributed_sft_run.py on 2 gloo ranks; (its output folder, each rank's
    results)."""
    out = tmp_path_factory.mktemp("dp")
    run_ranks(worker.__file__, WORLD_SIZE, out, str(out))
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def _assert_params_close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= atol, f"largest parameter difference {worst:.3g} > {atol}"


@pytest.mark.parametrize("scenario", sorted(worker.SCENARIOS))
def test_two_ranks_equal_one_process_on_the_global_batch(two_ranks, scenario):
    """'accum': batch 8 x accumulation 2 with clipping, and a micro-batch of 1 sample (rank 1
    trains a padding row). 'packed': 8 packed rows per step, the last step 5 (3 + 2)."""
    _, ranks = two_ranks
    single = worker.run_sft(scenario)
    for result in ranks:
        assert result[scenario]["trained_tokens"] == single["trained_tokens"]
        assert result[scenario]["losses"] == pytest.approx(single["losses"], abs=1e-5)
        _assert_params_close(result[scenario]["params"], single["params"])
    assert_bitwise_equal(ranks[0][scenario]["params"], ranks[1][scenario]["params"])


def test_two_ranks_checkpoint_once_and_resume_exactly(two_ranks):
    out, ranks = two_ranks
    for result in ranks:
        r = result["resume"]
        assert r["saved_after_first_fit"] == ["step_000002", "step_000003"]
        assert r["resumed_from"] == [1, 2, 3]  # rows of the first run, restored on every rank
        assert r["resumed_losses"] == r["uninterrupted_losses"]
        assert_bitwise_equal(r["resumed_params"], r["uninterrupted_params"])
    run_dir = out / "ckpt"
    # rank 0 alone writes: its lock (posttrain.core.run_lock), checkpoints and metrics
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".posttrain.lock",
        "checkpoints",
        "metrics.jsonl",
    ]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000004", "step_000005"]
    assert read_metrics(run_dir)["loss"].tolist() == ranks[0]["resume"]["uninterrupted_losses"]


def test_preemption_on_one_rank_checkpoints_the_same_step_on_all(two_ranks):
    """Only rank 1 gets the signal (after step 2); both ranks save step 2 together, the
    hand-over happens on rank 1 only, and training goes on (the handler here does not exit)."""
    out, ranks = two_ranks
    assert [r["preemption"]["handler_calls"] for r in ranks] == [[], [2]]
    assert [r["preemption"]["steps"] for r in ranks] == [3, 3]
    assert [p.name for p in list_checkpoints(out / "preempt")] == ["step_000002"]


def test_the_trainer_refuses_a_loader_sharded_for_another_world_size(two_ranks):
    for result in two_ranks[1]:
        assert "world_size=1" in result["mismatch_error"]
        assert "world_size=2" in result["mismatch_error"]


def test_sft_recipe_on_two_ranks_writes_once_and_returns_on_rank_0(two_ranks):
    out, ranks = two_ranks
    assert ranks[1]["recipe"] is None
    results = ranks[0]["recipe"]
    assert {"before", "after", "final_loss"} <= results.keys()
    run = out / "recipe"
    assert (run / "policy" / "config.json").is_file() and (run / "results.json").is_file()
    assert read_metrics(run)["step"].tolist() == [1, 2, 3]


def test_loader_shards_partition_the_global_batch():
    """Rank shards of each global batch (padded and packed) hold the single-process rows."""
    for pack in (False, True):
        kwargs = dict(batch_size=4, seed=3, pack=pack, seq_len=48 if pack else None)
        whole = SFTLoader(sft_dataset(13, max_seq_len=48), **kwargs)
        shards = [
            SFTLoader(sft_dataset(13, max_seq_len=48), rank=r, world_size=2, **kwargs)
            for r in range(2)
        ]
        for _ in range(6):  # crosses an epoch boundary
            batch, parts = whole.next_batch(), [s.next_batch() for s in shards]
            assert sum(p.num_samples for p in parts) == batch.num_samples
            assert sum(p.num_trained_tokens for p in parts) == batch.num_trained_tokens
            assert all(s.state_dict() == whole.state_dict() for s in shards)


def test_batch_size_not_divisible_by_world_size_names_the_fields():
    with pytest.raises(ValueError, match=r"batch_size=7 is not divisible by world_size=2"):
        SFTLoader(sft_dataset(8), batch_size=7, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"rank=2"):
        SFTLoader(sft_dataset(8), batch_size=8, rank=2, world_size=2)


def _sft_trainer(run_dir: Path, callbacks: list) -> Trainer:
    model = tiny_model(0)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data=sft_loader(8, batch_size=2),
        run_dir=run_dir,
        progress=False,
        callbacks=callbacks,
    )


def _rl_trainer(run_dir: Path, callbacks: list):
    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.rl import RLAlgorithm, RLTrainer

    policy = Policy.from_spec("tiny-1m", seed=0)
    return RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-4),
        task=chain_sum_task(size=16, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.0),
        prompts_per_step=2,
        max_new_tokens=2,
        run_dir=run_dir,
        progress=False,
        callbacks=callbacks,
    )


@pytest.mark.parametrize("build", [_sft_trainer, _rl_trainer], ids=["sft", "rl"])
def test_preemption_signal_waits_for_the_step_and_checkpoints_it(tmp_path, build):
    """SIGUSR2 arrives in the middle of step 2 (a callback runs before the step is done); the
    original handler runs once, after step 2 completed, with step 2's checkpoint on disk (no
    periodic checkpoints are configured), and fit goes on."""
    seen: list[tuple[int, list[str]]] = []

    def signal_in_step_2(trainer, row):
        if row["step"] == 2:
            os.kill(os.getpid(), signal.SIGUSR2)

    trainer = build(tmp_path, [signal_in_step_2])

    def recorder(signum, frame):
        seen.append((trainer.step_count, [p.name for p in list_checkpoints(tmp_path)]))

    previous = signal.signal(signal.SIGUSR2, recorder)
    preemption.install(signal.SIGUSR2)
    try:
        trainer.fit(3)
    finally:
        preemption.uninstall()
        signal.signal(signal.SIGUSR2, previous)
    assert seen == [(2, ["step_000002"])]
    assert trainer.step_count == 3
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]
