"""posttrain.policy.chunked_ce: the chunked head + log-softmax against today's unchunked
functions (the reference: `token_cross_entropy_sum`, `picked_logprobs` on the full logits),
values and gradients (w.r.t. hidden states, head weight and a tiny model's parameters) in fp32,
on shapes where the chunk does not divide the scored tokens, rows with nothing scored, and
temperature / top-k / top-p; untied, tied (TinyLinear) and LoRA heads; and what the loss holds.
"""

from __future__ import annotations

import pytest
import torch
from _train_helpers import TINY, assert_grads_close, tiny_model
from torch import nn
from torchtune.modules.peft import LoRALinear

from posttrain.policy.chunked_ce import (
    check_chunk_tokens,
    chunked_cross_entropy_sum,
    chunked_token_logprobs,
    final_hidden,
    model_hidden,
)
from posttrain.policy.sampling import picked_logprobs
from posttrain.train.losses import token_cross_entropy_sum

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = {"atol": 1e-6, "rtol": 1e-6}


def _labels(B: int, T: int, V: int, seed: int, ignored_rows=()) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, T), generator=gen)
    labels[torch.rand(B, T, generator=gen) < 0.3] = -100
    for r in ignored_rows:
        labels[r] = -100
    return labels


def _grads(loss: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors, retain_graph=True))


@pytest.mark.parametrize(
    ("B", "T", "chunk", "ignored_rows"),
    [(2, 7, 3, ()), (3, 5, 4, (1,)), (1, 9, 100, ()), (2, 4, 1, (0,)), (2, 3, 2, (0, 1))],
)
def test_cross_entropy_equals_the_unchunked_loss_and_gradients(B, T, chunk, ignored_rows):
    """Chunk not dividing the trained tokens, a chunk larger than all of them, chunk 1, an
    all-ignored row and an all-ignored batch (0.0 with zero gradients, as the reference)."""
    torch.manual_seed(0)
    D, V = 8, 37
    hidden = torch.randn(B, T, D, requires_grad=True)
    head = nn.Linear(D, V, bias=False)
    labels = _labels(B, T, V, seed=B * T, ignored_rows=ignored_rows)
    ref_sum, ref_n = token_cross_entropy_sum(head(hidden).float(), labels)
    got_sum, got_n = chunked_cross_entropy_sum(hidden, head, labels, chunk_tokens=chunk)
    assert int(got_n) == int(ref_n) == int((labels != -100).sum())
    torch.testing.assert_close(got_sum, ref_sum, **TOL)
    assert_grads_close(_grads(ref_sum, hidden, head.weight), _grads(got_sum, hidden, head.weight))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "chunk"),
    [(1.0, None, 1.0, 3), (0.7, None, 1.0, 5), (1.3, 6, 1.0, 2), (0.9, None, 0.9, 4)],
)
def test_token_logprobs_and_entropy_equal_the_unchunked_ones(temperature, top_k, top_p, chunk):
    torch.manual_seed(1)
    B, T, D, V = 3, 6, 8, 29
    hidden = torch.randn(B, T, D, requires_grad=True)
    head = nn.Linear(D, V, bias=True)
    ids = torch.randint(0, V, (B, T))
    response = torch.zeros(B, T, dtype=torch.bool)
    response[0, 2:] = True
    response[2, 1:4] = True  # row 1 scores nothing
    settings = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if top_k or top_p < 1:  # score the tokens the sampler could draw (else -inf, NaN gradient)
        with torch.no_grad():
            _, logp = picked_logprobs(head(hidden), ids, response, **settings)
        ids[:, 1:] = logp.argmax(-1)
    ref_lp, ref_logp = picked_logprobs(head(hidden), ids, response, **settings)
    ref_ent = -(ref_logp.exp() * ref_logp.nan_to_num(neginf=0.0)).sum(-1)
    ref_ent = torch.nn.functional.pad(ref_ent, (1, 0)) * response
    got_lp, got_ent = chunked_token_logprobs(
        hidden, head, ids, response, chunk_tokens=chunk, entropy=True, **settings
    )
    assert got_lp.shape == got_ent.shape == (B, T) and got_lp.dtype == torch.float32
    assert (got_lp[~response] == 0).all() and (got_ent[~response] == 0).all()
    torch.testing.assert_close(got_lp, ref_lp, **TOL)
    torch.testing.assert_close(got_ent, ref_ent, **TOL)
    params = (hidden, head.weight, head.bias)
    for got, ref in ((got_lp, ref_lp), (got_ent, ref_ent)):
        w = torch.randn(B, T)  # any linear functional of the outputs
        assert_grads_close(_grads((ref * w).sum(), *params), _grads((got * w).sum(), *params))


