"""Step timing, FLOP count, matmul peak and MFU (posttrain.core.timing, .rl.step_timing)."""

from __future__ import annotations

import doctest
import logging
import math
import time

import pandas as pd
import pytest
import torch
from torch import nn

import posttrain.core.timing as timing
from posttrain.core.metrics import read_metrics
from posttrain.core.timing import (
    PhaseTimer,
    matmul_peak_flops,
    mfu,
    model_flops,
    non_embedding_params,
    set_peak_flops,
)
from posttrain.rl.step_timing import TIMING_COLUMNS

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True)
def measured_peak(monkeypatch):
    """Every test starts from a measured (not overridden) peak and restores it."""
    monkeypatch.delenv(timing.PEAK_FLOPS_ENV, raising=False)
    monkeypatch.setattr(timing, "_warned_above_peak", False)
    set_peak_flops(None)
    yield
    set_peak_flops(None)


def test_phase_timer_parts_sum_to_the_total():
    timer = PhaseTimer()
    timer.add("rollout", 0.25)
    timer.add("update", 0.5)
    timer.add("update", 0.125)
    row = timer.row(1.0, ("rollout", "scoring", "update"))
    # by hand: 0.25 + 0 + 0.625, other = 1.0 - 0.875
    assert row == {
        "time_rollout_s": 0.25,
        "time_scoring_s": 0.0,
        "time_update_s": 0.625,
        "time_other_s": 0.125,
    }
    with timer.phase("scoring"):
        pass
    assert timer.seconds["scoring"] >= 0.0
    with pytest.raises(ValueError, match="seconds=-1"):
        timer.add("update", -1.0)


def test_non_embedding_params_of_tiny_1m_by_hand():
    """tiny-1m: qwen2, 4 layers, embed 128, 4 heads of 32, 2 kv heads, MLP 512, vocab 272, tied.
    Per layer: q 128*128+128 = 16,512; k, v 64*128+64 = 8,256 each; o 128*128 = 16,384;
    MLP 3*128*512 = 196,608; two norms 256 -> 246,272. Four layers 985,088, final norm 128,
    tied output 272*128 = 34,816 -> N = 1,020,032; one trained token = 6 N = 6,120,192 FLOPs."""
    from posttrain.policy import Policy

    model = Policy.from_spec("tiny-1m", seed=0).model
    n = non_embedding_params(model)
    assert n == 1_020_032
    assert model_flops(n, 1, kind="train") == 6_120_192
    assert model_flops(n, 3, kind="forward") == 2 * 3 * 1_020_032


def test_non_embedding_params_untied_excludes_the_table():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(10, 4)  # 40: not counted
            self.proj = nn.Linear(4, 4)  # 20
            self.output = nn.Linear(4, 10, bias=False)  # 40

    assert non_embedding_params(Toy()) == 60


def test_model_flops_and_mfu_reject_bad_input():
    with pytest.raises(ValueError, match="kind='backward'.*'forward', 'train'"):
        model_flops(10, 1, kind="backward")
    with pytest.raises(ValueError, match="tokens=-1"):
        model_flops(10, -1, kind="train")
    with pytest.raises(ValueError, match="devices=0"):
        mfu(1.0, 1.0, peak_flops_per_s=1.0, devices=0)
    assert mfu(3e9, 2.0, peak_flops_per_s=1e9, devices=3) == pytest.approx(0.5)
    assert math.isnan(mfu(1.0, 0.0, peak_flops_per_s=1.0))


def test_peak_is_measured_once_and_cached(monkeypatch):
    calls = []
    real = timing._measure

    def counted(device, n, repeats, dtype):
        calls.append((str(device), n, repeats))
        return real(device, n, repeats, dtype)

    monkeypatch.setattr(timing, "_measure", counted)
    monkeypatch.setattr(timing, "_peak_cache", {})
    first = matmul_peak_flops("cpu", size=128, repeats=2)
    second = matmul_peak_flops("cpu", size=128, repeats=2)
    assert calls == [("cpu", 128, 2)] and first == second and first > 0
    threads = torch.get_num_threads()
    try:  # a different intra-op thread count is a different peak: measured again
        torch.set_num_threads(threads + 1)
        matmul_peak_flops("cpu", size=128, repeats=2)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2
    assert timing.PEAK_MATMUL_SIZE["cpu"] == 1024


