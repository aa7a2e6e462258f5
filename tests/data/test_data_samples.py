"""Rows to samples (posttrain.data.sft): the labels and loss masks of chat and
prompt/completion rows pinned by hand, the EOS a sample ends with, bad rows named by index and
reason (or skipped and counted), over-long rows truncated or dropped and counted (a huge row is
cut before it is tokenised), continued-pretraining documents split so every token is predicted
once, and the sources rows come from (JSONL, DataFrames, text files, reasoning-gym) with a file
that is not UTF-8 named by line and byte. Ids: tests/_data_helpers.py."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from _data_helpers import TOK, X, chat

from posttrain.data import (
    BadRowError,
    CPTDataset,
    SFTDataset,
    collate_padded,
    labels_from_loss_mask,
    load_sft_rows,
    load_text_documents,
    pack_samples,
    reasoning_gym_sft_rows,
    text_char_limit,
)
from posttrain.models import RenderedChat


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
    assert ds.stats.as_dict() == {
        "rows": 1,
        "samples": 1,
        "skipped_by_reason": {},
        "truncated": 0,
        "dropped": 0,
        "split_documents": 0,
        "tokens": 9,
        "trained_tokens": 3,
        "skipped": 0,
    }


def test_sft_labels_pinned_multi_turn_trains_every_assistant_turn_only():
    row = {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "h"},
            {"role": "assistant", "content": "o"},
            {"role": "user", "content": "i"},
            {"role": "assistant", "content": "k"},
        ]
    }
    s = SFTDataset([row], TOK, max_seq_len=32)[0]
    # 257 259 's' 262 260 'h' 262 261 'o' 262 260 'i' 262 261 'k' 262
    assert s.input_ids.tolist() == [
        257,
        259,
        115,
        262,
        260,
        104,
        262,
        261,
        111,
        262,
        260,
        105,
        262,
        261,
        107,
        262,
    ]
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


# ------------------------------------------------------------------------------------------
# Bad rows, over-long rows
# ------------------------------------------------------------------------------------------


BAD_ROWS = {
    "not_a_dict": "just a string",
    "no_messages": {"text": "hi"},
    "bad_message": {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
    "non_string_content": {
        "messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]
    },
    "unknown_role": {
        "messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "x"}]
    },
    "empty_assistant": chat("hi", "  "),
    "no_assistant": {"messages": [{"role": "user", "content": "hi"}]},
    "last_not_assistant": {
        "messages": [*chat("hi", "ok")["messages"], {"role": "user", "content": "more"}]
    },
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
    rows = [
        chat("hi", "ok"),  # 10 tokens: fits in 12
        chat("hi", "a" * 10),  # 18 tokens: truncated to 12, 4 trained labels left
        chat("p" * 20, "ok"),
    ]  # prompt alone exceeds 12: nothing trained left
    ds = SFTDataset(rows, TOK, max_seq_len=12, overlong="truncate")
    assert (ds.stats.truncated, ds.stats.dropped, len(ds)) == (1, 1, 2)
    cut = ds[1]
    assert len(cut) == 12 and cut.labels.tolist() == [X] * 5 + [97] * 6 + [X]
    ds = SFTDataset(rows, TOK, max_seq_len=12, overlong="drop")
    assert (ds.stats.truncated, ds.stats.dropped, len(ds)) == (0, 2, 1)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_a_huge_row_is_cut_before_tokenising_and_gives_the_short_rows_sample(overlong):
    from _waits import thread_cpu_s

    huge = "x" * 50_000_000
    rows = [chat("hi", "ok"), chat("hi", huge), chat("p" * 10_000_000, "ok")]
    short = [chat("hi", "ok"), chat("hi", "x" * 200), chat("p" * 200, "ok")]
    ds, cpu_s = thread_cpu_s(lambda: SFTDataset(rows, TOK, max_seq_len=64, overlong=overlong))
    assert cpu_s < 5  # CPU seconds; tokenising 50M bytes whole takes far longer
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
    backend.train_from_iterator(
        [" ".join(words)] * 5,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = HFTokenizer(backend, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    limit = text_char_limit(tok, 48)
    text = " ".join(words * 400)
    assert len(text) > limit > 48 and len(tok.encode(text[:48])) < 48
    ds = SFTDataset([chat("hi", text)], tok, max_seq_len=48)
    full = tok.render_chat(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]
    )
    assert ds[0].input_ids.tolist() == list(full.input_ids[:48])
    assert ds[0].labels.tolist() == labels_from_loss_mask(full.input_ids[:48], full.loss_mask[:48])


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
    items = list(
        reasoning_gym.create_dataset("chain_sum", size=5, seed=3, min_terms=2, max_terms=3)
    )
    assert [r["messages"] for r in rows] == [
        [
            {"role": "user", "content": it["question"]},
            {"role": "assistant", "content": it["answer"]},
        ]
        for it in items
    ]
    assert len(SFTDataset(rows, TOK, max_seq_len=128)) == 5


def test_a_file_that_is_not_utf8_names_file_line_and_byte_offset(tmp_path):
    good = json.dumps(chat("hi", "ok")).encode()
    (tmp_path / "latin1.jsonl").write_bytes(good + b"\n" + b'{"prompt": "caf\xe9"}\n')
    offset = len(good) + 1 + len('{"prompt": "caf')
    with pytest.raises(
        ValueError,
        match=rf"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at byte "
        rf"offset {offset}",
    ):
        SFTDataset(tmp_path / "latin1.jsonl", TOK, max_seq_len=32)
    (tmp_path / "doc.txt").write_bytes(b"one\ntwo\nthr\xffee")
    with pytest.raises(
        ValueError, match=r"doc.txt:3: not UTF-8 text \(byte 0xff at byte offset 11"
    ):
        load_text_documents(tmp_path / "doc.txt")


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
