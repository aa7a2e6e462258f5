"""The DPO family (`posttrain.preference.dpo_family` through `dpo_loss` and `DPOLoss`): every
`loss_type` and `f_divergence_type` of TRL 1.16's `DPOTrainer` against TRL's own code on the same
log-probabilities, DPOP against a hand computation of its equation, and the errors.

Shapes: B = pairs, T = tokens.

TRL 1.16 has no standalone DPO loss function: every formula sits inline in
`DPOTrainer._compute_loss`, which runs the model. As in tests/preference/test_preference.py, the
harness
builds a `DPOTrainer` with `object.__new__` (no model, no dataset), sets the attributes that
method reads (the config values it copies in `__init__`, and `args.discopop_tau`), and passes a
stand-in model whose per-token log-probabilities sum to the log-probabilities under test; the
formulas that run are TRL's own lines. TRL returns the mean loss; its per-pair losses come from
one-pair calls (not for aot, aot_unpaired and sft, which couple the pairs of a batch), its rewards
from its `accelerator.gather` calls, and its gradients from `backward` through the stand-in.
"""

from __future__ import annotations

import inspect
import math
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from _train_helpers import tiny_model
from torch.testing import assert_close

from posttrain.data import PreferenceDataset
from posttrain.models import ByteTokenizer
from posttrain.preference import DPOLoss, compute_reference_logps, dpo_loss, response_logps
from posttrain.preference.dpo_family import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    F_DIVERGENCE_TYPES,
    LENGTH_LOSS_TYPES,
)
from posttrain.train import get_loss

TRL_LOSS_TYPES = tuple(t for t in DPO_LOSS_TYPES if t != "dpop")
COUPLED = {"aot", "aot_unpaired", "sft"}
# the options each loss type is tested with (TRL's defaults otherwise)
OPTIONS = {
    "exo_pair": [{"label_smoothing": 1e-3}, {"label_smoothing": 0.2}],
    "robust": [{}, {"label_smoothing": 0.1}, {"label_smoothing": 0.4}],
    "aot": [{}, {"label_smoothing": 0.2}],
    "aot_unpaired": [{}, {"label_smoothing": 0.2}],
    "discopop": [{}, {"discopop_tau": 0.5}],
}
BETAS = (0.1, 0.5)

# --------------------------------------------------------------------------------------------
# TRL harness
# --------------------------------------------------------------------------------------------


