"""Masked positions never bring NaN or inf into a loss, a gradient or a metric: the whole kind.

For every loss / estimator / metric (taken from the registries, so a new one is covered), the
masked positions of every input are filled with NaN, +inf, -inf and 1e30, and the loss, every
gradient and every returned metric must equal those computed with zeros there (to 1e-6, NaN
never equal). The zero-filled run is the reference: masked positions must not matter at all.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain import rl
from posttrain.core.masked import keep_selected, masked_max, masked_mean, masked_sum
from posttrain.rl import config as rl_config
from posttrain.rl.algorithms import (
    aggregate,
    compute_advantages,
    kl_loss,
    policy_loss,
    sequence_advantages,
    value_loss,
)
from posttrain.rl.config import KL_ESTIMATORS, LOSS_AGG_MODES, RLAlgorithm
from posttrain.train.losses import token_cross_entropy_sum

POISONS = (math.nan, math.inf, -math.inf, 1e30)
# right-padded response masks of different lengths: rows 1-3 have padding
MASK_BT = torch.tensor(
    [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32
)


def _poisoned(x: torch.Tensor, value: float, mask: torch.Tensor = MASK_BT) -> torch.Tensor:
    return torch.where(mask != 0, x, torch.full_like(x, value))


def _close(got, want, what):
    if isinstance(want, dict):
        assert set(got) == set(want), what
        for key in want:
            _close(got[key], want[key], f"{what}[{key}]")
        return
    got = torch.as_tensor(got, dtype=torch.float64)
    want = torch.as_tensor(want, dtype=torch.float64)
    assert torch.isfinite(want).all(), f"{what}: the zero-filled reference is not finite"
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, msg=what)  # IPO reaches ~25


def _rollout(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(4, 5, generator=gen) * 2
    return {
        "logprobs_BT": old + 0.3 * torch.randn(4, 5, generator=gen),
        "old_logprobs_BT": old,
        "ref_logprobs_BT": old + 0.3 * torch.randn(4, 5, generator=gen),
        "advantages_BT": torch.randn(4, 5, generator=gen),
        "entropy_BT": torch.rand(4, 5, generator=gen),
        "rollout_is_weights_BT": 0.5 + torch.rand(4, 5, generator=gen),
    }


def test_helpers_by_hand():
    """x = [[1, NaN], [3, inf]] on mask [[1, 0], [1, 0]]: sum 4, mean 2, max 3, row means
    [1, 3]; an empty mask gives sum 0, mean 0, max `empty`; the gradient on masked entries is 0."""
    x = torch.tensor([[1.0, math.nan], [3.0, math.inf]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 0]])
    with torch.no_grad():
        assert float(masked_sum(x, mask)) == 4.0 and float(masked_mean(x, mask)) == 2.0
        assert float(masked_max(x, mask)) == 3.0
        assert masked_mean(x, mask, dim=-1).tolist() == [1.0, 3.0]
        none = torch.zeros(2, 2)
        assert (
            float(masked_sum(x, none)),
            float(masked_mean(x, none)),
            float(masked_max(x, none, empty=-1.0)),
        ) == (0.0, 0.0, -1.0)
    masked_mean(torch.exp(keep_selected(x, mask)), mask).backward()
    assert x.grad[:, 1].tolist() == [0.0, 0.0]
    assert x.grad[:, 0].tolist() == pytest.approx([math.e / 2, math.exp(3) / 2])
    # weights: (1 * 2 + 3 * 1) / 3
    weights = torch.tensor([[2.0, 0.0], [1.0, 0.0]])
    assert float(masked_mean(x.detach(), weights)) == pytest.approx(5 / 3)


def _policy_run(name: str, inputs: dict[str, torch.Tensor]):
    options = {"dro_beta": 0.1} if name == "dro" else {}
    mode = rl_config.FIXED_AGG_MODE.get(name, "seq-mean-token-mean")
    algo = RLAlgorithm(
        policy_loss=name,
        loss_agg_mode=mode,
        policy_loss_options=options,
        kl_coef=0.1,
        entropy_coef=0.01,
    )
    leaves = {
        k: v.clone().requires_grad_(k in ("logprobs_BT", "entropy_BT")) for k, v in inputs.items()
    }
    torch.manual_seed(0)  # clip_cov / kl_cov draw random tokens
    loss, metrics = policy_loss(
        leaves["logprobs_BT"],
        leaves["old_logprobs_BT"],
        leaves["advantages_BT"],
        MASK_BT,
        algo=algo,
        ref_logprobs_BT=leaves["ref_logprobs_BT"],
        entropy_BT=leaves["entropy_BT"],
        num_units_in_step=4,
        rollout_is_weights_BT=leaves["rollout_is_weights_BT"],
    )
    loss.backward()
    return {
        "loss": loss.detach(),
        "grad_logprobs": leaves["logprobs_BT"].grad,
        "grad_entropy": leaves["entropy_BT"].grad,
        "metrics": metrics,
    }


@pytest.mark.parametrize("name", rl.policy_losses())
def test_every_policy_loss_ignores_masked_positions(name):
    """Every input at once with each poison, then each input alone with NaN."""
    clean = _rollout()
    want = _policy_run(name, {k: _poisoned(v, 0.0) for k, v in clean.items()})
    for value in POISONS:
        got = _policy_run(name, {k: _poisoned(v, value) for k, v in clean.items()})
        _close(got, want, f"{name}, all inputs {value}")
    for key in clean:
        inputs = {k: _poisoned(v, math.nan if k == key else 0.0) for k, v in clean.items()}
        _close(_policy_run(name, inputs), want, f"{name}, {key} NaN")


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_every_kl_estimator_ignores_masked_positions(estimator):
    clean = _rollout(1)

    def run(logp, ref):
        logp = logp.clone().requires_grad_(True)
        loss, kl_BT = kl_loss(logp, ref, MASK_BT, estimator=estimator, loss_agg_mode="token-mean")
        loss.backward()
        return {"loss": loss.detach(), "kl_BT": kl_BT, "grad": logp.grad}

    want = run(_poisoned(clean["logprobs_BT"], 0.0), _poisoned(clean["ref_logprobs_BT"], 0.0))
    for value in POISONS:
        for poison_logp, poison_ref in ((True, False), (False, True), (True, True)):
            got = run(
                _poisoned(clean["logprobs_BT"], value if poison_logp else 0.0),
                _poisoned(clean["ref_logprobs_BT"], value if poison_ref else 0.0),
            )
            _close(got, want, f"{estimator} {value} logp={poison_logp} ref={poison_ref}")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_aggregation_mode_ignores_masked_positions(mode):
    """Hand check of the reference: L = 1 everywhere is the worked case of `aggregate`."""
    factor = {"loss_scale_factor": 5} if mode == "seq-mean-token-sum-norm" else {}

    def run(loss_BT):
        leaf = loss_BT.clone().requires_grad_(True)
        out = aggregate(leaf, MASK_BT, loss_agg_mode=mode, **factor)
        out.backward()
        return {"loss": out.detach(), "grad": leaf.grad}

    want = run(_poisoned(torch.ones(4, 5), 0.0))
    assert float(want["loss"]) == pytest.approx(
        {
            "token-mean": 1.0,
            "token-sum": 14.0,
            "seq-mean-token-sum": 3.5,
            "seq-mean-token-mean": 1.0,
            "seq-mean-token-sum-norm": 14 / 4 / 5,
        }[mode]
    )
    for value in POISONS:
        _close(run(_poisoned(torch.ones(4, 5), value)), want, f"{mode} {value}")


def test_value_loss_ignores_masked_positions():
    gen = torch.Generator().manual_seed(2)
    clean = {k: torch.randn(4, 5, generator=gen) for k in ("values", "old", "returns")}
    algo = RLAlgorithm.ppo()

    def run(inputs):
        values = inputs["values"].clone().requires_grad_(True)
        loss, metrics = value_loss(values, inputs["old"], inputs["returns"], MASK_BT, algo=algo)
        loss.backward()
        return {"loss": loss.detach(), "grad": values.grad, "metrics": metrics}

    want = run({k: _poisoned(v, 0.0) for k, v in clean.items()})
    for value in POISONS:
        for key in (*clean, "all"):
            inputs = {
                k: _poisoned(v, value if key in (k, "all") else 0.0) for k, v in clean.items()
            }
            _close(run(inputs), want, f"value loss, {key} {value}")


@pytest.mark.parametrize("name", rl.advantage_estimators())
def test_every_advantage_estimator_ignores_masked_positions(name):
    """Token rewards (on the last response token of each row) and values poisoned on padding;
    `sequence_advantages` of poisoned advantages equals that of zero-filled ones."""
    gen = torch.Generator().manual_seed(3)
    last_B = MASK_BT.sum(-1).long() - 1
    rewards_BT = torch.zeros(4, 5)
    rewards_BT[torch.arange(4), last_B] = torch.rand(4, generator=gen)
    values_BT = torch.rand(4, 5, generator=gen)

    def run(rewards, values):
        adv, ret = compute_advantages(
            name,
            token_level_rewards_BT=rewards,
            response_mask_BT=MASK_BT,
            group_ids=[0, 0, 1, 1],
            values_BT=values,
        )
        return {"advantages": adv, "returns": ret}

    want = run(_poisoned(rewards_BT, 0.0), _poisoned(values_BT, 0.0))
    for value in POISONS:
        got = run(_poisoned(rewards_BT, value), _poisoned(values_BT, value))
        _close(got, want, f"{name} {value}")
        _close(
            sequence_advantages(_poisoned(want["advantages"], value), MASK_BT),
            sequence_advantages(want["advantages"], MASK_BT),
            f"{name} sequence {value}",
        )
    with pytest.raises(ValueError, match="NaN or inf on response tokens"):
        run(torch.full((4, 5), math.nan), values_BT)


def test_cross_entropy_ignores_untrained_logits():
    """Logits of ignored positions hold NaN / inf / 1e30: loss and logits gradient equal the
    zero-filled run, which is checked by hand: uniform logits give log 4 per trained token."""
    labels_BT = torch.tensor([[2, -100, 1], [-100, 0, -100]])
    trained_BT1 = (labels_BT != -100)[..., None].expand(2, 3, 4)

    def run(logits):
        leaf = logits.clone().requires_grad_(True)
        loss_sum, n = token_cross_entropy_sum(leaf, labels_BT)
        loss_sum.backward()
        return {"loss": loss_sum.detach(), "n": n, "grad": leaf.grad}

    want = run(torch.zeros(2, 3, 4))
    assert float(want["loss"]) == pytest.approx(3 * math.log(4)) and int(want["n"]) == 3
    for value in POISONS:
        _close(run(_poisoned(torch.zeros(2, 3, 4), value, trained_BT1)), want, f"CE {value}")
    # the kind exists: F.cross_entropy's ignore_index alone gives NaN gradients there
    leaf = _poisoned(torch.zeros(2, 3, 4), math.nan, trained_BT1).requires_grad_(True)
    F.cross_entropy(leaf.flatten(0, 1), labels_BT.flatten(), reduction="sum").backward()
    assert torch.isnan(leaf.grad).any()


@pytest.fixture(scope="module")
def tiny_model():
    from posttrain.policy import Policy

    return Policy.from_spec("tiny-1m", seed=0).model


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_token_logprobs_ignores_logits_of_unscored_positions(tiny_model, top_p):
    """A real tiny model whose logits on prompt and padding positions are replaced by NaN /
    inf / 1e30 (a forward hook on the model): the scored log-probs, the gradient of the logits
    (what the model's own layers would receive) and every parameter gradient equal those of the
    same model with zero logits there."""
    from posttrain.policy.sampling import token_logprobs

    model = tiny_model
    input_ids_BT = torch.tensor([[1, 40, 41, 42, 43, 0], [1, 50, 51, 52, 0, 0]])
    attention_BT = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    response_BT = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    # logits at t - 1 predict the token at t: positions t - 1 of scored tokens are used
    used_BT1 = F.pad(response_BT[:, 1:], (0, 1))[..., None]
    fill = {"value": 0.0}

    def poison(module, args, out):
        out = torch.where(used_BT1, out, torch.full_like(out, fill["value"]))
        out.retain_grad()  # the gradient a model's own layers would receive
        fill["logits"] = out
        return out

    handle = model.register_forward_hook(poison)

    def run(value):
        fill["value"] = value
        model.zero_grad(set_to_none=True)
        lp_BT = token_logprobs(model, input_ids_BT, attention_BT, response_BT, top_p=top_p)
        lp_BT.sum().backward()
        return {
            "logprobs": lp_BT.detach(),
            "grad_logits": fill["logits"].grad,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        }

    try:
        want = run(0.0)
        for value in POISONS:
            _close(run(value), want, f"token_logprobs top_p={top_p} {value}")
    finally:
        handle.remove()


# Objectives of the trainer's loss registry, each with a batch of rows of different lengths.
# bradley_terry scores whole sequences with a reward model (one value per row, read at its last
# real token): it has no per-token masked reduction. A newly registered loss fails
# `test_every_registered_objective_ignores_padding_logits` until it is given a batch here.
_NOT_TOKEN_LEVEL = {"bradley_terry"}


def _objective_batch(name: str):
    from _train_helpers import sft_dataset, tiny_model

    from posttrain.data import KTODataset, PreferenceDataset, SFTLoader, pairs_to_kto_rows
    from posttrain.models import ByteTokenizer
    from posttrain.preference import compute_reference_logps

    rows = [
        {
            "prompt": f"{3 + 7 * i}+{11 + 5 * i}=" + "?" * (i % 3),
            "chosen": str(14 + 12 * i) + " ok" * (i % 2),
            "rejected": str(15 + 12 * i) + "!" * (i % 4),
        }
        for i in range(4)
    ]
    if name in ("sft_ce", "gkd"):
        return next(iter(SFTLoader(sft_dataset(4), batch_size=4, shuffle=False)))
    if name == "kto":
        dataset = KTODataset(pairs_to_kto_rows(rows), ByteTokenizer(), max_seq_len=64)
        compute_reference_logps(tiny_model(1), dataset)
        return dataset.collate(range(len(dataset)))
    if name in ("dpo", "ipo", "simpo", "orpo"):
        dataset = PreferenceDataset(rows, ByteTokenizer(), max_seq_len=64)
        compute_reference_logps(tiny_model(1), dataset, batch_size=3)
        return dataset.collate(range(4))
    raise AssertionError(f"no test batch for the registered loss {name!r}: add one here")


def _objective_options(name: str) -> dict:
    """Options of objectives built from parts (GKD: a frozen teacher and the student)."""
    if name != "gkd":
        return {}
    from _train_helpers import TINY, tiny_model

    from posttrain.models import ByteTokenizer
    from posttrain.policy import Policy

    return {
        "teacher": Policy(tiny_model(1), ByteTokenizer(), TINY),
        "student": Policy(tiny_model(0), ByteTokenizer(), TINY),
    }


def _registered_objectives() -> list[str]:
    import posttrain.preference  # noqa: F401  (registers the preference objectives)
    from posttrain.train import registered_losses

    return sorted(set(registered_losses()) - _NOT_TOKEN_LEVEL)


@pytest.mark.parametrize("name", _registered_objectives())
def test_every_registered_objective_ignores_padding_logits(name):
    """The model's logits on padding positions (input token = PAD) are NaN / inf / 1e30: the
    step share, the logits gradient and every parameter gradient equal those with zero logits
    there."""
    from _train_helpers import tiny_model

    from posttrain.models import ByteTokenizer
    from posttrain.train import get_loss

    loss_fn, batch = get_loss(name, **_objective_options(name)), _objective_batch(name)
    model = tiny_model(0)
    fill: dict = {"value": 0.0, "padded": 0}

    def poison(module, args, out):
        real = args[0][..., None] != ByteTokenizer.PAD
        fill["padded"] += int((~real).sum())
        out = torch.where(real, out, torch.full_like(out, fill["value"]))
        if out.requires_grad:  # KTO's KL estimate runs without a graph
            out.retain_grad()
            fill["logits"].append(out)
        return out

    handle = model.register_forward_hook(poison)

    def run(value):
        fill.update(value=value, logits=[])
        model.zero_grad(set_to_none=True)
        share = loss_fn(model, batch, loss_fn.num_units(batch))
        share.backward()
        return {
            "share": share.detach(),
            "grad_logits": [t.grad for t in fill["logits"]],
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        }

    try:
        want = run(0.0)
        assert fill["padded"] > 0  # the batch has padding to poison
        for value in POISONS:
            got = run(value)
            _close(got["share"], want["share"], f"{name} {value} share")
            _close(got["grads"], want["grads"], f"{name} {value} grads")
            for i, (g, w) in enumerate(zip(got["grad_logits"], want["grad_logits"], strict=True)):
                _close(g, w, f"{name} {value} logits grad {i}")
    finally:
        handle.remove()


def test_the_value_head_ignores_hidden_states_of_unscored_positions(tiny_model):
    """PPO's value head reads the final norm's output at t - 1 for each response token t; NaN /
    inf / 1e30 in that hidden state at prompt and padding positions (a forward hook on the norm)
    change neither the values nor any gradient of the value head or the model."""
    from types import SimpleNamespace

    from posttrain.rl.trainer import RLTrainer, ValueHead

    model = tiny_model
    head = ValueHead(model.norm.scale.shape[0])
    with torch.no_grad():  # it starts at zero; random weights make every value count
        head.proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    m = {
        "input_ids_BT": torch.tensor([[1, 40, 41, 42, 43, 0], [1, 50, 51, 52, 0, 0]]),
        "attention_mask_BT": torch.tensor(
            [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.bool
        ),
        "response_mask_BT": torch.tensor(
            [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.float32
        ),
    }
    used_BT1 = F.pad(m["response_mask_BT"][:, 1:] != 0, (0, 1))[..., None]
    fill = {"value": 0.0}
    handle = model.norm.register_forward_hook(
        lambda mod, args, out: torch.where(used_BT1, out, torch.full_like(out, fill["value"]))
    )
    stub = SimpleNamespace(
        temperature=1.0,
        top_p=1.0,
        algo=SimpleNamespace(entropy_coef=0.0),
        share_prefix=False,
        loss_chunk_tokens=None,
    )  # the hook fills row positions

    def run(value):
        fill["value"] = value
        model.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        _, values_BT, _ = RLTrainer._forward(stub, model, m, value_head=head)
        (values_BT**2).sum().backward()
        grads = {
            n: p.grad.clone()
            for n, p in [*model.named_parameters(), *head.named_parameters()]
            if p.grad is not None
        }
        return {"values": values_BT.detach(), "grads": grads}

    try:
        want = run(0.0)
        assert want["grads"] and float(want["values"].abs().sum()) > 0
        for value in POISONS:
            _close(run(value), want, f"value head {value}")
    finally:
        handle.remove()
