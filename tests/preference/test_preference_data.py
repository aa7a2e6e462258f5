"""Preference optimisation, data and training side: gradient accumulation through the Trainer,
the registered objectives, preference and KTO data (rows, bad rows, loaders that resume), the
reference log-prob cache and pairs by rejection sampling. The losses against TRL are in
tests/preference/test_preference.py.

Shapes: B = pairs, N = KTO rows, T = tokens.
"""

from __future__ import annotations

import json
import math
import time

import pandas as pd
import pytest
import torch
from _train_helpers import TINY, assert_grads_close, tiny_model
from _trl_harness import _close

from posttrain.data import (
    BadRowError,
    KTODataset,
    PreferenceDataset,
    PreferenceLoader,
    pairs_to_kto_rows,
)
from posttrain.models import ByteTokenizer
from posttrain.policy import Completion, Policy
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
    make_preference_pairs,
    orpo_loss,
    reference_fingerprint,
    step_share,
)
from posttrain.rewards import VerifierResult
from posttrain.train import Trainer, TrainingLoss, get_loss, registered_losses

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _pair_rows(n):
    """Pairs whose prompts and responses all have different lengths."""
    return [
        {
            "prompt": f"{3 + 7 * i}+{11 + 5 * i}=" + "?" * (i % 3),
            "chosen": str(14 + 12 * i) + " ok" * (i % 2),
            "rejected": str(15 + 12 * i) + "!" * (i % 4),
        }
        for i in range(n)
    ]


def _pair_dataset(n=4, reference_seed=1):
    ds = PreferenceDataset(_pair_rows(n), ByteTokenizer(), max_seq_len=64)
    compute_reference_logps(tiny_model(reference_seed), ds, batch_size=3)
    return ds


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
    dataset = _pair_dataset(4)
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
    rows = pairs_to_kto_rows(_pair_rows(3))
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
    dataset = PreferenceDataset(_pair_rows(2), ByteTokenizer(), max_seq_len=64)
    batch = dataset.collate([0, 1])
    with pytest.raises(ValueError, match="compute_reference_logps"):
        DPOLoss()(tiny_model(0), batch, torch.tensor(2))
    share = SimPOLoss()(tiny_model(0), batch, torch.tensor(2))  # reference-free
    assert share.requires_grad and torch.isfinite(share)
    metrics = DPOLoss().metrics(tiny_model(0), _pair_dataset(2, reference_seed=0).collate([0, 1]))
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference
    assert metrics["reward_margin"] == pytest.approx(0.0, abs=1e-5)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def test_response_mask_marks_exactly_the_response_tokens_and_padding_never_counts():
    tok = ByteTokenizer()
    ds = PreferenceDataset(
        [{"prompt": "2+2=", "chosen": "4", "rejected": "five"}], tok, max_seq_len=32
    )
    batch = PreferenceLoader(ds, batch_size=1).next_batch()
    ids, attention, response = batch.concatenated()
    assert ids.shape == attention.shape == response.shape == (2, 13)
    for r, text in enumerate(["4", "five"]):
        marked = ids[r][response[r]].tolist()
        assert tok.decode(marked, skip_special_tokens=False) == text + "<|end|>"
        assert not (response[r] & ~attention[r]).any()
    assert int(attention[0].sum()) == 10 and not attention[0, 10:].any()  # chosen is padded


def test_rows_from_a_dataframe_jsonl_and_chat_messages_render_the_same(tmp_path):
    rows = _pair_rows(3)
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    chat_rows = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in rows
    ]
    tok = ByteTokenizer()
    datasets = [
        PreferenceDataset(src, tok, max_seq_len=64)
        for src in (rows, pd.DataFrame(rows), path, str(path), chat_rows)
    ]
    for ds in datasets[1:]:
        for a, b in zip(datasets[0], ds, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)
    plain = PreferenceDataset(rows, tok, max_seq_len=64, chat=False)
    ids, mask = plain.sequence(0, "chosen")
    marked = tok.decode(ids[mask].tolist(), skip_special_tokens=False)
    assert marked == rows[0]["chosen"] + "<|eos|>"