from _trl_harness import _Accelerator, _FixedLogps  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def trl_dpo(
    pc,
    pr,
    rc,
    rr,
    lc,
    lr,
    *,
    beta,
    loss_type="sigmoid",
    loss_weights=None,
    label_smoothing=0.0,
    f_divergence_type="reverse_kl",
    f_alpha_divergence_coef=0.5,
    discopop_tau=0.05,
):
    """TRL `DPOTrainer._compute_loss` on summed log-probs [B] and response lengths [B] (>= 1):
    (mean loss, chosen_rewards [B], rejected_rewards [B])."""
    from trl.trainer.dpo_trainer import DPOTrainer

    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    model = _FixedLogps(torch.cat([pc, pr]))
    trainer = object.__new__(DPOTrainer)
    attributes = dict(
        accelerator=_Accelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        aux_loss_enabled=False,
        args=SimpleNamespace(discopop_tau=discopop_tau),
        model=model,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha_divergence_coef,
        loss_types=types,
        loss_weights=list(loss_weights) if loss_weights else [1.0] * len(types),
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
    )
    for name, value in attributes.items():
        setattr(trainer, name, value)
    lengths = torch.cat([lc, lr]).long()
    rows, T = len(lengths), int(lengths.max()) + 1
    completion_mask = torch.zeros(rows, T, dtype=torch.long)
    for r, n in enumerate(lengths.tolist()):
        completion_mask[r, 1 : 1 + n] = 1
    inputs = {
        "input_ids": torch.ones(rows, T, dtype=torch.long),
        "attention_mask": torch.ones(rows, T, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": rc,
        "ref_rejected_logps": rr,
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    chosen_rewards, rejected_rewards = trainer.accelerator.gathered[:2]
    return loss, chosen_rewards, rejected_rewards


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def _random_batch(seed, B=6):
    """Summed log-probs [B] of policy and reference and response lengths [B] (1..12 tokens);
    per-token log-probs in [-3.05, -0.05], so log-ratios reach about +-30."""
    gen = torch.Generator().manual_seed(seed)
    lc = torch.randint(1, 13, (B,), generator=gen).float()
    lr = torch.randint(1, 13, (B,), generator=gen).float()
    per_token = lambda L: -(0.05 + 3 * torch.rand(B, generator=gen)) * L  # noqa: E731
    return per_token(lc), per_token(lr), per_token(lc), per_token(lr), lc, lr


def _extreme_batch():
    """Log-ratios of +-40 and +-25 (beta 0.5 puts the logits at +-65), and a pair of zeros."""
    pc = torch.tensor([-1.0, -45.0, -2.0, -30.0, -5.0])
    rc = torch.tensor([-41.0, -5.0, -27.0, -5.0, -5.0])
    pr = torch.tensor([-60.0, -3.0, -35.0, -1.0, -7.0])
    rr = torch.tensor([-20.0, -43.0, -10.0, -26.0, -7.0])
    lc = torch.tensor([3.0, 40.0, 1.0, 12.0, 2.0])
    lr = torch.tensor([30.0, 2.0, 9.0, 1.0, 5.0])
    return pc, pr, rc, rr, lc, lr


BATCHES = {
    "seed0": lambda: _random_batch(0),
    "seed1": lambda: _random_batch(1),
    "seed2": lambda: _random_batch(2),
    "batch1": lambda: _random_batch(3, B=1),
    "extreme": _extreme_batch,
}


def _leaves(tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


def _compare(batch, *, beta, per_pair=True, **options):
    """Our losses, mean, rewards and gradients against TRL's on `batch`."""
    pc, pr, rc, rr, lc, lr = batch
    ours_in, trl_in = _leaves((pc, pr, rc, rr)), _leaves((pc, pr, rc, rr))
    losses_B, chosen_B, rejected_B = dpo_loss(
        *ours_in, beta=beta, chosen_lengths_B=lc, rejected_lengths_B=lr, **options
    )
    trl_mean, trl_chosen, trl_rejected = trl_dpo(*trl_in, lc, lr, beta=beta, **options)
    assert losses_B.shape == chosen_B.shape == rejected_B.shape == pc.shape
    assert not chosen_B.requires_grad and not rejected_B.requires_grad
    if not torch.isfinite(losses_B).all():  # overflow of exponential scores, as in TRL
        assert options.get("f_divergence_type", "reverse_kl") in ("forward_kl", "alpha_divergence")
        assert not torch.isfinite(trl_mean)
        nan_ok = True
    else:
        nan_ok = False
    assert_close(losses_B.mean(), trl_mean, equal_nan=nan_ok)
    assert_close(chosen_B, trl_chosen)
    assert_close(rejected_B, trl_rejected)
    losses_B.mean().backward()
    trl_mean.backward()
    for ours, theirs in zip(ours_in, trl_in):  # no grad = a zero grad
        zero = torch.zeros_like(ours)
        assert_close(
            zero if ours.grad is None else ours.grad,
            zero if theirs.grad is None else theirs.grad,
            equal_nan=nan_ok,
        )
    if per_pair:
        one_by_one = torch.stack(
            [
                trl_dpo(*(t[b : b + 1] for t in batch), beta=beta, **options)[0]
                for b in range(len(pc))
            ]
        )
        assert_close(losses_B.detach(), one_by_one.detach(), equal_nan=nan_ok)


# --------------------------------------------------------------------------------------------
# Against TRL
# --------------------------------------------------------------------------------------------


def _quoted(help_text):
    return set(re.findall(r"`'([a-z_]+)'`", help_text))


def test_the_names_are_those_trl_lists():
    """DPO_LOSS_TYPES = TRL 1.16's `DPOConfig.loss_type` values (+ dpop), each one a branch of
    `_compute_loss`; the f-divergences and the loss types that take them are TRL's lists."""
    from trl import DPOConfig
    from trl.trainer.dpo_trainer import DPOTrainer

    fields = DPOConfig.__dataclass_fields__
    assert _quoted(fields["loss_type"].metadata["help"]) == set(TRL_LOSS_TYPES)
    assert DPO_LOSS_TYPES[-1] == "dpop" and len(set(DPO_LOSS_TYPES)) == len(DPO_LOSS_TYPES)
    source = inspect.getsource(DPOTrainer._compute_loss)
    assert set(re.findall(r'loss_type == "([a-z_]+)"', source)) == set(TRL_LOSS_TYPES)
    assert set(re.findall(r'f_divergence_type == "([a-z_]+)"', source)) == set(F_DIVERGENCE_TYPES)
    f_help = fields["f_divergence_type"].metadata["help"]
    assert set(re.findall(r"`([a-z_]+)`", f_help)) == set(F_DIVERGENCE_TYPES)
    assert _quoted(f_help) == set(F_DIVERGENCE_LOSS_TYPES)
    assert fields["f_divergence_type"].default == "reverse_kl"
    assert fields["f_alpha_divergence_coef"].default == 0.5
    assert fields["discopop_tau"].default == 0.05 and fields["label_smoothing"].default == 0.0


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_every_loss_type_matches_trl(loss_type, beta, batch):
    for options in OPTIONS.get(loss_type, [{}]):
        _compare(
            BATCHES[batch](),
            beta=beta,
            loss_type=loss_type,
            per_pair=loss_type not in COUPLED,
            **options,
        )


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize(
    "divergence",
    [
        ("forward_kl", 0.5),
        ("js_divergence", 0.5),
        ("alpha_divergence", 0.5),
        ("alpha_divergence", 0.3),
        ("alpha_divergence", 1.0),
        ("alpha_divergence", 4.0),
    ],
)
@pytest.mark.parametrize("loss_type", sorted(F_DIVERGENCE_LOSS_TYPES))
def test_every_f_divergence_matches_trl(loss_type, divergence, batch):
    """alpha 4 puts the exponent (alpha - 1) rho at 120 on the extreme batch: TRL clamps it at 80.
    discopop with forward_kl or alpha_divergence overflows to NaN in TRL on most of these
    batches (exp(-beta h) = inf times a weight of 0), and ipo's square of those scores to inf
    on the extreme batch at alpha 4; ours is non-finite on the same pairs, and only there."""
    f_divergence_type, alpha = divergence
    extra = {"f_alpha_divergence_coef": alpha} if f_divergence_type == "alpha_divergence" else {}
    for options in OPTIONS.get(loss_type, [{}]):
        _compare(
            BATCHES[batch](),
            beta=0.1,
            loss_type=loss_type,
            per_pair=loss_type not in COUPLED,
            f_divergence_type=f_divergence_type,
            **extra,
            **options,
        )


@pytest.mark.parametrize("batch", ["seed0", "batch1", "extreme"])
@pytest.mark.parametrize(
    "combination",
    [
        (("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0), "reverse_kl"),  # MPO
        (("hinge", "ipo", "robust"), None, "js_divergence"),
        (("apo_zero", "nca_pair", "sppo_hard", "aot"), (1.0, 0.5, 0.1, 2.0), "reverse_kl"),
    ],
)
def test_combined_loss_types_match_trl(combination, batch):
    loss_type, loss_weights, f_divergence_type = combination
    _compare(
        BATCHES[batch](),
        beta=0.1,
        loss_type=loss_type,
        loss_weights=loss_weights,
        f_divergence_type=f_divergence_type,
        per_pair=not COUPLED & set(loss_type),
    )


def test_default_sigmoid_is_the_old_formula_bit_for_bit_and_cdpo_is_kept():
    """The default path is unchanged (recipes' recorded runs depend on it); sigmoid with
    label_smoothing stays cDPO, which TRL 1.16 computes as 'aot' on one pair."""
    pc, pr, rc, rr, lc, lr = _random_batch(0)
    old = -torch.nn.functional.logsigmoid(0.1 * ((pc - rc) - (pr - rr)))
    assert torch.equal(dpo_loss(pc, pr, rc, rr, beta=0.1)[0], old)
    cdpo = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.2)[0]
    aot_one_by_one = torch.stack(
        [
            trl_dpo(
                pc[b : b + 1],
                pr[b : b + 1],
                rc[b : b + 1],
                rr[b : b + 1],
                lc[b : b + 1],
                lr[b : b + 1],
                beta=0.1,
                loss_type="aot",
                label_smoothing=0.2,
            )[0]
            for b in range(len(pc))
        ]
    )
    assert_close(cdpo, aot_one_by_one)
    assert repr(DPOLoss()) == "DPOLoss(beta=0.1, label_smoothing=0.0, loss_type='sigmoid')"


# --------------------------------------------------------------------------------------------
# DPOP by hand
# --------------------------------------------------------------------------------------------


def test_dpop_matches_the_papers_equation_by_hand():
    """Pal et al. 2024, eq. 3: -log s(beta (rho_c - rho_r - lambda max(0, lref_c - lpi_c))).

    beta 0.1, lambda 50. Pair 1: policy chosen -10, ref chosen -9 (the chosen response lost
    likelihood: penalty 1), policy rejected -14, ref rejected -12: rho_c = -1, rho_r = -2,
    logit 0.1 (1 - 50) = -4.9, loss = log(1 + e^4.9) = 4.907419. Pair 2: policy chosen -8 above
    ref -9 (penalty 0), rejected -13 vs -12: logit 0.1 (1 + 1) = 0.2, loss = log(1 + e^-0.2) =
    0.598139 = DPO's. Rewards are DPO's: beta rho = (-0.1, 0.1) and (-0.2, -0.1).
    """
    pc, rc = [-10.0, -8.0], [-9.0, -9.0]
    pr, rr = [-14.0, -13.0], [-12.0, -12.0]
    beta, lam = 0.1, 50.0
    expected = []
    for b in range(2):
        penalty = max(0.0, rc[b] - pc[b])
        logit = beta * ((pc[b] - rc[b]) - (pr[b] - rr[b]) - lam * penalty)
        expected.append(math.log1p(math.exp(-logit)))  # -log sigmoid(logit)
    assert expected == pytest.approx([4.907419, 0.598139], abs=1e-6)
    losses, chosen, rejected = dpo_loss(
        *(torch.tensor(v) for v in (pc, pr, rc, rr)), beta=beta, loss_type="dpop", dpop_lambda=lam
    )
    assert_close(losses, torch.tensor(expected))
    assert_close(chosen, torch.tensor([-0.1, 0.1]))
    assert_close(rejected, torch.tensor([-0.2, -0.1]))
    # lambda 0 (or no lost likelihood) is DPO; the default lambda is 50
    t = [torch.tensor(v) for v in (pc, pr, rc, rr)]
    assert_close(dpo_loss(*t, loss_type="dpop", dpop_lambda=0.0)[0], dpo_loss(*t)[0])
    assert_close(dpo_loss(*t, loss_type="dpop")[0], losses)
    # the penalty pushes the chosen log-prob up while it is below the reference
    leaf = t[0].clone().requires_grad_(True)
    dpo_loss(leaf, *t[1:], loss_type="dpop")[0].sum().backward()
    s = 1 / (1 + math.exp(4.9))  # d/dx -log s(x) = -(1 - s(x)) at x = -4.9
    assert leaf.grad[0].item() == pytest.approx(-(1 - s) * beta * (1 + lam), rel=1e-5)


# --------------------------------------------------------------------------------------------
# Through the registry, on a real model
# --------------------------------------------------------------------------------------------


def _pair_batch():
    rows = [
        {
            "prompt": f"{3 + 7 * i}+{11 + 5 * i}=" + "?" * (i % 3),
            "chosen": str(14 + 12 * i) + " ok" * (i % 2),
            "rejected": str(15 + 12 * i) + "!" * (i % 4),
        }
        for i in range(3)
    ]
    ds = PreferenceDataset(rows, ByteTokenizer(), max_seq_len=64)
    compute_reference_logps(tiny_model(1), ds, batch_size=3)
    return ds.collate([0, 1, 2])


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_objective_takes_every_loss_type_by_name(loss_type):
    """get_loss("dpo", loss_type=...) on a tiny model equals TRL on the model's log-probs and
    response lengths, and its step share backpropagates."""
    options = OPTIONS.get(loss_type, [{}])[-1]
    objective = get_loss("dpo", loss_type=loss_type, beta=0.5, **options)
    assert isinstance(objective, DPOLoss)
    batch, model = _pair_batch(), tiny_model(0)
    losses_B, chosen_B, rejected_B = objective.pair_losses(model, batch)
    with torch.no_grad():
        input_ids, attention_mask, response_mask = batch.concatenated()
        logps_2B, lengths_2B = response_logps(model, input_ids, attention_mask, response_mask)
    pc, pr = logps_2B.chunk(2)
    lc, lr = lengths_2B.float().chunk(2)
    if loss_type == "dpop":
        want = dpo_loss(
            pc, pr, batch.ref_chosen_logps, batch.ref_rejected_logps, beta=0.5, loss_type="dpop"
        )
        assert_close(losses_B.detach(), want[0])
    else:
        trl_mean, trl_chosen, _ = trl_dpo(
            pc,
            pr,
            batch.ref_chosen_logps,
            batch.ref_rejected_logps,
            lc,
            lr,
            beta=0.5,
            loss_type=loss_type,
            **options,
        )
        assert_close(losses_B.mean().detach(), trl_mean)
        assert_close(chosen_B, trl_chosen)
    share = objective(model, batch, torch.tensor(3))
    share.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_bad_options_raise_naming_the_field_and_the_allowed_values():
    z, one = torch.zeros(2), torch.ones(2)
    lengths = {"chosen_lengths_B": one, "rejected_lengths_B": one}
    allowed = ", ".join(DPO_LOSS_TYPES)
    with pytest.raises(ValueError, match=re.escape(f"loss_type='nope'; allowed: {allowed}")):
        dpo_loss(z, z, z, z, loss_type="nope")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "f_divergence_type='kl'; allowed: reverse_kl, forward_kl, js_divergence, "
            "alpha_divergence"
        ),
    ):
        dpo_loss(z, z, z, z, f_divergence_type="kl")
    with pytest.raises(ValueError, match="f_divergence_type='forward_kl' works only with"):
        dpo_loss(z, z, z, z, loss_type="nca_pair", f_divergence_type="forward_kl")
    with pytest.raises(
        ValueError,
        match="f_alpha_divergence_coef=0.3 is read only by f_divergence_type='alpha_divergence'",
    ):
        dpo_loss(z, z, z, z, f_alpha_divergence_coef=0.3)
    with pytest.raises(
        ValueError,
        match="label_smoothing=0.1 is read only by loss_type aot, "
        "aot_unpaired, exo_pair, robust, sigmoid",
    ):
        dpo_loss(z, z, z, z, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="discopop_tau=0.5 is read only by loss_type discopop"):
        dpo_loss(z, z, z, z, discopop_tau=0.5)
    with pytest.raises(ValueError, match="dpop_lambda=5.0 is read only by loss_type dpop"):
        dpo_loss(z, z, z, z, dpop_lambda=5.0)
    with pytest.raises(ValueError, match="label_smoothing=0 with loss_type 'exo_pair'"):
        dpo_loss(z, z, z, z, loss_type="exo_pair")
    with pytest.raises(ValueError, match="label_smoothing=0.5"):
        dpo_loss(z, z, z, z, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_weights=\\[1.0\\]; must be 2 finite"):
        dpo_loss(z, z, z, z, loss_type=["sigmoid", "hinge"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="distinct names"):
        dpo_loss(z, z, z, z, loss_type=["sigmoid", "sigmoid"])
    for name, value in (
        ("discopop_tau", 0.0),
        ("dpop_lambda", -1.0),
        ("f_alpha_divergence_coef", math.inf),
    ):
        with pytest.raises(ValueError, match=f"{name}="):
            dpo_loss(z, z, z, z, **{name: value})
    for loss_type in LENGTH_LOSS_TYPES:
        with pytest.raises(
            ValueError, match=f"loss_type='{loss_type}'; allowed: .* without response lengths"
        ):
            dpo_loss(z, z, z, z, loss_type=loss_type)
        dpo_loss(z, z, z, z, loss_type=loss_type, **lengths)  # fine with them
    with pytest.raises(ValueError, match="both chosen_lengths_B and rejected_lengths_B"):
        dpo_loss(z, z, z, z, loss_type="ipo", chosen_lengths_B=one)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        dpo_loss(z, z, z, z, loss_type="ipo", chosen_lengths_B=-one, rejected_lengths_B=one)
    # the objective checks the same options when built
    with pytest.raises(ValueError, match="loss_type='nope'; allowed: sigmoid"):
        get_loss("dpo", loss_type="nope")
    with pytest.raises(ValueError, match="f_divergence_type='js_divergence' works only"):
        DPOLoss(loss_type="aot", f_divergence_type="js_divergence")
