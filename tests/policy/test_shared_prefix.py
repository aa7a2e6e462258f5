"""Shared-prefix packing (`posttrain.policy.shared_prefix`): a group's rows scored in one packed
sequence give the log-probabilities and gradients of the unpacked rows (the slower path is the
reference), a response never sees another response of its group, and packing is skipped where it
does not pay. The RL trainer's step is the same with and without it (GRPO and PPO's value head).
"""

import copy
import doctest

import pytest
import torch
from _flex_helpers import route_block_masks
from _rl_helpers import ToyTask
from torch.nn.attention.flex_attention import BlockMask

import posttrain.policy.shared_prefix as shared_prefix_module
from posttrain.policy import Policy, token_logprobs
from posttrain.policy.shared_prefix import SharedPrefixPack
from posttrain.rl import RLAlgorithm, RLTrainer, ValueHead


def _rows(prompts: list[list[int]], responses: list[list[list[int]]]):
    """Right-padded ids / valid / response masks of every (prompt, response) row."""
    rows = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
    T = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    valid, response = (torch.zeros(len(rows), T, dtype=torch.bool) for _ in range(2))
    for b, (p, r) in enumerate(rows):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        valid[b, : len(p) + len(r)] = True
        response[b, len(p) : len(p) + len(r)] = True
    return ids, valid, response


@pytest.fixture(scope="module")
def model():
    return Policy.from_spec("tiny-1m", seed=0).model