BAD_ROWS = [
    ("not a dict", None, "not_a_dict"),
    ({"chosen": "a", "rejected": "b"}, "prompt", "missing_field"),
    ({"prompt": "p", "rejected": "b"}, "chosen", "missing_field"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "chosen", "non_string"),
    ({"prompt": "  ", "chosen": "a", "rejected": "b"}, "prompt", "empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "rejected", "same_response"),
    ({"prompt": "p", "chosen": "b", "rejected": "b "}, "rejected", "same_response"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "chosen", "empty_response"),
    ({"prompt": "p", "chosen": "a", "rejected": " \n"}, "rejected", "empty_response"),
    ({"prompt": "p", "chosen": "a", "rejected": "b" * 80}, "rejected", "overlong"),
    (
        {"prompt": [{"role": "robot", "content": "p"}], "chosen": "a", "rejected": "b"},
        "prompt",
        "render_error",
    ),
    (
        {
            "prompt": [{"role": "user", "content": "p"}],
            "chosen": [{"role": "user", "content": "a"}],
            "rejected": "b",
        },
        "chosen",
        "non_string",
    ),
]


@pytest.mark.parametrize("row,field,reason", BAD_ROWS, ids=[r for _, _, r in BAD_ROWS])
def test_a_bad_row_raises_naming_its_index_and_field_or_is_skipped_and_counted(row, field, reason):
    rows = _pair_rows(2) + [row]
    with pytest.raises(BadRowError) as info:
        PreferenceDataset(rows, ByteTokenizer(), max_seq_len=40)
    assert (info.value.index, info.value.field, info.value.reason) == (2, field, reason)
    assert str(info.value).startswith("row 2") and f"[{reason}]" in str(info.value)
    ds = PreferenceDataset(rows, ByteTokenizer(), max_seq_len=40, on_bad_row="skip")
    assert len(ds) == 2 and ds.stats.skipped_by_reason == {reason: 1} and ds.stats.rows == 3


def test_kto_rows_validate_labels_and_pair_each_prompt_with_another_completion():
    rows = [
        {"prompt": "a?", "completion": "x", "label": True},
        {"prompt": "b?", "completion": "yy", "label": False},
        {"prompt": "c?", "completion": "zzz", "label": 1},
    ]
    with pytest.raises(BadRowError, match=r"row 2, field 'label'.*\[bad_label\]"):
        KTODataset(rows, ByteTokenizer(), max_seq_len=32)
    ds = KTODataset(rows, ByteTokenizer(), max_seq_len=32, on_bad_row="skip")
    assert ds.stats.skipped_by_reason == {"bad_label": 1}
    tok = ByteTokenizer()
    kl_ids, kl_mask = ds.sequence(0, "kl")  # prompt of row 0, completion of row 1
    assert tok.decode(kl_ids.tolist()).startswith("a?")
    assert tok.decode(kl_ids[kl_mask].tolist()) == "yy"
    with pytest.raises(ValueError, match="at least 2"):
        KTODataset(rows[:1], tok, max_seq_len=32)


def test_loader_resumes_exactly_from_its_state():
    ds = _pair_dataset(5)
    first = PreferenceLoader(ds, batch_size=2, seed=3)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    expected = [first.next_batch() for _ in range(3)]
    second = PreferenceLoader(ds, batch_size=2, seed=3)
    second.load_state_dict(state)
    for a, b in zip(expected, [second.next_batch() for _ in range(3)]):
        assert torch.equal(a.chosen_input_ids, b.chosen_input_ids)
        assert torch.equal(a.ref_rejected_logps, b.ref_rejected_logps)
    with pytest.raises(ValueError, match="seed"):
        PreferenceLoader(ds, batch_size=2, seed=4).load_state_dict(state)


def test_reference_logps_are_cached_by_fingerprint_and_recomputed_for_another_reference():
    ds = PreferenceDataset(_pair_rows(5), ByteTokenizer(), max_seq_len=64)
    reference = tiny_model(1)
    calls = []
    reference.register_forward_hook(lambda module, args, out: calls.append(1))
    first = compute_reference_logps(reference, ds, batch_size=2)
    assert len(calls) == 6 and first.values["chosen"].shape == (5,)  # 3 batches x 2 keys
    assert first.values["chosen"].dtype == torch.float32
    assert compute_reference_logps(reference, ds) is first and len(calls) == 6  # reused
    # the values equal the policy's own teacher-forced scoring, one pair at a time
    policy = Policy(reference, ByteTokenizer(), TINY)
    ids, mask = ds.sequence(4, "rejected")
    [alone] = policy.logprobs([ids[~mask].tolist()], [ids[mask].tolist()])
    assert float(first.values["rejected"][4]) == pytest.approx(
        float(alone.sum()), rel=1e-6, abs=1e-5
    )
    assert torch.equal(ds.collate([4]).ref_rejected_logps, first.values["rejected"][4:5])

    calls.clear()
    with torch.no_grad():
        reference.norm.scale[0] += 1e-3  # one changed parameter changes the fingerprint
    second = compute_reference_logps(reference, ds, batch_size=2)
    assert len(calls) == 6 and second.fingerprint != first.fingerprint
    assert ds.reference is second
    assert reference_fingerprint(tiny_model(1)) == first.fingerprint


# --------------------------------------------------------------------------------------------
# Rejection sampling
# --------------------------------------------------------------------------------------------


class _ScriptedPolicy:
    """`generate` returns the scripted texts of each prompt, in order."""

    tokenizer = ByteTokenizer()

    def __init__(self, texts_by_question):
        self.texts = texts_by_question
        self.calls = []

    def generate(self, prompts, *, n, seed, **kwargs):
        self.calls.append((len(prompts), n, seed))
        out = []
        for p, ids in enumerate(prompts):
            question = self.tokenizer.decode(ids).strip()
            texts = self.texts[question]
            assert len(texts) == n
            out += [Completion(p, k, list(ids), [], t, [], "eos") for k, t in enumerate(texts)]
        return out


RANK_BUDGET_S = 2.0
"""Budget of `_rank` calls: 'hang' sleeps 600 s past it; the others answer in milliseconds,
well within it even when the machine is busy."""


def _rank(completion, item):
    """A verifier: 'hang' times out, 'boom' raises, '' is a format error, else exact match."""
    if completion == "hang":
        time.sleep(600)
    if completion == "boom":
        raise RuntimeError("boom")
    if completion == "":
        return VerifierResult.failure("format_error", "empty")
    return VerifierResult.from_score(float(completion == item["answer"]))


def test_pairs_keep_best_vs_worst_exclude_failures_and_count_everything():
    items = [
        {"question": "q1", "answer": "1"},
        {"question": "q2", "answer": "2"},
        {"question": "q3", "answer": "3"},
        {"question": "q4", "answer": "4"},
        {"question": "q5", "answer": "5"},
    ]
    policy = _ScriptedPolicy(
        {
            "q1": ["9", "1", "boom", "1"],  # pair (1, 9); the error excluded, not a 0.0
            "q2": ["7", "8", "hang", "6"],  # all scored candidates wrong: skipped
            "q3": ["", "3", "3", "3"],  # format error ranks lowest: pair (3, "")
            "q4": ["boom", "boom", "hang", "4"],  # one usable candidate: too few
            "q5": ["5", "5", "5", "5"],  # all right: skipped
        }
    )
    rows, stats = make_preference_pairs(
        policy, items, rank=_rank, n=4, seed=7, prompts_per_batch=3, timeout_s=RANK_BUDGET_S
    )
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
        ("q1", "1", "9"),
        ("q3", "3", ""),
    ]
    assert rows[1]["rejected_outcome"] == "format_error" and rows[0]["chosen_score"] == 1.0
    assert (stats.prompts, stats.samples, stats.pairs) == (5, 20, 2)
    assert (stats.skipped_all_equal, stats.skipped_too_few) == (2, 1)
    assert stats.excluded == {"error": 3, "timeout": 2}
    assert stats.outcomes == {"ok": 10, "wrong": 4, "format_error": 1, "timeout": 2, "error": 3}
    assert [c[2] for c in policy.calls] == [7, 10]  # seed + first item index of each chunk

    rows, stats = make_preference_pairs(
        policy,
        items,
        rank=_rank,
        n=4,
        timeout_s=RANK_BUDGET_S,
        format_error="exclude",
        reference_answer=lambda item: item["answer"],
    )
    # q2's samples are all wrong: the reference answer is the chosen one; q3 now ties
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
        ("q1", "1", "9"),
        ("q2", "2", "7"),
    ]
    assert stats.excluded == {"error": 3, "timeout": 2, "format_error": 1}
    assert (stats.reference_chosen, stats.skipped_all_equal, stats.skipped_too_few) == (1, 3, 0)


