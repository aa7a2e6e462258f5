"""Trainer: micro-batching equivalence, schedule values, clipping, interrupts, eval, metrics.

Shapes: B = batch, T = tokens, V = vocabulary.
"""

from __future__ import annotations

import signal

import pytest
import torch
import torch.nn.functional as F
from _train_helpers import (
    assert_bitwise_equal,
    assert_grads_close,
    params_of,
    sft_dataset,
    sft_loader,
    tiny_model,
)

from posttrain.core import read_metrics
from posttrain.data import IGNORE_INDEX, Batch
from posttrain.train import SFTCrossEntropy, Trainer, WarmupCosine, warmup_cosine_schedule

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

N_SAMPLES = 8


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the gradients each step was given (after clipping)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _one_step(
    *, batch_size: int, grad_accum: int, pack: bool = False, max_grad_norm: float | None = None
):
    model = tiny_model(0)
    opt = RecordingSGD(model.parameters())
    loader = sft_loader(
        N_SAMPLES, batch_size=batch_size, shuffle=False, pack=pack, seq_len=64 if pack else None
    )
    trainer = Trainer(
        model,
        opt,
        data=loader,
        grad_accum_steps=grad_accum,
        max_grad_norm=max_grad_norm,
        progress=False,
    )
    row = trainer.step()
    return row, opt.seen[0], params_of(model)


def _slow_reference():
    """Gradient of the token mean over all 8 samples, one unpadded sample at a time."""
    model = tiny_model(0)
    samples = list(sft_dataset(N_SAMPLES))
    total = sum(s.num_trained_tokens for s in samples)
    loss, per_sample_means = 0.0, []
    for s in samples:
        logits_1TV = model(s.input_ids[None])
        ce_sum = F.cross_entropy(
            logits_1TV[0], s.labels, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        (ce_sum / total).backward()
        loss += float(ce_sum.detach()) / total
        per_sample_means.append(float(ce_sum.detach()) / s.num_trained_tokens)
    grads = [p.grad.clone() for p in model.parameters()]
    return loss, grads, sum(per_sample_means) / len(samples), total


def test_batch1_accum8_equals_batch8_accum1_equals_a_plain_loop():
    """Samples of 3, 6, 9 and 12 trained tokens: per-micro-batch counts differ, so a mean of
    per-micro-batch means would weight them wrongly; the token mean over the step does not."""
    counts = [s.num_trained_tokens for s in sft_dataset(N_SAMPLES)]
    assert len(set(counts)) > 1
    row_18, grads_18, params_18 = _one_step(batch_size=1, grad_accum=8)
    row_81, grads_81, params_81 = _one_step(batch_size=8, grad_accum=1)
    ref_loss, ref_grads, mean_of_means, total = _slow_reference()

    assert row_18["trained_tokens"] == row_81["trained_tokens"] == total == sum(counts)
    # relative: the loss is ~5.6 (log 272), where one float32 step is 4.8e-7
    assert row_18["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    assert row_81["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    assert abs(mean_of_means - ref_loss) > 1e-3  # the test would notice the wrong normaliser
    assert_grads_close(grads_18, ref_grads)
    assert_grads_close(grads_81, ref_grads)
    assert_grads_close(list(params_18.values()), list(params_81.values()))


def test_packed_rows_give_the_same_step_as_padded_samples():
    row_packed, grads_packed, _ = _one_step(batch_size=8, grad_accum=1, pack=True)
    ref_loss, ref_grads, _, total = _slow_reference()
    assert row_packed["trained_tokens"] == total
    assert row_packed["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    assert_grads_close(grads_packed, ref_grads)


def test_reported_grad_norm_and_clipping_match_torch():
    max_norm = 0.05
    row_raw, grads_raw, _ = _one_step(batch_size=4, grad_accum=2)
    row_clip, grads_clip, _ = _one_step(batch_size=4, grad_accum=2, max_grad_norm=max_norm)

    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads_raw]
    for p, g in zip(params, grads_raw):
        p.grad = g.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)

    assert float(torch_norm) > max_norm  # clipping is active
    assert row_raw["grad_norm"] == float(torch_norm)
    assert row_clip["grad_norm"] == float(torch_norm)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads_clip))


# --------------------------------------------------------------------------------------- schedule


