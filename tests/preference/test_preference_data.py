"""Preference data: preference and KTO rows (from a DataFrame, JSONL or chat messages), the
response mask, bad rows (a clear error naming the row and field, or a counted skipped row),
loaders that resume exactly, and the reference log-prob cache. Training on them is in
tests/preference/test_preference_training.py; pairs by rejection sampling in
tests/preference/test_preference_pairs.py.

Shapes: B = pairs, N = KTO rows, T = tokens."""

from __future__ import annotations

import json
import time

import pandas as pd
import pytest
import torch
from _preference_helpers import pair_dataset, pair_rows
from _train_helpers import TINY, tiny_model

from posttrain.data import (
    BadRowError,
    KTODataset,
    PreferenceDataset,
    PreferenceLoader,
    pairs_to_kto_rows,
)
from posttrain.models import ByteTokenizer
from posttrain.policy import Policy
from posttrain.preference import compute_reference_logps, reference_fingerprint

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# --------------------------------------------------------------------------------------------
# Rows, masks, loaders and the reference log-prob cache
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
    rows = pair_rows(3)
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
    rows = pair_rows(2) + [row]
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
    ds = pair_dataset(5)
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
    ds = PreferenceDataset(pair_rows(5), ByteTokenizer(), max_seq_len=64)
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
# Bad inputs: a clear error naming the argument, or a counted bad row
# --------------------------------------------------------------------------------------------


def test_a_broken_jsonl_line_is_a_counted_bad_row_with_its_line_number(tmp_path):
    path = tmp_path / "pairs.jsonl"
    lines = [json.dumps(r) for r in pair_rows(2)]
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
    pairs = pair_rows(2)
    assert pairs_to_kto_rows(pd.DataFrame(pairs)) == pairs_to_kto_rows(pairs)
    with pytest.raises(BadRowError, match=r"row 1, field 'rejected'.*\[missing_field\]"):
        pairs_to_kto_rows([pairs[0], {"prompt": "p", "chosen": "a"}])


def test_preference_stats_report_the_same_keys_as_before():
    ds = PreferenceDataset(pair_rows(2), ByteTokenizer(), max_seq_len=40)
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
    first = json.dumps(pair_rows(1)[0]).encode()
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
    rows = pair_rows(2)
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