def test_pairs_from_a_real_policy_are_deterministic_and_feed_the_datasets():
    policy = Policy(tiny_model(0), ByteTokenizer(), TINY)
    items = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]
    judge = lambda completion, item: float(len(completion) % 3)  # noqa: E731  a plain callable
    first = make_preference_pairs(policy, items, rank=judge, n=4, max_new_tokens=6, seed=1)
    again = make_preference_pairs(policy, items, rank=judge, n=4, max_new_tokens=6, seed=1)
    assert first == again and first[1].pairs >= 1
    PreferenceDataset(first[0], ByteTokenizer(), max_seq_len=64)
    KTODataset(pairs_to_kto_rows(first[0]), ByteTokenizer(), max_seq_len=64)


# --------------------------------------------------------------------------------------------
# Bad inputs: a clear error naming the argument, or a counted bad row
# --------------------------------------------------------------------------------------------


def test_a_broken_jsonl_line_is_a_counted_bad_row_with_its_line_number(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(r) for r in _pair_rows(2)]
    path.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.raises(BadRowError, match=r"row 1: .*pairs.jsonl:2: not valid JSON"):
        PreferenceDataset(path, ByteTokenizer(), max_seq_len=40)
    ds = PreferenceDataset(path, ByteTokenizer(), max_seq_len=40, on_bad_row="skip")
    assert len(ds) == 2 and ds.stats.skipped_by_reason == {"bad_json": 1}
    with pytest.raises(ValueError, match="cannot read preference rows from a int"):
        PreferenceDataset(5, ByteTokenizer(), max_seq_len=40)