def test_warmup_cosine_values_by_hand():
    """warmup 2, total 10, floor 0.1, peak 1.0. Step k runs with lr(k):
    k=0: 0/2 = 0;  k=1: 1/2 = 0.5;  k=2: progress 0 -> 1.0;
    k=4: progress 2/8 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/4)) = 0.868198;
    k=6: progress 1/2 -> 0.1 + 0.9 * 0.5 = 0.55;
    k=8: progress 3/4 -> 0.1 + 0.9 * 0.5 * (1 + cos(3pi/4)) = 0.231802;
    k=10 and after: 0.1 (the floor; no climb back up).
    """
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = warmup_cosine_schedule(opt, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(16):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = {0: 0.0, 1: 0.5, 2: 1.0, 4: 0.868198, 6: 0.55, 8: 0.231802, 10: 0.1, 15: 0.1}
    for k, value in expected.items():
        assert lrs[k] == pytest.approx(value, abs=1e-6), k


def test_warmup_cosine_without_floor_is_torchtunes_schedule():
    from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup

    ours = WarmupCosine(3, 11)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = get_cosine_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=11)
    for k in range(12):
        assert ours(k) == pytest.approx(theirs.lr_lambdas[0](k), abs=1e-12), k
    assert theirs.lr_lambdas[0](15) > 0 and ours(15) == 0.0  # theirs climbs back after the end


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(warmup_steps=5, total_steps=4), "warmup_steps"),
        (dict(warmup_steps=0, total_steps=0), "total_steps"),
        (dict(warmup_steps=0, total_steps=4, min_lr_ratio=1.5), "min_lr_ratio"),
    ],
)
def test_warmup_cosine_rejects_bad_arguments(kwargs, match):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=match):
        warmup_cosine_schedule(opt, **kwargs)


