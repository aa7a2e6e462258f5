"""Mixture-of-Experts: the layer against a per-token loop, the load-balancing loss by hand, the
MoE `ModelSpec` (validation, parameter count, build) and SFT training. Qwen2-MoE HF checkpoints
against transformers: tests/models/test_moe_hf.py.

Shapes: B = batch, T = tokens, D = model dim, E = experts, K = top-k, N = tokens flattened, V =
vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from posttrain.models import (
    PRESETS,
    ByteTokenizer,
    ModelSpec,
    MoEFeedForward,
    build_model,
    get_preset,
    moe_aux_loss,
)
from posttrain.models.moe import load_balancing_loss

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MOE = PRESETS["tiny-moe"]
ATOL = 1e-4  # as tests/models/test_models_hf.py


def _moe(seed: int = 0, **overrides) -> MoEFeedForward:
    kwargs = dict(
        dim=8, hidden_dim=6, num_experts=4, experts_per_token=2, shared_expert_dim=5, init_std=0.25
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return MoEFeedForward(**kwargs)


def _reference_moe(moe: MoEFeedForward, x_BTD: torch.Tensor) -> torch.Tensor:
    """The layer written as a loop over tokens: softmax, top-k picked by sorting a Python list,
    weighted sum of the chosen experts' SwiGLU MLPs, plus the gated shared expert."""
    out = torch.zeros_like(x_BTD)
    B, T, _ = x_BTD.shape
    for b in range(B):
        for t in range(T):
            x = x_BTD[b, t]
            probs = torch.softmax(moe.router.weight @ x, dim=0).tolist()
            chosen = sorted(range(len(probs)), key=lambda e: -probs[e])[: moe.experts_per_token]
            weights = [probs[e] for e in chosen]
            if moe.norm_topk_prob:
                weights = [w / sum(weights) for w in weights]
            y = torch.zeros_like(x)
            for e, w in zip(chosen, weights):
                hidden = F.silu(moe.gate_proj[e] @ x) * (moe.up_proj[e] @ x)
                y = y + w * (moe.down_proj[e] @ hidden)
            if moe.shared_expert is not None:
                s = moe.shared_expert
                shared = s.down_proj.weight @ (
                    F.silu(s.gate_proj.weight @ x) * (s.up_proj.weight @ x)
                )
                y = y + torch.sigmoid(moe.shared_expert_gate.weight[0] @ x) * shared
            out[b, t] = y
    return out


# ---------------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("shared_expert_dim", [0, 5])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_forward_equals_per_token_loop(norm_topk_prob, shared_expert_dim, k):
    moe = _moe(
        norm_topk_prob=norm_topk_prob, shared_expert_dim=shared_expert_dim, experts_per_token=k
    )
    x_BTD = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y_BTD = moe(x_BTD)
        ref_BTD = _reference_moe(moe, x_BTD)
    assert y_BTD.shape == x_BTD.shape and y_BTD.dtype == torch.float32
    assert (y_BTD - ref_BTD).abs().max().item() <= 1e-6


def test_experts_run_in_subsets_as_an_expert_parallel_dispatcher_would():
    """Rows grouped by expert, run as experts {0, 1} and {2, 3} separately, give the rows of one
    call over all four."""
    moe = _moe()
    gen = torch.Generator().manual_seed(2)
    counts_E = torch.tensor([3, 0, 2, 4])
    rows_AD = torch.randn(int(counts_E.sum()), 8, generator=gen)
    with torch.no_grad():
        full = moe._run_experts(rows_AD, counts_E, range(4))
        first = moe._run_experts(rows_AD[:3], counts_E[:2], range(0, 2))
        second = moe._run_experts(rows_AD[3:], counts_E[2:], range(2, 4))
    assert torch.equal(torch.cat([first, second]), full)
    with pytest.raises(ValueError, match="counts_per_expert"):
        moe._run_experts(rows_AD, counts_E[:3], range(4))


