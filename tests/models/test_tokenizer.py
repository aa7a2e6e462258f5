"""Tests for posttrain.models.tokenizer: byte and Hugging Face tokenizers, chat rendering, loss
masks.

The HF tokenizers are built here with the `tokenizers` library (a byte-level BPE trained on a few
sentences) and rendered chats are compared against `transformers`' `apply_chat_template`.
"""

from __future__ import annotations

import doctest
import json
import pickle

import pytest

from posttrain.models import (
    FALLBACK_CHAT_TEMPLATE,
    ByteTokenizer,
    HFTokenizer,
    RenderedChat,
    Tokenizer,
    load_tokenizer,
)
from posttrain.models import tokenizer as tokenizer_module

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four. ✓"},
    {"role": "user", "content": "héllo, thank you"},
    {"role": "assistant", "content": "Fine, 日本!"},
]
ASSISTANT_CONTENTS = ["It is four. ✓", "Fine, 日本!"]

# Qwen2-Instruct's template: ChatML, with a default system prompt when the chat has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Meta-Llama-3-Instruct's template: emits bos_token itself and trims contents.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# ChatML with transformers' `{% generation %}` markers, so transformers computes a mask too.
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
QWEN_CONFIG = {
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "chat_template": CHATML_TEMPLATE,
}
# bos_token in the older AddedToken-dict form that transformers also reads.
LLAMA3_CONFIG = {
    "bos_token": {
        "__type": "AddedToken",
        "content": "<|begin_of_text|>",
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    },
    "eos_token": "<|end_of_text|>",
    "chat_template": LLAMA3_TEMPLATE,
}


@pytest.fixture(scope="module")
def backend():
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [
        "Hello there, how are you?",
        "I am fine, thank you.",
        "What is two plus two?",
        "It is four.",
        "You are a helpful assistant.",
        "system user assistant",
    ]
    tok.train_from_iterator(corpus * 3, trainer)
    return tok