def test_the_trainer_reports_the_lr_each_step_used():
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = warmup_cosine_schedule(opt, warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    trainer = Trainer(
        model, opt, data=sft_loader(8, batch_size=2), lr_scheduler=sched, progress=False
    )
    lrs = trainer.fit(3)["lr"].tolist()
    assert lrs == pytest.approx([0.0, 0.5, 1.0])


# ------------------------------------------------------------------------------------ interrupts


def _full_trainer(**kwargs) -> Trainer:
    """AdamW + warmup-cosine + clipping + accumulation over a shuffled loader that cycles epochs
    (10 samples, 4 per step)."""
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = warmup_cosine_schedule(opt, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    return Trainer(
        model,
        opt,
        data=sft_loader(10, batch_size=2),
        lr_scheduler=sched,
        grad_accum_steps=2,
        max_grad_norm=1.0,
        progress=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def uninterrupted():
    """Params, loader state and loss after each of 6 steps of an uninterrupted run."""
    snapshots = {}

    def keep(trainer, row):
        snapshots[row["step"]] = (params_of(trainer.model), trainer.data.state_dict(), row["loss"])

    _full_trainer(callbacks=[keep]).fit(6)
    return snapshots


class _InterruptingLoss:
    """SFT cross-entropy that raises KeyboardInterrupt on its `at_call`-th micro-batch."""

    def __init__(self, at_call: int) -> None:
        self.inner, self.calls, self.at_call = SFTCrossEntropy(), 0, at_call

    def num_units(self, batch):
        return self.inner.num_units(batch)

    def __call__(self, model, batch, num_units_in_step):
        self.calls += 1
        if self.calls == self.at_call:
            raise KeyboardInterrupt
        return self.inner(model, batch, num_units_in_step)


def _interrupt_in_loss(trainer: Trainer, k: int) -> None:
    trainer.loss = _InterruptingLoss(at_call=2 * (k - 1) + 2)  # step k's second micro-batch


def _interrupt_in_data(trainer: Trainer, k: int) -> None:
    real, calls = trainer.data.next_batch, [0]

    def next_batch():
        calls[0] += 1
        if calls[0] == 2 * (k - 1) + 2:  # step k's first micro-batch is already fetched
            raise KeyboardInterrupt
        return real()

    trainer.data.next_batch = next_batch


def _interrupt_in_update(trainer: Trainer, k: int) -> None:
    real = trainer.optimizer.step

    def step(*args, **kwargs):
        if trainer.step_count == k - 1:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the parameters are being updated
        return real(*args, **kwargs)

    trainer.optimizer.step = step


@pytest.mark.parametrize(
    "inject, stops_at, message",
    [
        (_interrupt_in_loss, 3, "step 4 was rolled back"),
        (_interrupt_in_data, 3, "step 4 was rolled back"),
        (_interrupt_in_update, 4, "stopped after step 4 completed"),
    ],
)
def test_keyboard_interrupt_leaves_a_clean_state_and_fit_continues(
    uninterrupted, capsys, inject, stops_at, message
):
    trainer = _full_trainer()
    inject(trainer, 4)
    metrics = trainer.fit(6)
    assert message in capsys.readouterr().out
    assert trainer.step_count == stops_at
    assert metrics["step"].tolist() == list(range(1, stops_at + 1))
    params, data_state, _ = uninterrupted[stops_at]
    assert_bitwise_equal(params_of(trainer.model), params)
    assert trainer.data.state_dict() == data_state
    assert all(p.grad is None for p in trainer.model.parameters())

    trainer.fit(6)  # the injected interrupt does not fire again
    assert_bitwise_equal(params_of(trainer.model), uninterrupted[6][0])
    assert trainer.metrics["loss"].tolist() == [uninterrupted[s][2] for s in range(1, 7)]


def test_fit_in_two_calls_equals_fit_in_one(uninterrupted):
    trainer = _full_trainer()
    trainer.fit(2)
    trainer.fit(2)  # already there: nothing happens
    assert trainer.step_count == 2
    trainer.fit(6)
    assert_bitwise_equal(params_of(trainer.model), uninterrupted[6][0])


class _NothingTrained:
    """Data whose batches train no token, with a position that must be put back."""

    def __init__(self) -> None:
        self.position = 0

    def next_batch(self) -> Batch:
        self.position += 1
        ids = torch.ones(1, 4, dtype=torch.int64)
        return Batch(ids, torch.full_like(ids, IGNORE_INDEX), torch.arange(4)[None], None, 1)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_a_step_without_trained_tokens_raises_and_rolls_back():
    model = tiny_model(0)
    data = _NothingTrained()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data=data,
        grad_accum_steps=3,
        progress=False,
    )
    with pytest.raises(ValueError, match="no trained token"):
        trainer.step()
    assert data.position == 0 and trainer.step_count == 0


# ------------------------------------------------------------------------------ eval and metrics


def test_eval_runs_on_schedule_in_eval_mode_without_touching_the_rng():
    seen_training = []

    def eval_fn(model):
        seen_training.append(model.training)
        torch.rand(3)  # sampling during evaluation must not shift the training RNG stream
        return {"score": 0.5, "eval/other": 1}

    trainer = _full_trainer(eval_fn=eval_fn, eval_every=2)
    rng_before = torch.get_rng_state()
    trainer.evaluate()
    assert torch.equal(torch.get_rng_state(), rng_before)
    metrics = trainer.fit(4)
    assert seen_training == [False, False, False] and trainer.model.training
    assert metrics["eval/score"].notna().tolist() == [False, True, False, True]
    assert metrics.loc[metrics["step"] == 4, "eval/other"].item() == 1.0


def test_metrics_go_to_a_frame_jsonl_tensorboard_and_the_progress_bar(tmp_path, capsys):
    rows = []
    trainer = _full_trainer(
        run_dir=tmp_path, tensorboard=True, callbacks=[lambda t, row: rows.append(row)]
    )
    trainer.progress = True
    frame = trainer.fit(3)
    assert list(frame.columns) == [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "trained_tokens",
        "tokens_per_s",
        "step_time_s",
        "mfu",
    ]
    assert frame["step"].tolist() == [1, 2, 3] and [r["step"] for r in rows] == [1, 2, 3]
    assert (frame["trained_tokens"] > 0).all() and (frame["tokens_per_s"] > 0).all()
    on_disk = read_metrics(tmp_path)
    assert on_disk.to_dict("records") == frame.to_dict("records")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert "3/3" in capsys.readouterr().err


def test_trainer_option_errors(tmp_path):
    model = tiny_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = sft_loader(4, batch_size=2)
    with pytest.raises(ValueError, match="unknown loss 'dpo_typo'.*sft_ce"):
        Trainer(model, opt, data=data, loss="dpo_typo")
    with pytest.raises(TypeError, match="next_batch"):
        Trainer(model, opt, data=[1, 2, 3])
    with pytest.raises(ValueError, match="grad_accum_steps"):
        Trainer(model, opt, data=data, grad_accum_steps=0)
    with pytest.raises(ValueError, match="eval_fn"):
        Trainer(model, opt, data=data, eval_every=5)
    with pytest.raises(ValueError, match="run_dir"):
        Trainer(model, opt, data=data, checkpoint_every=5)
    Trainer(model, opt, data=data, run_dir=tmp_path, progress=False).fit(1)
    with pytest.raises(ValueError, match="already holds a run.*resume=True"):
        Trainer(model, opt, data=data, run_dir=tmp_path)
    with pytest.raises(ValueError, match="num_steps"):
        Trainer(model, opt, data=data, progress=False).fit(-1)


def test_non_finite_step_is_not_applied_and_not_checkpointed(tmp_path):
    """lr=1e6 blows the loss up within a few steps; the first non-finite step raises, leaves the
    parameters of the last finite step (all finite) and writes no checkpoint of NaN weights."""
    from posttrain.core import latest_checkpoint, load_checkpoint
    from posttrain.train.losses import NonFiniteLossError

    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e6),
        data=sft_loader(8, batch_size=2),
        run_dir=tmp_path,
        checkpoint_every=1,
        progress=False,
    )
    with pytest.raises(NonFiniteLossError, match=r"step \d+: loss=.* is not finite"):
        trainer.fit(20)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    good_steps = trainer.step_count
    assert len(trainer.metrics) == good_steps
    ckpt = latest_checkpoint(tmp_path)
    if ckpt is not None:
        state = load_checkpoint(ckpt)["model_state"]
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_nan_weights_fail_at_the_first_step():
    model = tiny_model()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data=sft_loader(8, batch_size=2),
        progress=False,
    )
    with pytest.raises(FloatingPointError, match="step 1: loss=nan"):
        trainer.step()
    assert trainer.step_count == 0