def test_load_balancing_loss_by_hand():
    """Top-1, E = 2, N = 4: probs [[.7,.3],[.6,.4],[.2,.8],[.9,.1]] pick experts 0, 0, 1, 0, so
    f = [3/4, 1/4] and P = [2.4/4, 1.6/4] = [.6, .4]: loss = 2 * (.75*.6 + .25*.4) = 1.1.

    Top-2, E = 3, N = 2: [[.5,.3,.2],[.1,.6,.3]] pick {0,1} and {1,2}: f = [1,2,1]/2, P =
    [.3,.45,.25]: loss = 3 * (.5*.3 + 1*.45 + .5*.25) = 3 * .725 = 2.175.
    """
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]])
    selected = probs.topk(1, dim=-1).indices
    assert selected.flatten().tolist() == [0, 0, 1, 0]
    assert load_balancing_loss(probs, selected, 2).item() == pytest.approx(1.1, rel=1e-6, abs=1e-6)

    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    selected = probs.topk(2, dim=-1).indices
    assert load_balancing_loss(probs, selected, 3).item() == pytest.approx(
        2.175, rel=1e-6, abs=1e-6
    )
    with pytest.raises(ValueError, match="router_probs"):
        load_balancing_loss(probs, selected, 4)


def test_load_balancing_loss_agrees_with_transformers_for_one_layer():
    pytest.importorskip("transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    logits_NE = torch.randn(50, 6, generator=torch.Generator().manual_seed(3))
    probs_NE = torch.softmax(logits_NE, dim=-1)
    for k in (1, 2, 3):
        ours = load_balancing_loss(probs_NE, probs_NE.topk(k, dim=-1).indices, 6)
        theirs = load_balancing_loss_func((logits_NE,), num_experts=6, top_k=k)
        assert ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("k", [1, 2])
def test_uniform_routing_gives_the_minimum(k):
    """Balanced choices with uniform probabilities: f_i = K/E, P_i = 1/E, loss = E * E * K/E^2 =
    K (1.0 for top-1, the Switch Transformer form). Uniform P alone already gives K: sum_i f_i = K.
    """
    E, N = 4, 8
    probs = torch.full((N, E), 1 / E)
    selected = torch.stack([(torch.arange(N) + j) % E for j in range(k)], dim=1)
    assert load_balancing_loss(probs, selected, E).item() == pytest.approx(k, rel=1e-6, abs=1e-6)
    moe = _moe(experts_per_token=k)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe(torch.randn(2, 3, 8))
    assert moe.aux_loss.item() == pytest.approx(k, rel=1e-6, abs=1e-6)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(N, 1)
    assert load_balancing_loss(skewed, skewed.topk(k, dim=-1).indices, E).item() > k


def test_gradients_reach_router_and_experts():
    moe = _moe()
    x_BTD = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4))
    y = moe(x_BTD)
    (y.square().mean() + moe.aux_loss).backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), grads.keys()
    assert grads["router.weight"].abs().sum() > 0
    hit = torch.bincount(moe.route(x_BTD.reshape(-1, 8))[2].flatten(), minlength=4) > 0
    for name in ("gate_proj", "up_proj", "down_proj"):
        per_expert = grads[name].abs().sum(dim=(1, 2))
        assert torch.equal(per_expert > 0, hit), name
    moe.zero_grad()
    moe(x_BTD)
    moe.aux_loss.backward()  # the aux loss alone trains the router only
    assert moe.router.weight.grad.abs().sum() > 0
    assert moe.gate_proj.grad is None or moe.gate_proj.grad.abs().sum() == 0


