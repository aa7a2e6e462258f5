"""Losses: token cross-entropy, step normalisation pinned by a hand-computed case, registry.

Shapes: B = batch, T = tokens, V = vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.train import (
    IGNORE_INDEX,
    SFTCrossEntropy,
    TrainingLoss,
    get_loss,
    losses,
    normalize_by_step,
    register_loss,
    registered_losses,
    token_cross_entropy_sum,
)


def _logits_with_ce(targets_ce: list[float], V: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [1, T, V] and labels [1, T] whose per-token cross-entropy is `targets_ce`.

    With logits (0, x) and label 0 over V = 2 classes, CE = log(1 + e^x), so x = log(e^CE - 1).
    """
    x = torch.tensor([math.log(math.expm1(ce)) for ce in targets_ce], dtype=torch.float64)
    logits_1TV = torch.stack([torch.zeros_like(x), x], dim=-1)[None].float()
    labels_1T = torch.zeros(1, len(targets_ce), dtype=torch.int64)
    return logits_1TV, labels_1T


def test_step_loss_worked_case_is_the_token_mean_not_the_mean_of_means():
    """Micro-batch A: 1 trained token with loss 2.0. Micro-batch B: 3 tokens with loss 1.0 each.

    Step loss = (2.0 + 1.0 + 1.0 + 1.0) / 4 = 1.25 (token mean over the whole step), while the
    mean of the per-micro-batch means would be (2.0 / 1 + 3.0 / 3) / 2 = 1.5.
    """
    logits_a, labels_a = _logits_with_ce([2.0])
    logits_b, labels_b = _logits_with_ce([1.0, 1.0, 1.0])
    sum_a, n_a = token_cross_entropy_sum(logits_a, labels_a)
    sum_b, n_b = token_cross_entropy_sum(logits_b, labels_b)
    assert (int(n_a), int(n_b)) == (1, 3)
    assert float(sum_a) == pytest.approx(2.0, rel=1e-6, abs=1e-6)
    assert float(sum_b) == pytest.approx(3.0, rel=1e-6, abs=1e-6)

    n_step = n_a + n_b
    step_loss = normalize_by_step(sum_a, n_step) + normalize_by_step(sum_b, n_step)
    assert float(step_loss) == pytest.approx(1.25, rel=1e-6, abs=1e-6)
    mean_of_means = (sum_a / n_a + sum_b / n_b) / 2
    assert float(mean_of_means) == pytest.approx(1.5, rel=1e-6, abs=1e-6)

    # The exact numbers, without logits: shares 2/4 + 3/4.
    shares = normalize_by_step(torch.tensor(2.0), 4) + normalize_by_step(torch.tensor(3.0), 4)
    assert float(shares) == 1.25


def test_token_cross_entropy_sum_matches_torch_mean_times_count():
    torch.manual_seed(0)
    B, T, V = 3, 5, 11
    logits_BTV = torch.randn(B, T, V)
    labels_BT = torch.randint(0, V, (B, T))
    labels_BT[0, :2] = IGNORE_INDEX
    labels_BT[2, -1] = IGNORE_INDEX
    loss_sum, n = token_cross_entropy_sum(logits_BTV, labels_BT)
    assert loss_sum.shape == () and loss_sum.dtype == torch.float32
    assert n.shape == () and n.dtype == torch.int64 and int(n) == B * T - 3
    mean = F.cross_entropy(
        logits_BTV.reshape(-1, V), labels_BT.reshape(-1), ignore_index=IGNORE_INDEX
    )
    torch.testing.assert_close(loss_sum, mean * n, rtol=1e-6, atol=1e-6)


def test_token_cross_entropy_sum_of_nothing_trained_is_zero_with_zero_gradient():
    logits_BTV = torch.randn(2, 4, 7, requires_grad=True)
    loss_sum, n = token_cross_entropy_sum(logits_BTV, torch.full((2, 4), IGNORE_INDEX))
    loss_sum.backward()
    assert float(loss_sum.detach()) == 0.0 and int(n) == 0
    assert torch.count_nonzero(logits_BTV.grad) == 0


def test_token_cross_entropy_sum_computes_in_fp32_for_low_precision_logits():
    logits_BTV = torch.randn(1, 3, 5).to(torch.bfloat16)
    loss_sum, _ = token_cross_entropy_sum(logits_BTV, torch.tensor([[1, 2, 3]]))
    assert loss_sum.dtype == torch.float32


@pytest.mark.parametrize("logits_shape, labels_shape", [((2, 3, 5), (2, 4)), ((6, 5), (2, 3))])
def test_token_cross_entropy_sum_rejects_mismatched_shapes(logits_shape, labels_shape):
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        token_cross_entropy_sum(
            torch.zeros(logits_shape), torch.zeros(labels_shape, dtype=torch.int64)
        )


def test_normalize_by_step_rejects_an_empty_step():
    with pytest.raises(ValueError, match="at least one token"):
        normalize_by_step(torch.tensor(1.0), 0)


def test_sft_ce_is_registered_and_satisfies_the_protocol():
    assert "sft_ce" in registered_losses()
    loss = get_loss("sft_ce")
    assert isinstance(loss, SFTCrossEntropy) and isinstance(loss, TrainingLoss)


def test_unknown_loss_lists_the_registered_names():
    with pytest.raises(ValueError, match="unknown loss 'nope'.*sft_ce"):
        get_loss("nope")


def test_registering_a_name_twice_is_an_error():
    class OtherCrossEntropy(SFTCrossEntropy):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_loss("sft_ce")(OtherCrossEntropy)


def test_a_registered_loss_is_built_with_its_options(monkeypatch):
    # leave the real registry alone
    monkeypatch.setattr(losses.LOSSES, "_factories", dict(losses.LOSSES._factories))

    @register_loss("scaled_ce")
    class Scaled(SFTCrossEntropy):
        def __init__(self, *, scale: float) -> None:
            super().__init__()
            self.scale = scale

    built = get_loss("scaled_ce", scale=2.0)
    assert isinstance(built, Scaled) and built.scale == 2.0
    assert "scaled_ce" in registered_losses()


def test_sft_ce_calls_the_model_with_mask_and_positions_and_divides_by_the_step_count():
    """A stand-in model returning fixed logits: the share is loss_sum / num_units_in_step."""
    from posttrain.data import Batch

    seen = {}
    B, T, V = 1, 3, 4

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, tokens, *, mask=None, input_pos=None):
            seen.update(tokens=tokens, mask=mask, input_pos=input_pos)
            return torch.zeros(B, T, V) + self.w

    batch = Batch(
        torch.tensor([[5, 6, 7]]),
        torch.tensor([[1, IGNORE_INDEX, 2]]),
        torch.tensor([[0, 1, 0]]),
        torch.ones(1, 3, 3, dtype=torch.bool),
        2,
    )
    loss = SFTCrossEntropy()
    assert int(loss.num_units(batch)) == 2
    share = loss(Fixed(), batch, torch.tensor(8))
    # Two trained tokens, uniform over 4 classes: 2 * log 4, divided by the step's 8 tokens.
    assert float(share.detach()) == pytest.approx(2 * math.log(4) / 8, rel=1e-6)
    assert torch.equal(seen["input_pos"], batch.position_ids)
    assert torch.equal(seen["mask"], batch.attention_mask)