def test_a_peak_measured_while_waiting_for_a_core_is_not_lowered(monkeypatch):
    """A busy neighbour takes the core away in the middle of a timed matmul: simulated by a
    50 ms sleep after every product (the process waits, it does not compute). Timed in wall
    seconds the 128 x 128 peak could be at most 2 * 128^3 / 0.05 s = 84 MFLOP/s, and every
    later step's MFU would be inflated by the same factor; timed in the thread's CPU seconds the
    wait does not count. Any CPU multiplies 128 x 128 fp32 matrices at well over 10x that
    (tens of GFLOP/s here), loaded or not."""
    stall_s, n = 0.05, 128
    real_mm = torch.mm

    def descheduled_mm(a, b):
        out = real_mm(a, b)
        time.sleep(stall_s)
        return out

    monkeypatch.setattr(timing, "_peak_cache", {})
    monkeypatch.setattr(timing.torch, "mm", descheduled_mm)
    peak = matmul_peak_flops("cpu", size=n, repeats=2)
    wall_bound = 2 * n**3 / stall_s
    assert peak > 10 * wall_bound, f"peak {peak:.3g} FLOP/s; a wall-clock peak <= {wall_bound:.3g}"


def test_cpu_peak_is_one_thread_cpu_time_rate_times_the_threads(monkeypatch):
    """The product runs on one intra-op thread, is timed with time.thread_time, and the rate
    scales with the threads the trainer runs on; the thread setting is restored."""
    seen = []

    def fake_best_rate(a, b, clock, sync, repeats):
        seen.append((clock, torch.get_num_threads(), tuple(a.shape), repeats))
        return 1e9

    monkeypatch.setattr(timing, "_peak_cache", {})
    monkeypatch.setattr(timing, "_best_rate", fake_best_rate)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert matmul_peak_flops("cpu", size=16, repeats=4) == 3e9
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)
    assert seen == [(time.thread_time, 1, (16, 16), 4)]


def test_mfu_never_exceeds_one_and_warns_once(caplog):
    """6 GFLOP in 1 s over a 1 GFLOP/s peak x 2 devices is 3x the peak: reported as 1.0, with
    a warning that names both rates (once per process); at or below the peak it is the plain
    ratio (by hand: 1.5e9 / (1 x 1e9 x 2) = 0.75; 2e9 / 2e9 = 1)."""
    with caplog.at_level(logging.WARNING, logger="posttrain.core.timing"):
        assert mfu(6e9, 1.0, peak_flops_per_s=1e9, devices=2) == 1.0
        assert mfu(6e9, 1.0, peak_flops_per_s=1e9, devices=2) == 1.0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "6e+09 model FLOP/s over a peak of 1e+09 FLOP/s x 2 devices" in warnings[0]
    assert "POSTTRAIN_PEAK_FLOPS" in warnings[0]
    assert mfu(1.5e9, 1.0, peak_flops_per_s=1e9, devices=2) == 0.75
    assert mfu(2e9, 1.0, peak_flops_per_s=1e9, devices=2) == 1.0
    with pytest.raises(ValueError, match="peak_flops_per_s=0"):
        mfu(1.0, 1.0, peak_flops_per_s=0.0)


def test_timing_doctests():
    assert doctest.testmod(timing).failed == 0


def test_peak_overrides_env_and_setter(monkeypatch):
    monkeypatch.setenv(timing.PEAK_FLOPS_ENV, "2.5e11")
    assert matmul_peak_flops() == 2.5e11
    set_peak_flops(1e10)  # the setter wins over the environment
    assert matmul_peak_flops() == 1e10
    set_peak_flops(None)
    monkeypatch.setenv(timing.PEAK_FLOPS_ENV, "fast")
    with pytest.raises(ValueError, match="POSTTRAIN_PEAK_FLOPS='fast'"):
        matmul_peak_flops()
    with pytest.raises(ValueError, match="flops_per_s=0"):
        set_peak_flops(0)