def test_moe_aux_loss_sums_layers_and_is_none_for_dense():
    model = build_model(MOE, seed=0)
    with pytest.raises(RuntimeError, match="after a forward"):
        moe_aux_loss(model)
    model(torch.randint(0, MOE.vocab_size, (2, 7)))
    layers = [layer.mlp for layer in model.layers]
    total = moe_aux_loss(model)
    assert total.shape == () and total.dtype == torch.float32
    assert torch.allclose(total, layers[0].aux_loss + layers[1].aux_loss)
    assert torch.allclose(moe_aux_loss(model, scaled=True), MOE.router_aux_loss_coef * total)
    assert moe_aux_loss(build_model(PRESETS["tiny-1m"], seed=0)) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(experts_per_token=0), "experts_per_token"),
        (dict(experts_per_token=5), "experts_per_token"),
        (dict(num_experts=0), "num_experts"),
        (dict(hidden_dim=0), "hidden_dim"),
        (dict(shared_expert_dim=-1), "shared_expert_dim"),
        (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef"),
    ],
)
def test_layer_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _moe(**kwargs)


# ---------------------------------------------------------------------------------- ModelSpec


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_experts", -1),
        ("num_experts", 2.0),
        ("experts_per_token", 0),
        ("experts_per_token", 5),  # more than the 4 experts
        ("experts_per_token", True),
        ("moe_intermediate_dim", 0),  # required for MoE
        ("shared_expert_dim", -1),
        ("norm_topk_prob", "yes"),
        ("router_aux_loss_coef", -0.1),
        ("router_aux_loss_coef", math.inf),
    ],
)
def test_moe_spec_rejects_bad_field_and_names_it(field, value):
    with pytest.raises(ValueError, match=field):
        MOE.replace(**{field: value})


def test_moe_spec_only_for_qwen2_and_moe_fields_only_for_moe():
    llama = PRESETS["tiny-llama-1m"]
    with pytest.raises(ValueError, match="num_experts=4 .*family 'qwen2'"):
        llama.replace(num_experts=4, moe_intermediate_dim=64)
    with pytest.raises(ValueError, match="moe_intermediate_dim=64 is set but num_experts=0"):
        PRESETS["tiny-1m"].replace(moe_intermediate_dim=64)
    with pytest.raises(ValueError, match="num_experts=0"):
        MOE.replace(num_experts=0)


def _moe_count_by_formula(spec: ModelSpec) -> int:
    """Qwen2 decoder with MoE MLPs: attention and norms as in tests/models/test_models.py; per
    layer a router (E x D), E experts of 3 x D x H, and a shared expert 3 x D x S with its gate
    (D).

    tiny-moe: attention 64*64+64 + 2*(64*32+32) + 64*64 = 12,416; norms 128; router 256;
    experts 4*3*64*64 = 49,152; shared 3*64*64 + 64 = 12,352 -> 74,304 per layer; x2 = 148,608;
    embedding 272*64 = 17,408 (tied); final norm 64: 166,080.
    """
    D, H, KV, V, L = (
        spec.embed_dim,
        spec.num_heads,
        spec.num_kv_heads,
        spec.vocab_size,
        spec.num_layers,
    )
    hd = D // H
    attention = (D * H * hd + H * hd) + 2 * (D * KV * hd + KV * hd) + H * hd * D
    moe = spec.num_experts * D + spec.num_experts * 3 * D * spec.moe_intermediate_dim
    if spec.shared_expert_dim:
        moe += 3 * D * spec.shared_expert_dim + D
    output = 0 if spec.tie_word_embeddings else V * D
    return V * D + L * (attention + 2 * D + moe) + D + output


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"tie_word_embeddings": False},
        {"shared_expert_dim": 0},
        {"num_experts": 8, "experts_per_token": 1},
    ],
)
def test_num_parameters_counts_every_expert(changes):
    spec = MOE.replace(**changes)
    built = sum(p.numel() for p in build_model(spec, seed=0).parameters())
    assert spec.num_parameters() == built == _moe_count_by_formula(spec)
    if not changes:
        assert built == 166_080


