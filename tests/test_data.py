"""Tests for posttrain.data.loader: SFT/CPT samples, labels, padding, packing, loader resume.

Byte tokenizer ids used in pinned values: 257 <|bos|>, 258 <|eos|>, 260 <|user|>,
261 <|assistant|>, 262 <|end|>; bytes: 'h' 104, 'i' 105, 'k' 107, 'o' 111.
"""

from __future__ import annotations

import doctest
import json

import pandas as pd
import pytest
import torch

from posttrain.data import loader as data_module
from posttrain.data import sft as data_sources
from posttrain.data import (
    IGNORE_INDEX,
    BadRowError,
    Batch,
    CPTDataset,
    Sample,
    SFTDataset,
    SFTLoader,
    collate_padded,
    epoch_order,
    labels_from_loss_mask,
    load_sft_rows,
    load_text_documents,
    pack_samples,
    reasoning_gym_sft_rows,
    right_pad,
    stack_rows,
    text_char_limit,
)
from posttrain.models import ByteTokenizer, RenderedChat

X = IGNORE_INDEX
TOK = ByteTokenizer()


def chat(prompt: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt},
                         {"role": "assistant", "content": answer}]}


class EosPadTokenizer:
    """ByteTokenizer whose pad id is EOS and whose only stop id is EOS (like many HF models), so
    `<|end|>` does not end a sequence and SFTDataset must append a trained EOS."""

    vocab_size, bos_id, eos_id, pad_id = 272, 257, 258, 258
    stop_ids = frozenset({258})

    def encode(self, text, *, add_bos=False, add_eos=False):
        return TOK.encode(text, add_bos=add_bos, add_eos=add_eos)

    def decode(self, ids, *, skip_special_tokens=True):
        return TOK.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages, *, add_generation_prompt=False):
        return TOK.render_chat(messages, add_generation_prompt=add_generation_prompt)


class EosClosesTurnTokenizer(EosPadTokenizer):
    """Template closes each turn with EOS itself (HF fallback template style): no extra EOS."""

    def render_chat(self, messages, *, add_generation_prompt=False):
        c = TOK.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return RenderedChat([258 if i == 262 else i for i in c.input_ids], c.loss_mask)


# ------------------------------------------------------------------------------------------
# Labels and masks, pinned by hand
# ------------------------------------------------------------------------------------------


def test_sft_labels_pinned_single_turn():
    """<bos><user>hi<end><assistant>ok<end>: 'o', 'k', <end> are predicted from the position
    before them; the last position has no next token. <end> is a stop id: no EOS appended."""
    ds = SFTDataset([chat("hi", "ok")], TOK, max_seq_len=32)
    s = ds[0]
    assert s.input_ids.tolist() == [257, 260, 104, 105, 262, 261, 111, 107, 262]
    assert s.labels.tolist() == [X, X, X, X, X, 111, 107, 262, X]
    assert s.input_ids.dtype == s.labels.dtype == torch.int64
    assert ds.stats.as_dict() == {"rows": 1, "samples": 1, "skipped_by_reason": {},
                                  "truncated": 0, "dropped": 0, "split_documents": 0,
                                  "tokens": 9, "trained_tokens": 3, "skipped": 0}


def test_sft_labels_pinned_multi_turn_trains_every_assistant_turn_only():
    row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "h"},
                        {"role": "assistant", "content": "o"}, {"role": "user", "content": "i"},
                        {"role": "assistant", "content": "k"}]}
    s = SFTDataset([row], TOK, max_seq_len=32)[0]
    # 257 259 's' 262 260 'h' 262 261 'o' 262 260 'i' 262 261 'k' 262
    assert s.input_ids.tolist() == [257, 259, 115, 262, 260, 104, 262, 261, 111, 262,
                                    260, 105, 262, 261, 107, 262]
    assert s.labels.tolist() == [X, X, X, X, X, X, X, 111, 262, X, X, X, X, 107, 262, X]


