"""Bradley-Terry reward model: the loss by hand, gradient accumulation, the reward read at the last
real token (padding-independent, against an independent path), training on a separable synthetic
preference, save/load, pairwise accuracy."""

import doctest
import math
import random

import pytest
import torch

from posttrain.data import PreferenceDataset, PreferenceLoader
from posttrain.models import ByteTokenizer, get_preset
from posttrain.policy import Policy
from posttrain.preference import BradleyTerryLoss
from posttrain.rewards import (
    RewardModel,
    accuracy_from_rewards,
    bradley_terry_loss,
    load_reward_model,
    pairwise_accuracy,
    render_pair,
)
from posttrain.rewards import reward_model as rm_module
from posttrain.train import Trainer, TrainingLoss, get_loss

TOK = ByteTokenizer()
SMALL = get_preset("tiny-1m").replace(
    num_layers=2, num_heads=2, num_kv_heads=1, embed_dim=64, intermediate_dim=256, max_seq_len=128
)
"""A ~0.1M-parameter backbone for the training tests (fast on 2 shared cores)."""


@pytest.fixture(scope="module")
def rm():
    return RewardModel.from_spec("tiny-1m", seed=0).eval()


# --------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------


def test_bradley_terry_loss_by_hand():
    """r_c = 1, r_r = 0: log(1 + e^-1) = 0.313262; equal rewards: log 2 = 0.693147; a margin of
    1 on (1, 0): log 2; d loss / d r_c = -sigmoid(-1) = -0.268941 = -d loss / d r_r."""
    r_c = torch.tensor([1.0, 0.5], requires_grad=True)
    r_r = torch.tensor([0.0, 0.5], requires_grad=True)
    loss = bradley_terry_loss(r_c, r_r)
    assert loss.tolist() == pytest.approx([0.313262, 0.693147], abs=1e-6)
    loss[0].backward()
    assert r_c.grad.tolist() == pytest.approx([-0.268941, 0.0], abs=1e-6)
    assert r_r.grad.tolist() == pytest.approx([0.268941, 0.0], abs=1e-6)
    assert float(
        bradley_terry_loss(torch.tensor([1.0]), torch.tensor([0.0]), margin=1.0)
    ) == pytest.approx(math.log(2), abs=1e-6)
    per_pair = bradley_terry_loss(torch.ones(2), torch.zeros(2), margin=torch.tensor([0.0, 1.0]))
    assert per_pair.tolist() == pytest.approx([0.313262, 0.693147], abs=1e-6)
    extreme = bradley_terry_loss(torch.tensor([-100.0, 100.0]), torch.tensor([0.0, 0.0]))
    assert extreme.tolist() == pytest.approx([100.0, 0.0], abs=1e-4)  # no overflow
    with pytest.raises(ValueError, match="same shape"):
        bradley_terry_loss(torch.ones(2), torch.ones(3))


def test_registered_as_a_training_loss():
    loss = get_loss("bradley_terry", margin=0.5)
    assert isinstance(loss, BradleyTerryLoss) and isinstance(loss, TrainingLoss)
    assert loss.margin == 0.5
    with pytest.raises(TypeError, match="not a preference batch"):
        loss.num_units(object())


def _rows(n, seed):
    rng = random.Random(seed)
    word = lambda: "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 9)))  # noqa: E731
    return [
        {
            "prompt": f"{word()}?",
            "chosen": word() + "!" * rng.randint(0, 1),
            "rejected": word() + ".",
        }
        for _ in range(n)
    ]


def test_gradient_accumulation_equivalence():
    """One optimizer step on 8 pairs of different lengths: batch 8 x accumulation 1 equals
    batch 1 x accumulation 8 and batch 3 x accumulation 3 (micro-batches 3, 3, 2)."""
    dataset = PreferenceDataset(_rows(8, seed=0), TOK, max_seq_len=64)
    params = {}
    for batch_size, accum in ((8, 1), (1, 8), (3, 3)):
        model = RewardModel.from_spec(SMALL, seed=0)
        loader = PreferenceLoader(dataset, batch_size=batch_size, shuffle=False)
        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            data=loader,
            loss="bradley_terry",
            grad_accum_steps=accum,
            progress=False,
        )
        row = trainer.step()
        assert row["trained_tokens"] == 8  # the normaliser counts pairs
        params[(batch_size, accum)] = (
            row["loss"],
            [p.detach().clone() for p in model.parameters()],
        )
    loss_ref, ref = params[(8, 1)]
    for key in ((1, 8), (3, 3)):
        loss, got = params[key]
        assert loss == pytest.approx(loss_ref, rel=1e-6, abs=1e-6)
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------
# Where the reward is read
# --------------------------------------------------------------------------------------------