def _scored(model, ids, valid, response, share):
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(0.5, 1.5, ids.numel()).reshape(ids.shape)  # every row counts
    logprobs = token_logprobs(model, ids, valid, response, share_prefix=share)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_logprobs_and_gradients_equal_the_unpacked_rows(model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (12, 7, 9)]
    lengths = [[1, 5, 3, 4], [2, 2, 6], [3]]  # a prompt with one row is packed on its own
    responses = [[torch.randint(3, 250, (n,), generator=g).tolist() for n in ls] for ls in lengths]
    ids, valid, response = _rows(prompts, responses)
    assert SharedPrefixPack.build(ids, valid, response) is not None
    want_lp, want_grad = _scored(model, ids, valid, response, share=False)
    got_lp, got_grad = _scored(model, ids, valid, response, share=True)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    assert (got_lp[~response] == 0).all()
    for name in want_grad:
        torch.testing.assert_close(got_grad[name], want_grad[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_gradients_are_bitwise_equal_from_run_to_run_on_two_threads(model):
    """A shared prompt position's gradient sums G rows; that sum must not depend on thread
    timing (advanced indexing's backward adds with atomics across threads on CPU), or resume
    and replay would not be bitwise exact. B x T x V is far above the size where CPU kernels
    go parallel."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 250, (40,), generator=g).tolist() for _ in range(3)]
    responses = [
        [torch.randint(3, 250, (8,), generator=g).tolist() for _ in range(5)] for _ in prompts
    ]  # 15 rows: the threads' halves split a group
    ids, valid, response = _rows(prompts, responses)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [_scored(model, ids, valid, response, share=True)[1] for _ in range(8)]
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for name, grad in runs[0].items():
            assert torch.equal(other[name], grad), name


def test_a_response_never_sees_another_response_of_its_group(model):
    """Changing row 0's response tokens changes nothing in row 1's log-probabilities."""
    prompt = [9, 10, 11, 12]
    ids_a, valid, response = _rows([prompt], [[[40, 41, 42], [50, 51, 52, 53]]])
    ids_b, _, _ = _rows([prompt], [[[70, 71, 72], [50, 51, 52, 53]]])
    with torch.no_grad():
        a = token_logprobs(model, ids_a, valid, response, share_prefix=True)
        b = token_logprobs(model, ids_b, valid, response, share_prefix=True)
    assert SharedPrefixPack.build(ids_a, valid, response) is not None
    assert not torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=1e-6)


def test_packing_is_skipped_where_it_does_not_pay():
    # every prompt once: nothing to share
    ids, valid, response = _rows([[5, 6, 7], [5, 6, 8]], [[[1, 2]], [[3]]])
    assert SharedPrefixPack.build(ids, valid, response) is None
    # long responses after a short prompt: the packed attention area (sum S^2) is larger
    ids, valid, response = _rows([[5, 6]], [[[k] * 60 for k in range(3, 8)]])
    assert SharedPrefixPack.build(ids, valid, response, embed_dim=128) is None
    # after a prompt of 20: packed (dense 320 x 1088 > 0.9 x 5 x 80 x 808 flops) only with a
    # block mask, which costs the attended pairs, 320 x 768 + 210 + 5 x (1200 + 1830) (CUDA)
    ids, valid, response = _rows([[5] * 20], [[[k] * 60 for k in range(3, 8)]])
    assert SharedPrefixPack.build(ids, valid, response, embed_dim=128) is None
    assert SharedPrefixPack.build(ids, valid, response, embed_dim=128, block_mask=True)
    # the same rows after a long prompt: the prompt's projections dominate, packing pays
    ids, valid, response = _rows([[5] * 200], [[[k] * 60 for k in range(3, 8)]])
    assert SharedPrefixPack.build(ids, valid, response, embed_dim=128) is not None


def test_a_group_longer_than_the_models_limit_together_is_scored_unpacked(model):
    """Each row fits the model's 512 positions, the prompt and its 4 responses together (560)
    do not: packing is skipped (it failed in torchtune's position check), and the scores are the
    unpacked rows' own."""
    ids, valid, response = _rows([[5] * 200], [[[k] * 90 for k in range(3, 7)]])
    assert SharedPrefixPack.build(ids, valid, response, embed_dim=64) is not None
    assert SharedPrefixPack.build(ids, valid, response, embed_dim=64, max_seq_len=512) is None
    too_long = SharedPrefixPack.build(
        ids, valid, response, embed_dim=64, max_seq_len=512, block_mask=True
    )
    assert too_long is None  # a limit of positions, not of the mask's memory
    shared, _ = _scored(model, ids, valid, response, share=True)
    plain, _ = _scored(model, ids, valid, response, share=False)
    assert torch.equal(shared, plain)


@torch.no_grad()
def test_a_group_of_long_answers_is_packed_with_the_block_mask(model):
    """Where the dense mask's S^2 makes packing cost more than the rows, the block mask packs
    the group; its logits (eager FlexAttention, forward only on CPU) equal the rows' and the
    dense mask's to 1e-5."""
    flex_model = route_block_masks(copy.deepcopy(model)).eval()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 250, (6,), generator=g).tolist()
    answers = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (120, 70, 95, 30)]
    T = len(prompt) + max(len(a) for a in answers)
    ids = torch.zeros(len(answers), T, dtype=torch.long)
    valid, response = (torch.zeros(len(answers), T, dtype=torch.bool) for _ in range(2))
    for b, a in enumerate(answers):
        ids[b, : len(prompt) + len(a)] = torch.tensor(prompt + a)
        valid[b, : len(prompt) + len(a)] = True
        response[b, len(prompt) : len(prompt) + len(a)] = True
    # the dense mask's S^2 makes packing cost more than the rows: it falls back
    assert SharedPrefixPack.build(ids, valid, response, embed_dim=64, block_mask=False) is None
    pack = SharedPrefixPack.build(ids, valid, response, embed_dim=64, block_mask=True)
    assert pack is not None and isinstance(pack.mask, BlockMask)
    got = pack.unpack(pack.forward(flex_model))
    rows = flex_model(ids)  # right-padded rows: plain causal attention
    torch.testing.assert_close(got[valid], rows[valid], rtol=1e-5, atol=1e-5)
    dense = SharedPrefixPack(
        pack.input_ids_NS,
        pack.mask_NSS,
        pack.input_pos_NS,
        pack.sequence_B,
        pack.index_BT,
        pack.segment_NS,
    )
    torch.testing.assert_close(pack.unpack(dense.forward(flex_model)), got, rtol=1e-5, atol=1e-5)


def test_packed_layout_by_hand():
    ids, valid, response = _rows([[5, 6]], [[[7], [8, 9]]])
    pack = SharedPrefixPack.build(ids, valid, response)
    assert pack.input_ids_NS.tolist() == [[5, 6, 7, 8, 9]]
    assert pack.input_pos_NS.tolist() == [[0, 1, 2, 2, 3]]
    assert pack.index_BT.tolist() == [[0, 1, 2, 0], [0, 1, 3, 4]]
    assert pack.mask_NSS[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]


@pytest.mark.parametrize("algo_name", ["grpo", "ppo"])
def test_a_trainer_step_is_the_same_with_and_without_sharing(algo_name, monkeypatch):
    """Two RL steps (SGD, so the update is proportional to the gradient) from the same seed:
    the metrics and the weights agree to float rounding; PPO covers the value head, which reads
    the packed hidden states through the same unpacking."""
    algo = (
        RLAlgorithm.grpo(group_size=4, kl_coef=0.04)
        if algo_name == "grpo"
        else RLAlgorithm.ppo(group_size=4, minibatch_size=8)
    )
    build, packed = SharedPrefixPack.build, []
    monkeypatch.setattr(
        SharedPrefixPack,
        "build",
        staticmethod(lambda *a, **kw: packed.append(build(*a, **kw)) or packed[-1]),
    )
    runs = []
    for share in (False, True):
        policy = Policy.from_spec("tiny-1m", seed=0)
        head = ValueHead(policy.spec.embed_dim) if algo.use_value_head else None
        params = list(policy.model.parameters()) + (list(head.parameters()) if head else [])
        trainer = RLTrainer(
            policy,
            torch.optim.SGD(params, lr=0.5),
            task=ToyTask(),
            algo=algo,
            prompts_per_step=4,
            max_new_tokens=4,
            value_head=head,
            progress=False,
            seed=3,
            share_prefix=share,
        )
        runs.append(([trainer.step() for _ in range(2)], trainer))
    (rows_a, a), (rows_b, b) = runs
    assert any(p is not None for p in packed)  # the shared path did run (PPO shuffles rows)
    for row_a, row_b in zip(rows_a, rows_b):
        for key in ("pg_loss", "kl", "reward_mean", "vf_loss", "entropy"):
            if key in row_a:
                assert row_b[key] == pytest.approx(row_a[key], rel=1e-4, abs=1e-6), key
    for p, q in zip(a.policy.model.parameters(), b.policy.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_doctests():
    assert doctest.testmod(shared_prefix_module).failed == 0