def test_prompt_completion_rows_equal_messages_rows():
    a = SFTDataset([{"prompt": "hi", "completion": "ok"}], TOK, max_seq_len=32)[0]
    b = SFTDataset([chat("hi", "ok")], TOK, max_seq_len=32)[0]
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_pad_equal_to_eos_still_trains_eos_padded_and_packed():
    tok = EosPadTokenizer()
    ds = SFTDataset([chat("hi", "ok"), chat("hi", "okay")], tok, max_seq_len=32)
    s = ds[0]
    assert s.input_ids.tolist() == [257, 260, 104, 105, 262, 261, 111, 107, 262, 258]
    assert s.labels.tolist() == [X, X, X, X, X, 111, 107, 262, 258, X]
    batch = collate_padded([ds[0], ds[1]], tok.pad_id)
    # row 0 is padded with 258 == EOS; the real EOS at position 9 is predicted at 8, the pads
    # are not trained.
    assert batch.input_ids[0].tolist() == s.input_ids.tolist() + [258, 258]
    assert batch.labels[0].tolist() == s.labels.tolist() + [X, X]
    assert batch.num_trained_tokens == 4 + 6
    packed = pack_samples(list(ds), 32, tok.pad_id)[0]
    eos_labels = (packed.labels[0] == 258).sum().item()
    assert eos_labels == 2 and packed.num_trained_tokens == 10


def test_template_that_ends_with_a_trained_stop_gets_no_extra_eos():
    s = SFTDataset([chat("hi", "ok")], EosClosesTurnTokenizer(), max_seq_len=32)[0]
    assert s.input_ids.tolist() == [257, 260, 104, 105, 258, 261, 111, 107, 258]
    assert s.labels.tolist() == [X, X, X, X, X, 111, 107, 258, X]