def _independent_reward(model: RewardModel, ids: list[int]) -> float:
    """Single unpadded row; the final-norm hidden state captured with a hook on `norm` (as
    `posttrain.rl.trainer.ValueHead` reads it) and the head applied by hand at the last token."""
    captured = {}
    hook = model.backbone.norm.register_forward_hook(lambda m, i, o: captured.setdefault("h", o))
    try:
        with torch.no_grad():
            model.backbone(torch.tensor([ids]))
    finally:
        hook.remove()
    return float(captured["h"][0, -1] @ model.head.weight[0])


def test_reward_is_read_at_the_last_real_token(rm):
    seqs = [
        render_pair(TOK, "12 + 30 =", "42"),
        render_pair(TOK, "1 + 1 =", "2"),
        render_pair(TOK, "what is the answer to 7 - 3?", "it is 4"),
    ]
    independent = [_independent_reward(rm, s) for s in seqs]
    T = max(len(s) for s in seqs)
    gen = torch.Generator().manual_seed(0)
    for pad_kind in ("right_zero", "right_random", "left_random"):
        ids = torch.zeros(3, T, dtype=torch.long)
        mask = torch.zeros(3, T, dtype=torch.bool)
        for b, s in enumerate(seqs):
            if pad_kind != "right_zero":
                ids[b] = torch.randint(0, 272, (T,), generator=gen)  # padding holds junk ids
            lo = T - len(s) if pad_kind == "left_random" else 0
            ids[b, lo : lo + len(s)] = torch.tensor(s)
            mask[b, lo : lo + len(s)] = True
        with torch.no_grad():
            got = rm(ids, mask).tolist()
        assert got == pytest.approx(independent, rel=1e-6, abs=1e-5), pad_kind
    with torch.no_grad():  # the last token matters
        changed = rm(torch.tensor([seqs[1][:-1] + [TOK.EOS]])).item()
    assert abs(changed - independent[1]) > 1e-4
    assert rm.score(seqs, batch_size=2) == pytest.approx(independent, rel=1e-6, abs=1e-5)


def test_forward_rejects_bad_shapes(rm):
    with pytest.raises(ValueError, match="no real token"):
        rm(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="attention_mask_BT has shape"):
        rm(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="tokens; need 1..512"):
        rm.score([[1] * 513])


def test_render_pair_is_the_preference_dataset_rendering():
    [item] = PreferenceDataset(
        [{"prompt": "3 + 4 =", "chosen": "7", "rejected": "8"}], TOK, max_seq_len=64
    ).items
    assert item["chosen_ids"].tolist() == render_pair(TOK, "3 + 4 =", "7")
    assert item["rejected_ids"].tolist() == render_pair(TOK, "3 + 4 =", "8")


def test_from_policy_copies_the_backbone_and_leaves_the_policy_alone():
    policy = Policy.from_spec("tiny-1m", seed=3)
    model = RewardModel.from_policy(policy, seed=0)
    ids = torch.tensor([render_pair(TOK, "1 + 1 =", "2")])
    with torch.no_grad():
        assert policy.model(ids).shape == (1, ids.shape[1], 272)  # still a language model
        captured = {}
        hook = policy.model.norm.register_forward_hook(lambda m, i, o: captured.setdefault("h", o))
        policy.model(ids)
        hook.remove()
        torch.testing.assert_close(model.backbone(ids), captured["h"])  # same hidden states
    assert all(p is not q for p in model.parameters() for q in policy.model.parameters())


# --------------------------------------------------------------------------------------------
# Training, accuracy, save/load
# --------------------------------------------------------------------------------------------


def _marker_rows(n, seed):
    """Separable preference: the chosen response contains '#', the rejected one does not."""
    rng = random.Random(seed)
    word = lambda k: "".join(rng.choice("abcdefghij") for _ in range(k))  # noqa: E731
    rows = []
    for _ in range(n):
        chosen, rejected = word(rng.randint(3, 8)), word(rng.randint(3, 8))
        at = rng.randint(0, len(chosen))
        rows.append(
            {"prompt": word(5), "chosen": chosen[:at] + "#" + chosen[at:], "rejected": rejected}
        )
    return rows