def test_empty_kto_completion_is_a_bad_row_and_numpy_bool_labels_are_accepted():
    import numpy as np

    rows = [
        {"prompt": "a?", "completion": "x", "label": np.True_},
        {"prompt": "b?", "completion": "yy", "label": np.False_},
        {"prompt": "c?", "completion": "  ", "label": True},
    ]
    ds = KTODataset(rows, ByteTokenizer(), max_seq_len=32, on_bad_row="skip")
    assert len(ds) == 2 and ds.stats.skipped_by_reason == {"empty_response": 1}
    assert [ds[i]["desirable"] for i in range(2)] == [True, False]


def test_pairs_to_kto_rows_reads_a_dataframe_and_names_a_bad_row():
    pairs = _pair_rows(2)
    assert pairs_to_kto_rows(pd.DataFrame(pairs)) == pairs_to_kto_rows(pairs)
    with pytest.raises(BadRowError, match=r"row 1, field 'rejected'.*\[missing_field\]"):
        pairs_to_kto_rows([pairs[0], {"prompt": "p", "chosen": "a"}])


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


def test_preference_stats_report_the_same_keys_as_before():
    ds = PreferenceDataset(_pair_rows(2), ByteTokenizer(), max_seq_len=40)
    assert list(ds.stats.as_dict()) == [
        "rows",
        "samples",
        "skipped_by_reason",
        "tokens",
        "response_tokens",
        "kl_truncated",
        "skipped",
    ]


def test_a_preference_file_that_is_not_utf8_names_file_line_and_byte_offset(tmp_path):
    first = json.dumps(_pair_rows(1)[0]).encode()
    (tmp_path / "pairs.jsonl").write_bytes(first + b"\n\xc3(\n")
    with pytest.raises(
        ValueError,
        match=rf"pairs.jsonl:2: not UTF-8 text \(byte 0xc3 at byte "
        rf"offset {len(first) + 1}",
    ):
        PreferenceDataset(
            tmp_path / "pairs.jsonl", ByteTokenizer(), max_seq_len=40, on_bad_row="skip"
        )


def test_a_huge_preference_or_kto_row_is_cut_before_tokenising():
    """Cut before tokenising: a few CPU seconds at most (tokenising 50M bytes takes far longer;
    CPU seconds, which waiting for a core does not inflate)."""
    huge, long = "b" * 50_000_000, "b" * 200
    rows = _pair_rows(2)
    start = time.thread_time()
    with pytest.raises(
        BadRowError,
        match=r"row 2, field 'rejected': prompt \+ rejected has "
        r"over \d+ tokens, more than max_seq_len=40",
    ):
        PreferenceDataset(
            rows + [{"prompt": "p", "chosen": "a", "rejected": huge}],
            ByteTokenizer(),
            max_seq_len=40,
        )
    ds = PreferenceDataset(
        rows + [{"prompt": huge, "chosen": "a", "rejected": "c"}],
        ByteTokenizer(),
        max_seq_len=40,
        on_bad_row="skip",
    )
    ref = PreferenceDataset(
        rows + [{"prompt": long, "chosen": "a", "rejected": "c"}],
        ByteTokenizer(),
        max_seq_len=40,
        on_bad_row="skip",
    )
    assert ds.stats.as_dict() == ref.stats.as_dict() and ds.stats.skipped_by_reason == {
        "overlong": 1
    }
    kto = [
        {"prompt": "p", "completion": "a", "label": True},
        {"prompt": "q", "completion": "bb", "label": False},
    ]
    ds = KTODataset(
        kto + [{"prompt": "r", "completion": huge, "label": True}],
        ByteTokenizer(),
        max_seq_len=40,
        on_bad_row="skip",
    )
    ref = KTODataset(
        kto + [{"prompt": "r", "completion": long, "label": True}],
        ByteTokenizer(),
        max_seq_len=40,
        on_bad_row="skip",
    )
    assert ds.stats.as_dict() == ref.stats.as_dict()
    assert all(torch.equal(a["kl"][0], b["kl"][0]) for a, b in zip(ds, ref, strict=True))
    assert time.thread_time() - start < 5
