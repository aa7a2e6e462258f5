"""Preference optimisation through the Trainer: gradient accumulation (batch 1 x accumulation 4
equals batch 4 x 1 equals a plain loop) for every objective, KTO's exact accumulation without
the KL estimate, the registered objectives and their need for reference log-probs, and bad
inputs to the pure losses. The losses against TRL are in tests/preference/test_preference.py;
the data side is in tests/preference/test_preference_data.py.

Shapes: B = pairs, N = KTO rows, T = tokens."""

from __future__ import annotations

import math

import pytest
import torch
from _preference_helpers import pair_dataset, pair_rows
from _train_helpers import assert_grads_close, tiny_model
from _trl_harness import _close

from posttrain.data import KTODataset, PreferenceDataset, PreferenceLoader, pairs_to_kto_rows
from posttrain.models import ByteTokenizer
from posttrain.preference import (
    DPOLoss,
    IPOLoss,
    KTOLoss,
    ORPOLoss,
    SimPOLoss,
    compute_reference_logps,
    dpo_loss,
    ipo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    step_share,
)
from posttrain.train import Trainer, TrainingLoss, get_loss, registered_losses

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _one_step(loss, dataset, *, batch_size, grad_accum):
    model = tiny_model(0)
    opt = _RecordingSGD(model.parameters())
    loader = PreferenceLoader(dataset, batch_size=batch_size, shuffle=False)
    row = Trainer(
        model, opt, data=loader, loss=loss, grad_accum_steps=grad_accum, progress=False
    ).step()
    return row, opt.seen[0]


LOSSES = [
    ("dpo", {}),
    ("dpo", {"label_smoothing": 0.1}),
    ("dpo", {"loss_type": "hinge"}),
    ("ipo", {}),
    ("ipo", {"length_normalize": False}),
    ("simpo", {}),
    ("orpo", {}),
]


@pytest.mark.parametrize("name,options", LOSSES, ids=[f"{n}{o}" for n, o in LOSSES])
def test_batch1_accum4_equals_batch4_accum1_equals_a_plain_loop(name, options):
    """The gradient of the mean over the step's 4 pairs, whatever the micro-batching; and the
    same as a loop over single pairs that calls the pure loss directly."""
    dataset = pair_dataset(4)
    loss = get_loss(name, **options)
    row_14, grads_14 = _one_step(loss, dataset, batch_size=1, grad_accum=4)
    row_41, grads_41 = _one_step(loss, dataset, batch_size=4, grad_accum=1)
    assert row_14["trained_tokens"] == row_41["trained_tokens"] == 4  # the step's pairs
    # relative where the loss exceeds 1: IPO's is ~24, where one float32 step is 1.9e-6
    assert row_14["loss"] == pytest.approx(row_41["loss"], rel=1e-6, abs=1e-6)
    assert_grads_close(grads_14, grads_41)  # IPO's gradients reach ~40

    model = tiny_model(0)
    total = 0.0
    for i in range(4):
        batch = dataset.collate([i])
        total_i = loss.pair_losses(model, batch)[0].sum() / 4
        total_i.backward()
        total += float(total_i.detach())
    assert row_41["loss"] == pytest.approx(total, rel=1e-6, abs=1e-6)
    assert_grads_close(grads_41, [p.grad for p in model.parameters()])


def test_kto_accumulation_is_exact_without_the_kl_estimate_and_uses_z0_per_micro_batch():
    rows = pairs_to_kto_rows(pair_rows(3))
    dataset = KTODataset(rows, ByteTokenizer(), max_seq_len=64)
    compute_reference_logps(tiny_model(1), dataset)
    assert [d["desirable"] for d in dataset] == [True, False] * 3
    row_16, grads_16 = _one_step(KTOLoss(use_kl=False), dataset, batch_size=1, grad_accum=6)
    row_61, grads_61 = _one_step(KTOLoss(use_kl=False), dataset, batch_size=6, grad_accum=1)
    assert row_16["loss"] == pytest.approx(row_61["loss"], rel=1e-6, abs=1e-6)
    assert_grads_close(grads_16, grads_61)
    # with the estimate, z0 comes from each micro-batch's own mismatched pairs (as in TRL)
    with_kl = KTOLoss()
    batch = dataset.collate(range(6))
    model = tiny_model(0)
    losses, _, _ = with_kl.row_losses(model, batch)
    from posttrain.preference import response_logps

    kl_logps, _ = response_logps(
        model, batch.kl_input_ids, batch.kl_attention_mask, batch.kl_response_mask
    )
    z0 = kto_reference_point(kl_logps, batch.ref_kl_logps)
    logps, _ = response_logps(model, batch.input_ids, batch.attention_mask, batch.response_mask)
    expected = kto_loss(logps, batch.ref_logps, batch.desirable, reference_point=z0)[0]
    _close(losses, expected)
    assert float(z0) > 0  # a different reference model: the estimate is in play