def test_rl_rows_carry_the_time_split_tokens_per_s_and_mfu(tmp_path):
    """Two GRPO steps with a KL reference (so the log-prob phase runs), rows read back from
    metrics.jsonl. FLOPs by hand from the step's own trajectories: 2 N per sampled-context
    token (prompt + completion) + 2 N per real batch token for the reference pass + 6 N per
    real batch token for the one update epoch, and attention (PaLM appendix B) at each
    trajectory's own length n: 4 L d_attn n^2 for the rollout, again for the reference pass,
    12 L d_attn n^2 for the update (tiny-1m: L = 4 layers, d_attn = 4 heads x 32 = 128)."""
    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.rl import RLAlgorithm, RLTrainer

    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-4),
        task=chain_sum_task(size=16, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.05),
        prompts_per_step=2,
        max_new_tokens=3,
        progress=False,
        run_dir=tmp_path / "run",
    )
    trainer.step()
    last = trainer.step()
    frame = read_metrics(tmp_path / "run")
    assert len(frame) == 2 and set(TIMING_COLUMNS) <= set(frame.columns)
    parts = ["time_rollout_s", "time_scoring_s", "time_logprobs_s", "time_update_s", "time_other_s"]
    for _, row in frame.iterrows():
        assert all(row[c] >= 0 for c in TIMING_COLUMNS)
        assert sum(row[c] for c in parts) == pytest.approx(row["step_time_s"], abs=1e-9)
        assert 0 < row["mfu"] <= 1
        assert row["time_logprobs_s"] > 0 and row["time_update_s"] > 0
        # generation is timed apart inside the rollout: rollout + scoring = the whole rollout
        assert row["time_rollout_s"] + row["time_scoring_s"] == pytest.approx(row["rollout_s"])
        assert row["tokens_per_s"] == pytest.approx(row["sampled_tokens"] / row["step_time_s"])

    n = 1_020_032  # test_non_embedding_params_of_tiny_1m_by_hand
    rows = [t for g in trainer.last_groups for t in g]
    context = sum(len(t.prompt_ids) + len(t.completion_ids) for t in rows)
    assert last["groups_kept"] == 2  # tiny-1m at seed 0: no excluded group, all rows trained
    real = context  # one row per trajectory, right-padded: its real tokens are its context
    trained = sum(len(t.completion_ids) for t in rows)
    squares = sum((len(t.prompt_ids) + len(t.completion_ids)) ** 2 for t in rows)
    flops = 2 * n * context + 2 * n * real + 6 * n * real + (4 + 4 + 12) * 4 * 128 * squares
    assert last["flops_per_s"] * last["step_time_s"] == pytest.approx(flops, rel=1e-12)
    assert last["trained_tokens_per_s"] * last["step_time_s"] == pytest.approx(trained)
    assert pd.notna(frame["mfu"]).all()


def test_a_step_that_trains_nothing_has_zero_update_time():
    """train_on_groups on groups that are all excluded: no log-prob or update phase."""
    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.rl import Group, RLAlgorithm, RLTrainer, Trajectory

    policy = Policy.from_spec("tiny-1m", seed=0)
    trainer = RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-4),
        task=chain_sum_task(size=16, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=2, kl_coef=0.0),
        prompts_per_step=1,
        max_new_tokens=2,
        progress=False,
    )
    t = dict(
        group_id=0,
        prompt_ids=[1, 2],
        completion_ids=[3],
        logprobs=[-0.5],
        reward=0.0,
        finish_reason="stop",
        policy_version=0,
        text="x",
    )
    row = trainer.train_on_groups(
        [Group([Trajectory(**t, outcome="error"), Trajectory(**t, outcome="ok")])]
    )
    assert row["groups_kept"] == 0
    assert row["time_update_s"] == row["time_logprobs_s"] == row["trained_tokens_per_s"] == 0
    assert row["time_rollout_s"] == row["time_scoring_s"] == 0.0  # no rollout in this step
    assert row["time_other_s"] == pytest.approx(row["step_time_s"], abs=1e-12)
    # only the rollout's (prompt + completion) tokens were computed: 2 N x 3 per trajectory,
    # + attention 4 L d_attn x 3^2 per trajectory (tiny-1m: L = 4, d_attn = 128)
    assert row["flops_per_s"] * row["step_time_s"] == pytest.approx(
        2 * 1_020_032 * 3 * 2 + 4 * 4 * 128 * 9 * 2, rel=1e-12
    )


def test_attention_flops_by_hand():
    """PaLM appendix B: 12 L T d_attn per trained token, a third of it forward. L = 2, T = 8,
    d_attn = 4, 10 tokens: 12 * 2 * 8 * 4 * 10 = 7,680 (train), 4 * 2 * 8 * 4 * 10 = 2,560.
    Qwen2.5-0.5B (L = 24, d_attn = 14 x 64 = 896) at T = 2048: 12 * 24 * 2048 * 896 = 528.5M
    FLOPs per token beside 6 N = 6 * 494.0M = 2.96G, i.e. +17.8%."""
    assert timing.attention_flops(2, 8, 4, 10, kind="train") == 7_680
    assert timing.attention_flops(2, 8, 4, 10, kind="forward") == 2_560
    assert timing.attention_flops(24, 2048, 896, 1, kind="train") == 528_482_304
    with pytest.raises(ValueError, match="kind='backward'; must be one of"):
        timing.attention_flops(2, 8, 4, 10, kind="backward")
    with pytest.raises(ValueError, match="seq_len"):
        timing.attention_flops(2, -8, 4, 10, kind="train")


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
    ],
)
def test_datasheet_peak_by_device_name(name, peak):
    """Dense bf16 figures of NVIDIA's datasheets (half the 2:4-sparse ones: H100 SXM 1,979 ->
    989.5 TFLOP/s, listed as 989; PCIe 1,513 -> 756; A100 624 -> 312)."""
    value, source = timing.datasheet_peak_flops(name)
    assert value == peak and "datasheet" in source


def test_an_unknown_gpu_has_no_datasheet_peak_and_says_why():
    value, reason = timing.datasheet_peak_flops("NVIDIA L4")
    assert value is None and "'NVIDIA L4'" in reason and "H200" in reason