def test_tiny_reward_model_learns_a_separable_preference():
    train = PreferenceDataset(_marker_rows(240, seed=0), TOK, max_seq_len=64)
    held = _marker_rows(64, seed=1)
    chosen = [render_pair(TOK, r["prompt"], r["chosen"]) for r in held]
    rejected = [render_pair(TOK, r["prompt"], r["rejected"]) for r in held]
    model = RewardModel.from_spec(SMALL, seed=0)
    before = pairwise_accuracy(model, chosen, rejected)
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        data=PreferenceLoader(train, batch_size=16, seed=0),
        loss=BradleyTerryLoss(),
        progress=False,
    )
    metrics = trainer.fit(15)  # ~1.0 after 15 steps, 0.8-0.9 after the first (seeds 0-2)
    after = pairwise_accuracy(model, chosen, rejected)
    assert before.accuracy < 0.7 and after.accuracy > 0.9 and after.ci_low > 0.8, (before, after)
    assert metrics["loss"].iloc[-3:].mean() < 0.5 * metrics["loss"].iloc[0]
    assert before.num_pairs == after.num_pairs == 64


def test_pairwise_accuracy_counts_ties_as_wrong_with_a_wilson_interval():
    a = accuracy_from_rewards([1.0, 2.0, 0.0, 5.0], [0.0, 3.0, 0.0, 1.0])
    assert (a.accuracy, a.num_pairs, a.num_ties) == (0.5, 4, 1)
    assert (a.ci_low, a.ci_high) == pytest.approx((0.150, 0.850), abs=1e-3)
    assert a.mean_margin == pytest.approx(1.0)
    with pytest.raises(ValueError):
        accuracy_from_rewards([], [])


def test_save_and_load_round_trip(rm, tmp_path):
    folder = rm.save(tmp_path / "rm", TOK)
    loaded, tokenizer = load_reward_model(folder)
    seqs = [render_pair(TOK, "2 + 2 =", "4"), render_pair(TOK, "9 - 1 =", "8")]
    assert loaded.score(seqs) == pytest.approx(rm.score(seqs), rel=1e-6, abs=1e-6)
    assert loaded.spec == rm.spec and isinstance(tokenizer, ByteTokenizer)
    assert sorted(loaded.state_dict()) == sorted(rm.state_dict())
    rm.save(folder, TOK)  # replacing a reward-model folder is fine
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing"):
        rm.save(tmp_path / "other", TOK)
    with pytest.raises(FileNotFoundError, match="reward_model.json"):
        load_reward_model(tmp_path / "other")


def test_doctests():
    assert doctest.testmod(rm_module).failed == 0


def test_recipe_config_names_the_bad_field_and_splits_by_prompt():
    from posttrain import cli
    from posttrain.workflows import override

    recipe = cli.load_recipe("reward_model")
    with pytest.raises(
        ValueError, match=r"Config.pairs.samples_per_prompt=1; must be an integer >= 2"
    ):
        override(recipe.Config(), {"pairs.samples_per_prompt": 1})
    with pytest.raises(ValueError, match=r"Config.held_out_fraction=1.0"):
        recipe.Config(held_out_fraction=1.0)
    rows = [{"prompt": f"q{i % 10}", "chosen": "a", "rejected": f"b{i}"} for i in range(30)]
    train, held = recipe.split_by_question(rows, 0.2, seed=0)
    assert len({r["prompt"] for r in held}) == 2 and len(train) + len(held) == 30
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    with pytest.raises(ValueError, match="too few to split"):
        recipe.split_by_question(rows[:1], 0.2, seed=0)


def test_bad_batches_and_batch_sizes_raise_naming_the_problem(rm):
    with pytest.raises(ValueError, match="input_ids_BT is empty"):
        rm(torch.zeros(0, 4, dtype=torch.long))
    vocab = rm.spec.vocab_size
    with pytest.raises(ValueError, match=rf"vocabulary is \[0, {vocab}\)"):
        rm(torch.tensor([[1, vocab]]))
    with pytest.raises(ValueError, match="vocabulary"):
        rm(torch.tensor([[-1, 2]]))
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=f"batch_size={bad!r}; must be an integer >= 1"):
            rm.score([[1, 2]], batch_size=bad)


def test_throughput_counts_the_tokens_of_both_rows_not_pairs():
    """tokens_per_s and mfu of a reward-model step count every real token of the chosen and
    rejected rows (the forward covers them all), not the pairs the loss averages over."""
    rows = [
        {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
        {"prompt": "10+1=", "chosen": "11", "rejected": "101"},
    ]
    tokenizer = ByteTokenizer()
    ds = PreferenceDataset(rows, tokenizer, max_seq_len=32)
    expected = sum(len(ds[i]["chosen_ids"]) + len(ds[i]["rejected_ids"]) for i in range(2))
    model = RewardModel.from_spec("tiny-1m", seed=0)
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        data=PreferenceLoader(ds, batch_size=2),
        loss=BradleyTerryLoss(),
        progress=False,
    )
    row = trainer.step()
    assert row["trained_tokens"] == 2  # the loss's normaliser: pairs
    assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(expected, rel=1e-9)
    assert expected > 2 * len("2+2=4")  # prompt and response of both rows