def test_objectives_are_registered_and_need_reference_logps():
    assert {"dpo", "ipo", "simpo", "kto", "orpo"} <= set(registered_losses())
    for name, cls in [
        ("dpo", DPOLoss),
        ("ipo", IPOLoss),
        ("simpo", SimPOLoss),
        ("kto", KTOLoss),
        ("orpo", ORPOLoss),
    ]:
        loss = get_loss(name)
        assert isinstance(loss, cls) and isinstance(loss, TrainingLoss)
    dataset = PreferenceDataset(pair_rows(2), ByteTokenizer(), max_seq_len=64)
    batch = dataset.collate([0, 1])
    with pytest.raises(ValueError, match="compute_reference_logps"):
        DPOLoss()(tiny_model(0), batch, torch.tensor(2))
    share = SimPOLoss()(tiny_model(0), batch, torch.tensor(2))  # reference-free
    assert share.requires_grad and torch.isfinite(share)
    metrics = DPOLoss().metrics(tiny_model(0), pair_dataset(2, reference_seed=0).collate([0, 1]))
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference
    assert metrics["reward_margin"] == pytest.approx(0.0, abs=1e-5)


# --------------------------------------------------------------------------------------------
# Bad inputs to the losses: a clear error naming the argument
# --------------------------------------------------------------------------------------------


def test_pure_losses_reject_non_finite_and_non_tensor_inputs():
    z, ninf = torch.zeros(2), torch.full((2,), -math.inf)
    with pytest.raises(
        ValueError, match="policy_chosen_logps_B, policy_rejected_logps_B must be finite"
    ):
        dpo_loss(ninf, ninf, z, z)
    with pytest.raises(TypeError, match="policy_chosen_logps_B is a list"):
        dpo_loss([0.0, 0.0], z, z, z)
    with pytest.raises(ValueError, match="average log-probs < 0"):
        orpo_loss(torch.tensor([0.0, -1.0]), torch.tensor([-1.0, -2.0]))
    with pytest.raises(ValueError, match="average log-probs < 0"):
        orpo_loss(torch.tensor([0.5]), torch.tensor([-1.0]))
    desirable = torch.tensor([True, False])
    with pytest.raises(ValueError, match="reference_point must be a finite scalar"):
        kto_loss(z, z, desirable, reference_point=math.nan)
    with pytest.raises(ValueError, match=r"reference_point must be a finite scalar.*shape \(2,\)"):
        kto_loss(z, z, desirable, reference_point=torch.zeros(2))
    with pytest.raises(ValueError, match="num_units_in_step=0; it counts the pairs"):
        step_share(z, torch.tensor(0))
    with pytest.raises(ValueError, match="num_units_in_step=-2"):
        step_share(z, -2)
    with pytest.raises(ValueError, match="response lengths must be >= 0"):
        ipo_loss(
            z,
            z,
            z,
            z,
            chosen_lengths_B=torch.tensor([1, -1]),
            rejected_lengths_B=torch.tensor([1, 1]),
        )


def test_an_unknown_loss_name_lists_the_registered_losses():
    from posttrain.core.registry import _plural

    with pytest.raises(ValueError, match="registered losses: "):
        get_loss("no_such_loss")
    assert [_plural(k) for k in ("loss", "verifier", "task", "policy", "key")] == [
        "losses",
        "verifiers",
        "tasks",
        "policies",
        "keys",
    ]