def test_collate_padded_pinned():
    a = Sample.from_loss_mask([1, 2, 3], [False, True, True])
    b = Sample.from_loss_mask([4, 5], [False, True])
    batch = collate_padded([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert batch.labels.tolist() == [[2, 3, X], [5, X, X]]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert batch.attention_mask is None and batch.num_samples == 2
    assert batch.num_trained_tokens == 3
    with pytest.raises(ValueError, match="at least one"):
        collate_padded([], 0)


def test_pack_pinned_block_causal_mask_positions_and_labels():
    a = Sample.from_loss_mask([1, 2], [False, True])
    b = Sample.from_loss_mask([3, 4, 5], [False, True, True])
    (row,) = pack_samples([a, b], seq_len=6, pad_id=0)
    assert row.input_ids.tolist() == [[1, 2, 3, 4, 5, 0]]
    # Sample a's last token (2) must not learn to predict b's first token (3).
    assert row.labels.tolist() == [[2, X, 4, 5, X, X]]
    assert row.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
    T, F = True, False
    assert row.attention_mask[0].tolist() == [
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [F, F, T, F, F, F],
        [F, F, T, T, F, F],
        [F, F, T, T, T, F],
        [F, F, F, F, F, T],  # padding tail: its own block, so no row is fully masked
    ]
    assert row.num_samples == 2 and row.attention_mask.dtype == torch.bool


def test_pack_samples_starts_new_rows_and_rejects_too_long():
    samples = [Sample.from_loss_mask(list(range(n)), [True] * n) for n in (3, 3, 2, 4)]
    rows = pack_samples(samples, seq_len=6, pad_id=0)
    assert [r.num_samples for r in rows] == [2, 2]
    batch = stack_rows(rows)
    assert batch.input_ids.shape == batch.labels.shape == (2, 6)
    assert batch.attention_mask.shape == (2, 6, 6) and batch.num_samples == 4
    with pytest.raises(ValueError, match="does not fit"):
        pack_samples(samples, seq_len=3, pad_id=0)


def test_batch_validates_shapes_and_dtypes():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="labels"):
        Batch(ids, torch.zeros(2, 3, dtype=torch.int32), ids, None, 2)
    with pytest.raises(ValueError, match="attention_mask"):
        Batch(ids, ids, ids, torch.ones(2, 3, 3), 2)


# ------------------------------------------------------------------------------------------
# Packing is exact: the model sees each packed sample as if alone
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from posttrain.models import build_model, get_preset

    return build_model(get_preset("tiny-1m"), seed=0).eval()


ROWS = [chat("hello there", "general kenobi"), chat("2+2?", "4"), chat("abc", "def ghi")]


def _forward(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch.input_ids, mask=batch.attention_mask, input_pos=batch.position_ids)


def test_packed_logits_equal_each_sample_alone(tiny_model):
    """A packed row [s0 | s1 | s2 | pad] against each sample alone.

    Alone in a row of the same length (same matmul shapes) the logits agree to <= 1e-5 (in
    practice bitwise). Alone unpadded, with the default causal mask (mask=None), they agree up
    to fp32 rounding of different matmul shapes: logits here reach |x| ~ 140, where 1 ulp is
    1.5e-5, so the comparison is relative (rtol 1e-5) with atol 1e-5.
    """
    ds = SFTDataset(ROWS, TOK, max_seq_len=64)
    T = 80
    (row,) = pack_samples(list(ds), T, TOK.pad_id)
    assert row.num_samples == 3 and sum(len(s) for s in ds) < T
    logits = _forward(tiny_model, row)[0]
    start = 0
    for s in ds:
        L = len(s)
        same_shape = _forward(tiny_model, pack_samples([s], T, TOK.pad_id)[0])[0, :L]
        assert (logits[start: start + L] - same_shape).abs().max().item() <= 1e-5
        with torch.no_grad():
            alone = tiny_model(s.input_ids[None])[0]
        torch.testing.assert_close(logits[start: start + L], alone, rtol=1e-5, atol=1e-5)
        start += L


def test_packed_sample_does_not_see_its_neighbour(tiny_model):
    """Changing every token of sample 0 leaves sample 1's logits bitwise unchanged."""
    ds = SFTDataset(ROWS[:2], TOK, max_seq_len=64)
    (row,) = pack_samples(list(ds), 48, TOK.pad_id)
    a, b = len(ds[0]), len(ds[0]) + len(ds[1])
    other = row.input_ids.clone()
    other[0, :a] = 65
    changed = Batch(other, row.labels, row.position_ids, row.attention_mask, row.num_samples)
    assert torch.equal(_forward(tiny_model, row)[0, a:b], _forward(tiny_model, changed)[0, a:b])


def test_no_label_crosses_a_sample_boundary():
    ds = SFTDataset([chat("q" * k, "a" * (k % 5 + 1)) for k in range(20)], TOK, max_seq_len=40)
    loader = SFTLoader(ds, batch_size=3, pack=True, seq_len=64, seed=1)
    for _ in range(loader.batches_per_epoch):
        batch = loader.next_batch()
        for b, t in (batch.labels != X).nonzero().tolist():
            assert t + 1 < batch.labels.shape[1]
            assert batch.labels[b, t] == batch.input_ids[b, t + 1]
            assert batch.position_ids[b, t + 1] == batch.position_ids[b, t] + 1
            assert batch.attention_mask[b, t + 1, t]  # t and t+1 belong to the same sample


# ------------------------------------------------------------------------------------------
# Bad rows, over-long rows
# ------------------------------------------------------------------------------------------

BAD_ROWS = {
    "not_a_dict": "just a string",
    "no_messages": {"text": "hi"},
    "bad_message": {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
    "non_string_content": {"messages": [{"role": "user", "content": 3},
                                        {"role": "assistant", "content": "x"}]},
    "unknown_role": {"messages": [{"role": "human", "content": "hi"},
                                  {"role": "assistant", "content": "x"}]},
    "empty_assistant": chat("hi", "  "),
    "no_assistant": {"messages": [{"role": "user", "content": "hi"}]},
    "last_not_assistant": {"messages": [*chat("hi", "ok")["messages"],
                                        {"role": "user", "content": "more"}]},
}


@pytest.mark.parametrize("reason", sorted(BAD_ROWS))
def test_bad_row_raises_naming_index_and_problem(reason):
    rows = [chat("a", "b"), chat("c", "d"), BAD_ROWS[reason], chat("e", "f")]
    with pytest.raises(ValueError, match=rf"^row 2: .*\[{reason}\]$") as info:
        SFTDataset(rows, TOK, max_seq_len=32)
    assert isinstance(info.value, BadRowError)
    assert info.value.index == 2 and info.value.reason == reason


def test_prompt_completion_row_errors():
    with pytest.raises(ValueError, match=r"row 0: .*'completion'"):
        SFTDataset([{"prompt": "hi"}], TOK, max_seq_len=32)
    with pytest.raises(ValueError, match=r"row 0: 'completion' is a int"):
        SFTDataset([{"prompt": "hi", "completion": 4}], TOK, max_seq_len=32)


def test_skip_counts_bad_rows_by_reason():
    rows = [chat("a", "b"), *BAD_ROWS.values(), BAD_ROWS["no_assistant"], chat("c", "d")]
    ds = SFTDataset(rows, TOK, max_seq_len=32, on_bad_row="skip")
    assert len(ds) == 2 and ds.row_indices == [0, len(rows) - 1]
    assert ds.stats.skipped == len(BAD_ROWS) + 1
    assert ds.stats.skipped_by_reason == {**{r: 1 for r in BAD_ROWS}, "no_assistant": 2}
    assert ds.stats.rows == len(rows) and ds.stats.samples == 2


def test_empty_dataset_raises():
    with pytest.raises(ValueError, match="empty"):
        SFTDataset([], TOK, max_seq_len=32)
    with pytest.raises(ValueError, match=r"no usable rows.*no_assistant"):
        SFTDataset([BAD_ROWS["no_assistant"]], TOK, max_seq_len=32, on_bad_row="skip")
    with pytest.raises(ValueError, match="empty"):
        CPTDataset([], TOK, max_seq_len=32)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="on_bad_row='ignore'; allowed: 'raise', 'skip'"):
        SFTDataset([chat("a", "b")], TOK, max_seq_len=32, on_bad_row="ignore")
    with pytest.raises(ValueError, match="overlong"):
        SFTDataset([chat("a", "b")], TOK, max_seq_len=32, overlong="cut")
    with pytest.raises(ValueError, match="max_seq_len"):
        SFTDataset([chat("a", "b")], TOK, max_seq_len=1)


def test_overlong_truncate_and_drop_are_counted():
    # lengths: chat(p, a) = 6 + len(p) + len(a) tokens (bos, user, end, assistant, end + ...).
    rows = [chat("hi", "ok"),             # 10 tokens: fits in 12
            chat("hi", "a" * 10),         # 18 tokens: truncated to 12, 4 trained labels left
            chat("p" * 20, "ok")]         # prompt alone exceeds 12: nothing trained left
    ds = SFTDataset(rows, TOK, max_seq_len=12, overlong="truncate")
    assert (ds.stats.truncated, ds.stats.dropped, len(ds)) == (1, 1, 2)
    cut = ds[1]
    assert len(cut) == 12 and cut.labels.tolist() == [X] * 5 + [97] * 6 + [X]
    ds = SFTDataset(rows, TOK, max_seq_len=12, overlong="drop")
    assert (ds.stats.truncated, ds.stats.dropped, len(ds)) == (0, 2, 1)


# ------------------------------------------------------------------------------------------
# Sources
# ------------------------------------------------------------------------------------------


def test_load_sft_rows_from_jsonl_and_dataframe(tmp_path):
    rows = [chat("hi", "ok"), {"prompt": "a", "completion": "b"}]
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_sft_rows(path) == rows
    assert load_sft_rows(str(path)) == rows
    frame = pd.DataFrame(rows)  # mixed schema: pandas fills the missing cells with NaN
    assert load_sft_rows(frame) == rows
    assert len(SFTDataset(frame, TOK, max_seq_len=32)) == 2
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_sft_rows(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError):
        load_sft_rows(tmp_path / "missing.jsonl")


def test_load_text_documents_sources(tmp_path):
    (tmp_path / "a.txt").write_text("one document\nwith two lines")
    assert load_text_documents(tmp_path / "a.txt") == ["one document\nwith two lines"]
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n{"body": "y"}\n')
    assert load_text_documents(tmp_path / "d.jsonl") == ["x", None]
    assert load_text_documents(pd.DataFrame({"text": ["a", "b"]})) == ["a", "b"]
    with pytest.raises(ValueError, match="no column 'text'"):
        load_text_documents(pd.DataFrame({"body": ["a"]}))
    with pytest.raises(ValueError, match=r"row 1: document is a NoneType"):
        CPTDataset(tmp_path / "d.jsonl", TOK, max_seq_len=16)
    ds = CPTDataset(["ok", "", None, "fine"], TOK, max_seq_len=16, on_bad_row="skip")
    assert ds.stats.skipped_by_reason == {"empty_text": 1, "non_string_content": 1}
    assert ds.row_indices == [0, 3]


def test_reasoning_gym_adapter_keeps_questions_unchanged():
    import reasoning_gym

    rows = reasoning_gym_sft_rows("chain_sum", size=5, seed=3, min_terms=2, max_terms=3)
    items = list(reasoning_gym.create_dataset("chain_sum", size=5, seed=3, min_terms=2,
                                              max_terms=3))
    assert [r["messages"] for r in rows] == [
        [{"role": "user", "content": it["question"]},
         {"role": "assistant", "content": it["answer"]}] for it in items]
    assert len(SFTDataset(rows, TOK, max_seq_len=128)) == 5


# ------------------------------------------------------------------------------------------
# CPT
# ------------------------------------------------------------------------------------------


def test_cpt_short_document_all_trained():
    s = CPTDataset(["hi"], TOK, max_seq_len=16)[0]
    assert s.input_ids.tolist() == [257, 104, 105, 258]
    assert s.labels.tolist() == [104, 105, 258, X]


def test_cpt_long_document_is_split_and_every_token_predicted_once():
    """17 tokens (bos + 15 bytes + eos), max_seq_len 8: chunks start at 0, 7, 14 and overlap
    by one token, so 7 + 7 + 2 = 16 predictions = every token after BOS, once."""
    text = "abcdefghijklmno"
    ds = CPTDataset([text, "z"], TOK, max_seq_len=8)
    assert [len(s) for s in ds] == [8, 8, 3, 3]
    assert (ds.stats.split_documents, ds.stats.samples, ds.stats.rows) == (1, 4, 2)
    full = TOK.encode(text, add_bos=True, add_eos=True)
    predicted = [label for s in list(ds)[:3] for label in s.labels.tolist() if label != X]
    assert predicted == full[1:]
    assert ds.stats.trained_tokens == 16 + 2


# ------------------------------------------------------------------------------------------
# Loader: determinism, epochs, exact resume
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ten_rows():
    return SFTDataset([chat("q" * (k + 1), "a" * (k % 3 + 1)) for k in range(10)], TOK,
                      max_seq_len=32)


def _same(a: Batch, b: Batch) -> bool:
    masks = (a.attention_mask is None and b.attention_mask is None) or (
        a.attention_mask is not None and b.attention_mask is not None
        and torch.equal(a.attention_mask, b.attention_mask))
    return (masks and a.num_samples == b.num_samples and torch.equal(a.input_ids, b.input_ids)
            and torch.equal(a.labels, b.labels) and torch.equal(a.position_ids, b.position_ids))


def test_epoch_order_is_seeded_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    assert epoch_order(10, seed=1, epoch=0) == epoch_order(10, seed=1, epoch=0)
    assert epoch_order(10, seed=1, epoch=0) != epoch_order(10, seed=1, epoch=1)
    assert epoch_order(10, seed=1, epoch=0) != epoch_order(10, seed=2, epoch=0)
    assert sorted(epoch_order(10, seed=1, epoch=5)) == list(range(10))
    assert epoch_order(4, seed=1, epoch=0, shuffle=False) == [0, 1, 2, 3]
    assert torch.equal(torch.get_rng_state(), state)


def test_loader_epochs_keep_last_partial_batch(ten_rows):
    loader = SFTLoader(ten_rows, batch_size=3, seed=0)
    assert loader.batches_per_epoch == 4
    sizes, seen = [], []
    for _ in range(4):
        assert loader.epoch == 0
        batch = loader.next_batch()
        sizes.append(batch.num_samples)
        seen += [tuple(r[r != TOK.pad_id].tolist()) for r in batch.input_ids]
    assert sizes == [3, 3, 3, 1]
    assert sorted(seen) == sorted(tuple(s.input_ids.tolist()) for s in ten_rows)
    assert (loader.epoch, loader.offset) == (1, 0)  # moved on as soon as epoch 0 finished
    assert loader.state_dict()["order"] == epoch_order(10, seed=0, epoch=1)


def test_loader_is_deterministic_regardless_of_global_rng(ten_rows):
    torch.manual_seed(1)
    a = SFTLoader(ten_rows, batch_size=4, seed=7)
    first = [a.next_batch() for _ in range(5)]
    torch.manual_seed(2)
    b = SFTLoader(ten_rows, batch_size=4, seed=7)
    assert all(_same(x, b.next_batch()) for x in first)
    assert not _same(first[0], SFTLoader(ten_rows, batch_size=4, seed=8).next_batch())


@pytest.mark.parametrize("pack", [False, True])
def test_loader_resume_matches_uninterrupted_across_epoch_boundaries(ten_rows, pack):
    kwargs = dict(batch_size=3, seed=5, pack=pack, seq_len=40 if pack else None)
    reference_loader = SFTLoader(ten_rows, **kwargs)
    reference = [reference_loader.next_batch() for _ in range(14)]
    per_epoch = SFTLoader(ten_rows, **kwargs).batches_per_epoch
    stops = sorted({1, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch})
    assert per_epoch in stops
    for stop in stops:
        first = SFTLoader(ten_rows, **kwargs)
        for _ in range(stop):
            first.next_batch()
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
        resumed = SFTLoader(ten_rows, **kwargs)
        resumed.load_state_dict(state)
        for k in range(stop, 14):
            assert _same(resumed.next_batch(), reference[k]), (stop, k)


def test_resume_state_saved_exactly_at_epoch_end_starts_next_epoch_fresh(ten_rows):
    """A state whose offset is the whole epoch (written by another tool, or an older loader)
    continues with epoch+1's fresh order."""
    loader = SFTLoader(ten_rows, batch_size=5, seed=3)
    state = {"epoch": 0, "offset": 10, "seed": 3, "shuffle": True,
             "order": epoch_order(10, seed=3, epoch=0)}
    loader.load_state_dict(state)
    assert (loader.epoch, loader.offset) == (1, 0)
    assert loader.state_dict()["order"] == epoch_order(10, seed=3, epoch=1)


def test_load_state_dict_rejects_mismatches(ten_rows):
    loader = SFTLoader(ten_rows, batch_size=2, seed=0)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        loader.load_state_dict({**state, "seed": 1})
    with pytest.raises(ValueError, match="permutation"):
        loader.load_state_dict({**state, "order": state["order"][:-1]})
    with pytest.raises(ValueError, match="offset"):
        loader.load_state_dict({**state, "offset": 11})


def test_loader_option_errors(ten_rows):
    with pytest.raises(ValueError, match="batch_size"):
        SFTLoader(ten_rows, batch_size=0)
    with pytest.raises(ValueError, match="only used with pack=True"):
        SFTLoader(ten_rows, batch_size=2, seq_len=64)
    with pytest.raises(ValueError, match="more than seq_len=8"):
        SFTLoader(ten_rows, batch_size=2, pack=True, seq_len=8)
    with pytest.raises(ValueError, match="pad_id"):
        SFTLoader(list(ten_rows), batch_size=2)


def test_packed_loader_batch_shapes(ten_rows):
    loader = SFTLoader(ten_rows, batch_size=2, pack=True, seq_len=40, shuffle=False)
    batch = loader.next_batch()
    assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (2, 40)
    assert batch.attention_mask.shape == (2, 40, 40)
    assert batch.num_samples == loader.offset


def test_doctests():
    for module in (data_module, data_sources):
        assert doctest.testmod(module).failed == 0


# ------------------------------------------------------------------------------------------
# One reader, one padding function, and the character cap
# ------------------------------------------------------------------------------------------


def test_a_file_that_is_not_utf8_names_file_line_and_byte_offset(tmp_path):
    good = json.dumps(chat("hi", "ok")).encode()
    (tmp_path / "latin1.jsonl").write_bytes(good + b"\n" + b'{"prompt": "caf\xe9"}\n')
    offset = len(good) + 1 + len('{"prompt": "caf')
    with pytest.raises(ValueError, match=rf"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at byte "
                                         rf"offset {offset}"):
        SFTDataset(tmp_path / "latin1.jsonl", TOK, max_seq_len=32)
    (tmp_path / "doc.txt").write_bytes(b"one\ntwo\nthr\xffee")
    with pytest.raises(ValueError, match=r"doc.txt:3: not UTF-8 text \(byte 0xff at byte offset 11"):
        load_text_documents(tmp_path / "doc.txt")


def test_right_pad_shapes_dtypes_and_values():
    ids_BT, mask_BT = right_pad([[5, 6, 7], torch.tensor([8])], pad_id=1)
    assert ids_BT.dtype == torch.int64 and mask_BT.dtype == torch.bool
    assert ids_BT.tolist() == [[5, 6, 7], [8, 1, 1]]
    assert mask_BT.tolist() == [[True] * 3, [True, False, False]]
    logps_BT, _ = right_pad([[-0.5], []], 0.0, dtype=torch.float32)
    assert logps_BT.dtype == torch.float32 and logps_BT.tolist() == [[-0.5], [0.0]]
    with pytest.raises(ValueError, match="at least one"):
        right_pad([], 0)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_huge_row_is_cut_before_tokenising_and_gives_the_short_rows_sample(overlong):
    from _waits import thread_cpu_s

    huge = "x" * 50_000_000
    rows = [chat("hi", "ok"), chat("hi", huge), chat("p" * 10_000_000, "ok")]
    short = [chat("hi", "ok"), chat("hi", "x" * 200), chat("p" * 200, "ok")]
    ds, cpu_s = thread_cpu_s(lambda: SFTDataset(rows, TOK, max_seq_len=64, overlong=overlong))
    assert cpu_s < 5   # CPU seconds; tokenising 50M bytes whole takes far longer
    ref = SFTDataset(short, TOK, max_seq_len=64, overlong=overlong)
    assert ds.stats.as_dict() == ref.stats.as_dict()
    assert ds.row_indices == ref.row_indices
    for a, b in zip(ds, ref, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_text_char_limit_keeps_the_kept_tokens_of_an_hf_tokenizer():
    """A byte-level BPE merges up to several characters per token (so max_seq_len characters
    would be too few); the cut at `text_char_limit` still gives the uncut row's sample."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from posttrain.models import HFTokenizer

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"] * 3
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([" ".join(words)] * 5, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = HFTokenizer(backend, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    limit = text_char_limit(tok, 48)
    text = " ".join(words * 400)
    assert len(text) > limit > 48 and len(tok.encode(text[:48])) < 48
    ds = SFTDataset([chat("hi", text)], tok, max_seq_len=48)
    full = tok.render_chat([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": text}])
    assert ds[0].input_ids.tolist() == list(full.input_ids[:48])
    assert ds[0].labels.tolist() == labels_from_loss_mask(full.input_ids[:48],
                                                          full.loss_mask[:48])
