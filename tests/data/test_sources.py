"""Own data from every source (files, DataFrames, HF datasets, lists) into records, and the row
format detected from their columns: each source and format pinned by a tiny input built here."""

from __future__ import annotations

import json

import datasets
import pandas as pd
import pytest

from posttrain.data.sources import (
    CPT_FORMATS,
    FORMATS,
    PREFERENCE_FORMATS,
    PROMPT_FORMATS,
    SFT_FORMATS,
    detect_format,
    load_prompt_records,
    load_records,
    read_records,
)

ROWS = [
    {"prompt": "1+1=", "completion": "2", "answer": "2"},
    {"prompt": "2+2=", "completion": "4"},  # no answer cell: left out of its record
]


def Dataset(rows):  # noqa: N802  (the library's own class, built from rows)
    return datasets.Dataset.from_list(rows)


def DatasetDict(**splits):  # noqa: N802
    return datasets.DatasetDict(splits)


def _write(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".parquet":
        pd.DataFrame(ROWS).to_parquet(path)
    else:
        pd.DataFrame(ROWS).to_csv(path, index=False)
    return path


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: _write(tmp, ".jsonl"),
        lambda tmp: str(_write(tmp, ".json")),
        lambda tmp: _write(tmp, ".parquet"),
        lambda tmp: _write(tmp, ".csv"),
        lambda tmp: pd.DataFrame(ROWS),
        lambda tmp: list(ROWS),
        lambda tmp: Dataset(ROWS),
    ],
    ids=["jsonl", "json", "parquet", "csv", "DataFrame", "list", "hf-Dataset"],
)
def test_every_source_gives_the_same_records(make, tmp_path):
    records, fmt = load_records(make(tmp_path), accepted=SFT_FORMATS)
    assert records == ROWS
    assert fmt == "prompt_completion"


def test_a_dataset_dict_is_read_by_its_named_split():
    splits = DatasetDict(train=Dataset(ROWS[:1]), test=Dataset(ROWS[1:]))
    assert read_records(splits, split="test") == ROWS[1:]
    assert read_records(DatasetDict(train=Dataset(ROWS))) == ROWS  # its only split
    with pytest.raises(ValueError, match=r"split=None: the DatasetDict has splits \['test', "):
        read_records(splits)
    with pytest.raises(ValueError, match=r"split='dev'.*\['test', 'train'\]"):
        read_records(splits, split="dev")


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(
    "row, fmt",
    [
        ({"messages": CHAT}, "chat"),
        ({"prompt": "p", "completion": "c"}, "prompt_completion"),
        ({"text": "a document", "source": "web"}, "text"),
        ({"prompt": "p", "chosen": "good", "rejected": "bad"}, "preference"),
        (  # TRL's conversational preference rows
            {
                "prompt": CHAT[:1],
                "chosen": [{"role": "assistant", "content": "good"}],
                "rejected": [{"role": "assistant", "content": "bad"}],
            },
            "preference",
        ),
        ({"prompt": "2+3=", "answer": "5", "level": 1}, "prompt"),
    ],
)
def test_each_row_format_is_detected_and_survives_parquet(row, fmt, tmp_path):
    assert detect_format([row]) == fmt
    path = tmp_path / "rows.parquet"
    pd.DataFrame([row]).to_parquet(path)  # message lists come back as plain lists of dicts
    assert load_records(path) == ([row], fmt)


def test_prompt_records_keep_their_answer_columns(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("prompt,answer,level\n2+3=,5,1\n7-2=,5,\n")
    assert load_prompt_records(path) == [
        {"prompt": "2+3=", "answer": "5", "level": "1"},
        {"prompt": "7-2=", "answer": "5"},
    ]
    assert load_prompt_records([{"prompt": "1+1=", "completion": "2"}]) == [
        {"prompt": "1+1=", "completion": "2", "answer": "2"}
    ]
    with pytest.raises(ValueError, match=r"row 0: 'prompt' must be a non-empty str"):
        load_prompt_records([{"prompt": " ", "answer": "1"}])


@pytest.mark.parametrize(
    "rows, accepted, message",
    [
        (
            [{"messages": CHAT, "text": "t"}],
            tuple(FORMATS),
            r"ambiguous row format: the rows have columns \['messages', 'text'\], which match "
            r"chat, text",
        ),
        (
            [{"question": "q", "reply": "r"}],
            SFT_FORMATS,
            r"cannot tell the row format: the rows have columns \['question', 'reply'\]; "
            r"accepted formats: chat \(columns messages\), prompt_completion \(columns prompt, "
            r"completion\)",
        ),
        (
            [{"prompt": "p", "chosen": "a", "rejected": "b"}],
            SFT_FORMATS,
            r"preference rows, not accepted here; accepted formats: chat",
        ),
        ([{"messages": CHAT}], CPT_FORMATS, r"chat rows, not accepted here.*text \(columns text"),
        ([{"prompt": "p"}], PREFERENCE_FORMATS, r"prompt rows, not accepted.*chosen, rejected"),
        ([{"text": "t"}], PROMPT_FORMATS, r"text rows, not accepted.*prompt \(columns prompt\)"),
        ([], SFT_FORMATS, r"no rows to read; accepted formats: chat"),
    ],
)
def test_rows_of_no_accepted_format_name_their_columns_and_the_formats(rows, accepted, message):
    with pytest.raises(ValueError, match=message):
        load_records(rows, accepted=accepted)


def test_a_source_of_another_kind_is_refused_naming_what_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"'rows.xlsx': a data file must end in one of \.jsonl"):
        read_records("rows.xlsx")
    with pytest.raises(FileNotFoundError, match="data file .*missing.parquet does not exist"):
        read_records(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match="cannot read records from a int; pass a .jsonl"):
        read_records(3)