def test_build_is_deterministic_and_every_mlp_is_moe():
    a, b = build_model(MOE, seed=3).state_dict(), build_model(MOE, seed=3).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model = build_model(MOE, seed=3)
    assert all(isinstance(layer.mlp, MoEFeedForward) for layer in model.layers)
    mlp = model.layers[0].mlp
    assert mlp.gate_proj.shape == (4, 64, 64) and mlp.down_proj.shape == (4, 64, 64)
    assert mlp.router_aux_loss_coef == MOE.router_aux_loss_coef
    std = torch.cat([layer.mlp.gate_proj.flatten() for layer in model.layers]).std().item()
    assert std == pytest.approx(0.02, rel=0.05)  # the HF initialisation, not torch's default
    assert get_preset("tiny-moe") is MOE
    assert ModelSpec.from_dict(MOE.to_dict()) == MOE


def test_kv_cache_decoding_matches_full_forward():
    model = build_model(MOE, seed=0).eval()
    tokens_BT = torch.randint(0, MOE.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full_BTV = model(tokens_BT)
        model.setup_caches(batch_size=2, dtype=torch.float32, decoder_max_seq_len=16)
        causal_TS = torch.tril(torch.ones(16, 16, dtype=torch.bool))
        steps = [
            model(
                tokens_BT[:, t : t + 1],
                input_pos=torch.full((2, 1), t),
                mask=causal_TS[t : t + 1].expand(2, 1, 16),
            )
            for t in range(6)
        ]
        model.reset_caches()
    assert (torch.cat(steps, dim=1) - full_BTV).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------- training


def test_sft_loss_adds_the_token_weighted_aux_loss():
    """Two micro-batches with 2 and 6 trained tokens: shares add up to CE token mean + coef *
    (2 * aux_a + 6 * aux_b) / 8."""
    from posttrain.data import Batch
    from posttrain.train import SFTCrossEntropy
    from posttrain.train.losses import token_cross_entropy_sum

    spec = MOE.replace(router_aux_loss_coef=0.5)
    model = build_model(spec, seed=0)
    gen = torch.Generator().manual_seed(6)
    batches = []
    for trained in (2, 6):
        ids = torch.randint(0, spec.vocab_size, (1, 8), generator=gen)
        labels = torch.full((1, 8), -100)
        labels[0, :trained] = ids[0, 1 : trained + 1]
        batches.append(
            Batch(
                input_ids=ids,
                labels=labels,
                position_ids=torch.arange(8)[None],
                attention_mask=None,
                num_samples=1,
            )
        )
    loss = SFTCrossEntropy()
    units = sum(loss.num_units(b) for b in batches)
    shares, ce, aux = [], 0.0, 0.0
    for b in batches:
        shares.append(loss(model, b, units))
        with torch.no_grad():
            ce += token_cross_entropy_sum(model(b.input_ids), b.labels)[0]
        aux += moe_aux_loss(model) * loss.num_units(b)
    expected = (ce + 0.5 * aux) / units
    assert torch.allclose(sum(shares), expected, atol=1e-6)
    assert 0.5 * aux / units > 1e-2  # the aux term is visible, not a rounding error

    dense = build_model(PRESETS["tiny-1m"], seed=0)
    share = loss(dense, batches[0], units)
    with torch.no_grad():
        plain = token_cross_entropy_sum(dense(batches[0].input_ids), batches[0].labels)[0] / units
    assert torch.equal(share.detach(), plain)


def test_tiny_moe_trains_with_sft_trainer():
    from posttrain.data import SFTDataset, SFTLoader
    from posttrain.train import Trainer, warmup_cosine_schedule

    rows = [{"prompt": f"{i}+1?", "completion": str(i + 1)} for i in range(8)]
    loader = SFTLoader(SFTDataset(rows, ByteTokenizer(), max_seq_len=32), batch_size=4, seed=0)
    model = build_model(MOE, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = Trainer(
        model,
        opt,
        data=loader,
        progress=False,
        grad_accum_steps=2,
        lr_scheduler=warmup_cosine_schedule(opt, warmup_steps=1, total_steps=8),
    )
    losses = trainer.fit(8)["loss"].tolist()
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    assert model.layers[0].mlp.router.weight.grad is None  # zeroed after the step
    assert moe_aux_loss(model).item() >= MOE.experts_per_token * MOE.num_layers - 1e-4