def _lora_head(model: nn.Module) -> None:
    """Replace the (tied) head by an untied LoRA linear with a nonzero B, as a LoRA-converted
    output projection."""
    base = model.tok_embeddings.weight.detach().clone()
    lora = LoRALinear(base.shape[1], base.shape[0], rank=4, alpha=8.0)
    with torch.no_grad():
        lora.weight.copy_(base)
        lora.lora_b.weight.normal_(0, 0.05)
    model.output = lora


@pytest.mark.parametrize("head", ["tied", "untied", "lora"])
def test_model_parameters_get_the_unchunked_gradients(head):
    """Through a tiny model: SFT cross-entropy and token log-probs, gradients of every trained
    parameter within 1e-6 of the unchunked path (tied: the embedding gets both its own and the
    head's gradient)."""
    model = tiny_model(seed=3)
    if head == "untied":
        model.output = nn.Linear(TINY.embed_dim, TINY.vocab_size, bias=False)
    elif head == "lora":
        _lora_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, TINY.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    labels = _labels(2, 11, TINY.vocab_size, seed=5, ignored_rows=(1,))
    pos = torch.arange(11).expand(2, 11)

    ref_sum, _ = token_cross_entropy_sum(model(ids, input_pos=pos), labels)
    hidden, out = model_hidden(model, ids, input_pos=pos)
    assert out is model.output or head == "tied"
    got_sum, _ = chunked_cross_entropy_sum(hidden, out, labels, chunk_tokens=4)
    torch.testing.assert_close(got_sum, ref_sum, **TOL)
    assert_grads_close(_grads(ref_sum, *params), _grads(got_sum, *params))

    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, 8:] = False  # right padding
    response = valid.clone()
    response[:, :3] = False
    ref_lp, _ = picked_logprobs(model(ids), ids, response, temperature=0.8)
    hidden, out, _ = final_hidden(model, ids, valid, response)
    got_lp, _ = chunked_token_logprobs(hidden, out, ids, response, chunk_tokens=3, temperature=0.8)
    torch.testing.assert_close(got_lp, ref_lp, **TOL)
    assert_grads_close(_grads(ref_lp.sum(), *params), _grads(got_lp.sum(), *params))
    # the head is back in place: the model's own forward still returns logits
    assert model(ids).shape == (2, 11, TINY.vocab_size)


def test_nan_off_the_scored_positions_reaches_neither_loss_nor_gradient():
    torch.manual_seed(2)
    hidden = torch.randn(1, 4, 8)
    hidden[0, 1] = float("nan")
    hidden.requires_grad_(True)
    head = nn.Linear(8, 11)
    labels = torch.tensor([[3, -100, 5, 1]])
    loss, _ = chunked_cross_entropy_sum(hidden, head, labels, chunk_tokens=2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(hidden.grad).all()
    assert torch.isfinite(head.weight.grad).all()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "64"])
def test_bad_chunk_size_names_the_field_and_the_allowed_values(bad):
    with pytest.raises(ValueError, match=r"loss_chunk_tokens=.*None .* integer >= 1"):
        check_chunk_tokens(bad)
    assert check_chunk_tokens(None) is None and check_chunk_tokens(7) == 7