def write_folder(folder, backend, config):
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def reference_tokenizer(folder):
    """transformers' own tokenizer over the same files: the independent reference."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def trained_text(tok, chat: RenderedChat) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    runs, run = [], []
    for token_id, trained in zip(chat.input_ids, chat.loss_mask):
        if trained:
            run.append(token_id)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


# ---------------------------------------------------------------------------- byte tokenizer


def test_byte_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 日本 🙂 <|end|>"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)  # special strings in text stay bytes
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True, add_eos=True) == [257, *ids, 258]
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text


def test_byte_decode_specials_and_invalid_utf8():
    tok = ByteTokenizer()
    ids = [257, 0xE2, 0x9C, 262, 104, 105, 271]  # a truncated 3-byte char, then "hi"
    assert tok.decode(ids) == "\ufffdhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>\ufffd<|end|>hi<|reserved_271|>"
    with pytest.raises(ValueError, match="272"):
        tok.decode([272])


def test_byte_ids_and_stop_ids():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (272, 256, 257, 258)
    assert tok.stop_ids == frozenset({258, 262})
    names = [ByteTokenizer.token_name(i) for i in range(256, 264)]
    assert names == [
        "<|pad|>",
        "<|bos|>",
        "<|eos|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|end|>",
        "<|tool|>",
    ]
    assert isinstance(tok, Tokenizer)


def test_byte_loss_mask_pinned():
    """user "hi" -> assistant "ok":

    <|bos|> <|user|> h  i  <|end|> <|assistant|> o    k    <|end|>
    257     260      104 105 262    261           111  107  262
    F       F        F  F  F       F             T    T    T
    """
    tok = ByteTokenizer()
    chat = tok.render_chat(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    )
    assert chat.input_ids == [257, 260, 104, 105, 262, 261, 111, 107, 262]
    assert chat.loss_mask == [False, False, False, False, False, False, True, True, True]


def test_byte_chat_multi_turn_exactly_one_bos_and_prompt():
    tok = ByteTokenizer()
    chat = tok.render_chat(CHAT)
    assert chat.input_ids.count(tok.bos_id) == 1 and chat.input_ids[0] == tok.bos_id
    assert tok.eos_id not in chat.input_ids
    assert trained_text(tok, chat) == [c + "<|end|>" for c in ASSISTANT_CONTENTS]
    prompt = tok.render_prompt(CHAT[:4])
    assert prompt[-1] == 261
    # The prompt is a prefix of the full chat: generation continues exactly what training sees.
    assert chat.input_ids[: len(prompt)] == prompt
    with_prompt = tok.render_chat(CHAT, add_generation_prompt=True)
    assert with_prompt.input_ids == chat.input_ids + [261]
    assert with_prompt.loss_mask == chat.loss_mask + [False]


def test_byte_save_load_and_pickle(tmp_path):
    tok = ByteTokenizer()
    tok.save(tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "posttrain_tokenizer.json").read_text())["kind"] == "byte"
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded == tok and loaded.render_chat(CHAT) == tok.render_chat(CHAT)
    assert pickle.loads(pickle.dumps(tok)) == tok


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make", [ByteTokenizer, "hf"])
@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"role": "user", "content": "a"}, "hi"], r"messages\[1\] is a str"),
        (
            [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
            r"messages\[1\]\['role'\] is 'robot'; allowed roles: system, user, assistant, tool",
        ),
        ([{"role": "user"}], r"messages\[0\]\['content'\] is NoneType"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\]\['content'\] is list"),
        ([{"content": "a"}], r"messages\[0\]\['role'\] is None"),
        ([], "messages is empty"),
        ("hello", "must be a list"),
    ],
)
def test_bad_messages_name_the_index(make, messages, match, backend):
    tok = HFTokenizer(backend, QWEN_CONFIG) if make == "hf" else make()
    with pytest.raises(ValueError, match=match):
        tok.render_chat(messages)


def test_load_tokenizer_errors(tmp_path, backend):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "posttrain_tokenizer.json").write_text('{"kind": "wordpiece"}')
    with pytest.raises(ValueError, match="known kinds: 'byte'"):
        load_tokenizer(tmp_path / "odd")
    (tmp_path / "odd" / "posttrain_tokenizer.json").write_text('{"kind": "byte", "version": 99}')
    with pytest.raises(ValueError, match="version"):
        load_tokenizer(tmp_path / "odd")
    with pytest.raises(ValueError, match="no eos_token"):
        HFTokenizer(backend, {"bos_token": "<|begin_of_text|>"})
    with pytest.raises(ValueError, match="eos_token='</s>' is not in the vocabulary"):
        HFTokenizer(backend, {"eos_token": "</s>"})


# ---------------------------------------------------------------------------- HF tokenizer


def test_hf_special_ids(backend):
    qwen = HFTokenizer(backend, QWEN_CONFIG)
    ids = {t: backend.token_to_id(t) for t in SPECIALS}
    assert qwen.bos_id is None
    assert qwen.eos_id == qwen.pad_id == ids["<|endoftext|>"]
    assert qwen.stop_ids == {ids["<|endoftext|>"], ids["<|im_end|>"]}
    assert qwen.vocab_size == backend.get_vocab_size()
    llama = HFTokenizer(backend, LLAMA3_CONFIG)
    assert llama.bos_id == ids["<|begin_of_text|>"]
    assert llama.eos_id == llama.pad_id == ids["<|end_of_text|>"]
    assert llama.stop_ids == {ids["<|end_of_text|>"], ids["<|eot_id|>"]}
    assert isinstance(qwen, Tokenizer)


def test_hf_encode_decode(backend):
    tok = HFTokenizer(backend, LLAMA3_CONFIG)
    text = "héllo, how are you? ✓ 日本"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=True, add_eos=True) == [tok.bos_id, *ids, tok.eos_id]
    assert tok.decode(tok.encode(text, add_bos=True, add_eos=True)) == text
    qwen = HFTokenizer(backend, QWEN_CONFIG)
    assert qwen.encode(text, add_bos=True) == ids  # no BOS token: nothing added


@pytest.mark.parametrize("config", [QWEN_CONFIG, LLAMA3_CONFIG], ids=["chatml", "llama3"])
def test_hf_chat_matches_transformers(tmp_path, backend, config):
    folder = write_folder(tmp_path / "tok", backend, config)
    tok = load_tokenizer(folder)
    ref = reference_tokenizer(folder)
    for messages in (CHAT, CHAT[1:3], CHAT[1:4]):
        for gen in (False, True):
            text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            chat = tok.render_chat(messages, add_generation_prompt=gen)
            assert tok.decode(chat.input_ids, skip_special_tokens=False) == text
            assert chat.input_ids == ref(text, add_special_tokens=False)["input_ids"]
    assert (
        tok.render_prompt(CHAT[1:4])
        == tok.render_chat(CHAT[1:4], add_generation_prompt=True).input_ids
    )


@pytest.mark.parametrize(
    "config,end",
    [(QWEN_CONFIG, "<|im_end|>"), (LLAMA3_CONFIG, "<|eot_id|>")],
    ids=["chatml", "llama3"],
)
def test_hf_loss_mask_is_assistant_content_and_end_of_turn(backend, config, end):
    tok = HFTokenizer(backend, config)
    chat = tok.render_chat(CHAT)
    assert trained_text(tok, chat) == [c + end for c in ASSISTANT_CONTENTS]
    # Every trained run ends with the end-of-turn token, which is a stop id.
    ends = [
        t
        for t, m, n in zip(chat.input_ids, chat.loss_mask, chat.loss_mask[1:] + [False])
        if m and not n
    ]
    assert ends == [backend.token_to_id(end)] * 2 and set(ends) <= tok.stop_ids
    # The generation prompt is untrained, and a prompt is a prefix of the full chat.
    prompt = tok.render_chat(CHAT[:4], add_generation_prompt=True)
    assert not any(prompt.loss_mask[-3:])
    assert chat.input_ids[: len(prompt.input_ids)] == prompt.input_ids


def test_hf_llama3_trims_contents_and_masks_the_trimmed_text(backend):
    tok = HFTokenizer(backend, LLAMA3_CONFIG)
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "\n ok  "}]
    assert trained_text(tok, tok.render_chat(messages)) == ["ok<|eot_id|>"]


def test_hf_special_tokens_map_fills_missing_tokens(tmp_path, backend):
    folder = write_folder(tmp_path / "tok", backend, {"chat_template": LLAMA3_TEMPLATE})
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}})
    )
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.eos_id) == (
        backend.token_to_id("<|begin_of_text|>"),
        backend.token_to_id("<|end_of_text|>"),
    )


def test_hf_mask_matches_transformers_generation_blocks(tmp_path, backend):
    config = {"eos_token": "<|im_end|>", "chat_template": CHATML_GENERATION_TEMPLATE}
    folder = write_folder(tmp_path / "tok", backend, config)
    tok = load_tokenizer(folder)
    out = reference_tokenizer(folder).apply_chat_template(
        CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    chat = tok.render_chat(CHAT)
    assert chat.input_ids == out["input_ids"]
    assert chat.loss_mask == [bool(m) for m in out["assistant_masks"]]
    assert tok.stop_ids == {backend.token_to_id("<|im_end|>")}


def test_hf_exactly_one_bos(backend):
    ids = {t: backend.token_to_id(t) for t in SPECIALS}
    # Template emits bos_token itself: it is not duplicated.
    llama = HFTokenizer(backend, LLAMA3_CONFIG)
    # ChatML template that never emits it, on a model with a BOS: one is prepended, untrained.
    chatml_bos = HFTokenizer(backend, {**QWEN_CONFIG, "bos_token": "<|begin_of_text|>"})
    for tok in (llama, chatml_bos):
        for gen in (False, True):
            chat = tok.render_chat(CHAT, add_generation_prompt=gen)
            assert chat.input_ids[0] == ids["<|begin_of_text|>"] and not chat.loss_mask[0]
            assert chat.input_ids.count(ids["<|begin_of_text|>"]) == 1
    # No BOS token at all (Qwen2): none appears.
    qwen = HFTokenizer(backend, QWEN_CONFIG)
    assert ids["<|begin_of_text|>"] not in qwen.render_chat(CHAT).input_ids
    assert qwen.render_chat(CHAT).input_ids[0] == ids["<|im_start|>"]


def test_hf_without_chat_template_uses_fallback(backend):
    tok = HFTokenizer(backend, {"eos_token": "<|endoftext|>"})
    assert tok.chat_template is None
    chat = tok.render_chat(CHAT[1:3], add_generation_prompt=True)
    text = tok.decode(chat.input_ids, skip_special_tokens=False)
    assert text == (
        "<|user|>\nWhat is two plus two?<|endoftext|>"
        "<|assistant|>\nIt is four. ✓<|endoftext|><|assistant|>\n"
    )
    assert trained_text(tok, chat) == ["It is four. ✓<|endoftext|>"]
    assert tok.stop_ids == {tok.eos_id}
    assert "eos_token" in FALLBACK_CHAT_TEMPLATE


def test_hf_template_errors_become_value_errors(backend):
    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
    )
    tok = HFTokenizer(backend, {"eos_token": "<|endoftext|>", "chat_template": strict})
    with pytest.raises(ValueError, match="System role not supported"):
        tok.render_chat(CHAT)
    # Qwen's template injects a system prompt before the first message, so a chat cannot start
    # with an assistant turn whose prompt renders differently.
    rewriting = HFTokenizer(backend, QWEN_CONFIG)
    with pytest.raises(ValueError, match="assistant message 0"):
        rewriting.render_chat([{"role": "assistant", "content": "hi"}])


def test_hf_save_load_round_trip_and_pickle(tmp_path, backend):
    tok = HFTokenizer.from_folder(write_folder(tmp_path / "a", backend, LLAMA3_CONFIG))
    tok.save(tmp_path / "b")
    for other in (load_tokenizer(tmp_path / "b"), pickle.loads(pickle.dumps(tok))):
        assert isinstance(other, HFTokenizer)
        assert (other.vocab_size, other.bos_id, other.eos_id, other.pad_id, other.stop_ids) == (
            tok.vocab_size,
            tok.bos_id,
            tok.eos_id,
            tok.pad_id,
            tok.stop_ids,
        )
        assert other.render_chat(CHAT) == tok.render_chat(CHAT)
    # transformers reads the saved folder and renders the same text.
    ref = reference_tokenizer(tmp_path / "b")
    assert ref.apply_chat_template(CHAT, tokenize=False) == tok.decode(
        tok.render_chat(CHAT).input_ids, skip_special_tokens=False
    )
    # ... and AutoTokenizer, as a user would open a saved policy folder, gives the same ids.
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(tmp_path / "b")
    assert auto.apply_chat_template(CHAT, tokenize=False) == ref.apply_chat_template(
        CHAT, tokenize=False
    )
    for text in ("héllo, thank you", "Fine, 日本!"):
        assert auto.encode(text, add_special_tokens=False) == tok.encode(text)


def test_hf_chat_template_file_takes_precedence(tmp_path, backend):
    folder = write_folder(tmp_path / "tok", backend, QWEN_CONFIG)
    (folder / "chat_template.jinja").write_text(CHATML_GENERATION_TEMPLATE)
    tok = load_tokenizer(folder)
    assert tok.chat_template == CHATML_GENERATION_TEMPLATE
    assert "You are a helpful assistant." not in tok.decode(tok.render_chat(CHAT[1:3]).input_ids)


def test_docstring_examples():
    result = doctest.testmod(tokenizer_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
