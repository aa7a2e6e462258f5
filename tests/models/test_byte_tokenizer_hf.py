"""Tests for posttrain.models.byte_tokenizer_hf: a saved `ByteTokenizer` folder opened with
transformers' `AutoTokenizer` gives the byte tokenizer's ids, special tokens and chat format.

Expected ids are the utf-8 bytes of the text (Python's `str.encode`) and the special ids listed in
`ByteTokenizer`'s docstring, not the tokenizer's own output.
"""

from __future__ import annotations

import doctest

import pytest

from posttrain.models import ByteTokenizer, byte_tokenizer_hf, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["hi", "héllo wörld  \n\t x", " leading and trailing ", "日本語 🙂 ✓", "", "a\x00b\x7f"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("byte_tok")
    ByteTokenizer().save(path)
    return path


@pytest.fixture(scope="module")
def auto(folder):
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_byte_symbols_are_a_bijection_of_printable_characters():
    symbols = byte_tokenizer_hf.byte_symbols()
    assert len(set(symbols)) == 256 and all(s.isprintable() and len(s) == 1 for s in symbols)
    assert symbols[ord("a")] == "a" and symbols[ord(" ")] == "Ġ"  # GPT-2's table


@pytest.mark.parametrize("text", TEXTS)
def test_auto_tokenizer_ids_are_the_utf8_bytes(auto, text):
    ids = auto.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert auto.decode(ids) == text


def test_auto_tokenizer_special_tokens(auto):
    assert len(auto) == 272
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (257, 258, 256)
    names = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|reserved_264|>"]
    assert auto.convert_tokens_to_ids(names) == [259, 260, 261, 262, 263, 264]
    assert auto.decode([257, 104, 105, 258], skip_special_tokens=True) == "hi"
    assert auto.decode([257, 104, 105, 258]) == "<|bos|>hi<|eos|>"


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_auto_tokenizer_chat_template(auto, generation_prompt):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4 ✓"},
    ]
    end = [262]
    expected = [257, 259, *b"Be brief.", *end, 260, *b"2+2?", *end, 261]
    expected += [*"4 ✓".encode(), *end] + ([261] if generation_prompt else [])
    got = auto.apply_chat_template(chat, add_generation_prompt=generation_prompt, return_dict=True)
    assert list(got["input_ids"]) == expected
    assert ByteTokenizer().render_chat(chat, add_generation_prompt=generation_prompt).input_ids == (
        expected
    )


def test_folder_still_loads_as_byte_tokenizer(folder):
    assert sorted(p.name for p in folder.iterdir()) == [
        "posttrain_tokenizer.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert isinstance(load_tokenizer(folder), ByteTokenizer)


def test_docstring_examples():
    assert doctest.testmod(byte_tokenizer_hf).failed == 0