def test_a_model_without_a_head_is_refused_with_what_is_needed():
    with pytest.raises(TypeError, match="torchtune TransformerDecoder"):
        model_hidden(nn.Linear(3, 3), torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.parametrize("pack", [False, True])
def test_sft_objective_with_chunks_equals_the_unchunked_objective(pack):
    """`SFTCrossEntropy(loss_chunk_tokens=5)` on loader batches (padded rows, and packed rows
    with their block mask and position ids) gives the unchunked share and gradients."""
    from _train_helpers import sft_loader

    from posttrain.train.losses import SFTCrossEntropy

    batch = sft_loader(6, batch_size=3, shuffle=False, pack=pack, seq_len=48 if pack else None)
    batch = batch.next_batch()
    model = tiny_model(seed=1)
    params = list(model.parameters())
    plain, chunked = SFTCrossEntropy(), SFTCrossEntropy(loss_chunk_tokens=5)
    assert repr(chunked) == "SFTCrossEntropy(ignore_index=-100, loss_chunk_tokens=5)"
    n = plain.num_units(batch)
    ref, got = plain(model, batch, n), chunked(model, batch, n)
    torch.testing.assert_close(got, ref, **TOL)
    assert_grads_close(_grads(ref, *params), _grads(got, *params))


@pytest.mark.parametrize("chunk", [None, 64, 4, 100])
def test_the_memory_plan_counts_what_the_loss_holds(chunk):
    """plan_memory's "logits" term against the measured peak of the loss and its backward
    (`TensorPeak`) from TINY's final hidden states, every token of 2 x 48 trained (N = 96,
    V = 272, D = 64, fp32). By hand: unchunked 12 N V = 313,344 (above 4 N V + 4 V D + 8 D N);
    chunk 64: 12 x 64 x V + the running head gradient 4 V D, + 8 D N = 327,680; chunk 4: three
    head gradients 12 V D + 8 D N = 258,048; one chunk of 100: unchunked + 4 D N."""
    from posttrain.train.memory_measure import TensorPeak
    from posttrain.train.memory_plan import plan_memory

    B, T, V, D = 2, 48, TINY.vocab_size, TINY.embed_dim
    model = tiny_model(seed=0)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden, head = model_hidden(model, ids)
    hidden.requires_grad_(True)
    labels = torch.roll(ids, -1, dims=1)
    with TensorPeak() as peak:
        if chunk is None:
            loss, _ = token_cross_entropy_sum(head(hidden).float(), labels)
        else:
            loss, _ = chunked_cross_entropy_sum(hidden, head, labels, chunk_tokens=chunk)
        loss.backward()
    batch = {"micro_batch_size": B, "seq_len": T}
    df = plan_memory(TINY, None, batch, device_type="cpu", loss_chunk_tokens=chunk)
    planned = int(df.set_index("term").loc["logits", "bytes"])
    by_hand = {None: 313_344, 64: 327_680, 4: 258_048, 100: 313_344 + 4 * D * B * T}
    assert planned == by_hand[chunk]
    assert abs(peak.peak_bytes - planned) <= 0.02 * planned, (peak.peak_bytes, planned)


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_preference_objectives_with_chunks_equal_the_unchunked_ones(name):
    """Each preference objective with `loss_chunk_tokens=4` (response tokens of chosen and
    rejected rows chunked together) gives the unchunked loss share and parameter gradients."""
    from _preference_helpers import pair_dataset, pair_rows

    from posttrain.data import KTODataset, PreferenceLoader, pairs_to_kto_rows
    from posttrain.models import ByteTokenizer
    from posttrain.preference import compute_reference_logps
    from posttrain.train.losses import get_loss

    if name == "kto":
        dataset = KTODataset(pairs_to_kto_rows(pair_rows(2)), ByteTokenizer(), max_seq_len=64)
        compute_reference_logps(tiny_model(1), dataset)
    else:
        dataset = pair_dataset(3)
    batch = PreferenceLoader(dataset, batch_size=4, shuffle=False).next_batch()
    model = tiny_model(0)
    params = list(model.parameters())
    plain, chunked = get_loss(name), get_loss(name, loss_chunk_tokens=4)
    assert chunked.loss_chunk_tokens == 4 and plain.loss_chunk_tokens is None
    assert "loss_chunk_tokens" not in repr(plain) and "loss_chunk_tokens=4" in repr(chunked)
    n = plain.num_units(batch)
    ref, got = plain(model, batch, n), chunked(model, batch, n)
    torch.testing.assert_close(got, ref, **TOL)
    assert_grads_close(_grads(ref, *params), _grads(got, *params))


@pytest.mark.parametrize("share_prefix", [False, True])
def test_rl_scoring_with_chunks_equals_the_unchunked_scoring(share_prefix):
    """`score_rows` of a GRPO-like group (two prompts, two responses each, right padded) at
    temperature 0.7 and top-p 0.95: log-probs, PPO values and the differentiable entropy, and
    the gradients of a loss over all three."""
    from posttrain.rl.scoring import ValueHead, score_rows

    model = tiny_model(seed=2)
    head = ValueHead(TINY.embed_dim)
    with torch.no_grad():
        head.proj.weight.normal_(0, 0.1)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, TINY.vocab_size, (4, 12), generator=gen)
    ids[1, :5], ids[3, :5] = ids[0, :5], ids[2, :5]  # shared prompts of 5 tokens
    valid = torch.ones(4, 12, dtype=torch.long)
    valid[0, 10:] = valid[3, 8:] = 0
    response = valid.clone()
    response[:, :5] = 0
    with torch.no_grad():  # score tokens inside the top-p set
        logits = model(ids)[:, :-1] / 0.7
        ids[:, 1:] = torch.where(response[:, 1:].bool(), logits.argmax(-1), ids[:, 1:])
    m = {"input_ids_BT": ids, "attention_mask_BT": valid, "response_mask_BT": response}
    params = [*model.parameters(), *head.parameters()]
    settings = {"value_head": head, "temperature": 0.7, "top_p": 0.95, "share_prefix": share_prefix}
    ref = score_rows(model, m, entropy=True, entropy_grad=True, **settings)
    got = score_rows(model, m, entropy=True, entropy_grad=True, chunk_tokens=5, **settings)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, **TOL)
    w = torch.randn(3, 4, 12, generator=gen)
    ref_loss, got_loss = (sum((t * w[i]).sum() for i, t in enumerate(x)) for x in (ref, got))
    assert_grads_close(_grads(ref_loss, *params), _grads(got_loss, *params))


@pytest.mark.parametrize(("beta", "temperature"), [(0.0, 1.0), (0.5, 0.8), (1.0, 1.5)])
def test_distillation_with_chunks_equals_the_unchunked_divergence(beta, temperature):
    """`GKDLoss(loss_chunk_tokens=6)`: the JSD share and the student's gradients of the
    unchunked loss, against a peaky untied teacher."""
    from _train_helpers import sft_loader

    from posttrain.models import ByteTokenizer, build_model
    from posttrain.policy import Policy
    from posttrain.train.distill_loss import GKDLoss

    student = Policy(tiny_model(0), ByteTokenizer(), TINY)
    untied = TINY.replace(tie_word_embeddings=False)
    teacher = Policy(build_model(untied, seed=1), ByteTokenizer(), untied)
    batch = sft_loader(4, batch_size=4, shuffle=False).next_batch()
    settings = {"teacher": teacher, "student": student, "beta": beta, "temperature": temperature}
    plain, chunked = GKDLoss(**settings), GKDLoss(**settings, loss_chunk_tokens=6)
    n = plain.num_units(batch)
    params = list(student.model.parameters())
    ref, got = plain(student.model, batch, n), chunked(student.model, batch, n)
    torch.testing.assert_close(got, ref, **TOL)
    assert_grads_close(_grads(ref, *params), _grads(got, *params))


def test_a_float8_model_chunks_its_high_precision_head_and_refuses_a_float8_one():
    """FP8 training (`apply_float8`, tensorwise) of an untied TINY: with the head left in high
    precision (the default) the chunked cross-entropy equals the unchunked one to fp32 rounding
    (the float8 blocks see the same whole batch on both paths). A float8 head would scale each
    chunk by its own amax (measured: loss 1.4e-4 relative, gradients 8% of their scale apart):
    refused by name at the forward, before any gradient."""
    import dataclasses

    from posttrain.models import build_model
    from posttrain.train.float8 import Float8Config, apply_float8

    untied = dataclasses.replace(TINY, tie_word_embeddings=False)
    tokens = torch.randint(0, TINY.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    labels = _labels(3, 12, TINY.vocab_size, seed=1)
    model = build_model(untied, seed=0)
    apply_float8(model, Float8Config(recipe="tensorwise"))
    assert type(model.output) is nn.Linear
    params = list(model.parameters())
    ref_sum, _ = token_cross_entropy_sum(model(tokens).float(), labels)
    hidden, head = model_hidden(model, tokens)
    got_sum, _ = chunked_cross_entropy_sum(hidden, head, labels, chunk_tokens=5)
    torch.testing.assert_close(got_sum, ref_sum, **TOL)
    assert_grads_close(_grads(ref_sum, *params), _grads(got_sum, *params))

    fp8_head = build_model(untied, seed=0)
    apply_float8(fp8_head, Float8Config(recipe="rowwise", skip_modules=()))
    with pytest.raises(ValueError, match=r"loss_chunk_tokens with a float8 output projection"):
        model_hidden(fp8_head, tokens)


def test_reference_logps_precomputed_with_chunks_equal_the_full_logits():
    """`compute_reference_logps(..., chunk_tokens=3)` (the DPO recipe's precompute with
    optim.loss_chunk_tokens) gives the summed response log-probs of the full-logits pass, to fp32
    rounding; a bad chunk_tokens is refused by name."""
    from _preference_helpers import pair_dataset

    from posttrain.preference import compute_reference_logps

    model = tiny_model(1)
    full = compute_reference_logps(model, pair_dataset(3)).values
    chunked = compute_reference_logps(model, pair_dataset(3), chunk_tokens=3).values
    assert full.keys() == chunked.keys() and all(len(v) == 3 for v in full.values())
    for key, values in full.items():
        torch.testing.assert_close(chunked[key], values, **TOL)
    with pytest.raises(ValueError, match=r"^chunk_tokens=0; must be None"):
        compute_reference_logps(model, pair_dataset(3), chunk_tokens=0)
