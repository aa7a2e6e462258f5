"""Chat templates of the Qwen3 and Mistral families through `HFTokenizer`, against transformers'
`apply_chat_template` over the same tokenizer.json folder (a tiny BPE trained here, no hub).

The templates keep what the real ones (Qwen/Qwen3-0.6B, mistralai/Mistral-7B-Instruct-v0.3
tokenizer_config.json) do beyond plain ChatML / [INST]: Qwen3 wraps the last assistant turn after
the last user message in a `<think>` block (empty when the content has none) and strips the
thinking of earlier turns; Mistral checks that roles alternate (`raise_exception`), puts the
system message into the last user message, and closes each assistant turn with eos.

Shapes: none (token id lists).
"""

from __future__ import annotations

import json

import pytest

from posttrain.models import HFTokenizer, load_tokenizer

pytest.importorskip("transformers")

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last_query_index = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'system' or message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n')"
    ".split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n')"
    " + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{%- endif %}{%- endfor %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}"
    "{%- endif %}{%- endfor %}"
)
QWEN3_CONFIG = {
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "chat_template": QWEN3_TEMPLATE,
}
MISTRAL_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": MISTRAL_TEMPLATE}
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
]
SYSTEM = {"role": "system", "content": "Be brief."}
TURNS = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four. ✓"},
    {"role": "user", "content": "héllo, thank you"},
    {"role": "assistant", "content": "Fine, 日本!"},
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a tokenizer folder (tokenizer.json of a tiny byte-level BPE + its config)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["What is two plus two?", "It is four.", "Be brief.", "system user assistant"]
    backend.train_from_iterator(corpus * 3, trainer)
    out = {}
    for family, config in (("qwen3", QWEN3_CONFIG), ("mistral", MISTRAL_CONFIG)):
        folder = tmp_path_factory.mktemp(family)
        backend.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        out[family] = folder
    return out


def _reference(folder):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _trained_text(tok: HFTokenizer, input_ids: list[int], loss_mask: list[bool]) -> list[str]:
    """Decoded runs of consecutive trained tokens."""
    runs: list[list[int]] = []
    for i, (token_id, trained) in enumerate(zip(input_ids, loss_mask)):
        if trained:
            if i == 0 or not loss_mask[i - 1]:
                runs.append([])
            runs[-1].append(token_id)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def _assert_matches_transformers(folder, messages, gen: bool):
    tok, ref = load_tokenizer(folder), _reference(folder)
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    chat = tok.render_chat(messages, add_generation_prompt=gen)
    assert tok.decode(chat.input_ids, skip_special_tokens=False) == text
    assert chat.input_ids == ref(text, add_special_tokens=False)["input_ids"]
    return tok, chat


def test_qwen3_single_turn_trains_the_think_block_answer_and_end_of_turn(folders):
    """The last assistant turn after the last user message is written with an (empty) think
    block, as Qwen3 generates it; that block, the answer and <|im_end|> are trained."""
    messages = [SYSTEM, *TURNS[:2]]
    tok, chat = _assert_matches_transformers(folders["qwen3"], messages, gen=False)
    assert _trained_text(tok, chat.input_ids, chat.loss_mask) == [
        "<think>\n\n</think>\n\nIt is four. ✓<|im_end|>"
    ]
    _assert_matches_transformers(folders["qwen3"], messages[:2], gen=True)
    assert tok.encode("<|im_end|>") == [tok.eos_id] and tok.eos_id in tok.stop_ids


def test_qwen3_multi_turn_is_refused_since_the_template_rewrites_earlier_turns(folders):
    """An earlier assistant turn loses its think block once a user message follows: the mask of
    that turn cannot be located in the full chat, so the chat is refused with what to do."""
    tok, ref = load_tokenizer(folders["qwen3"]), _reference(folders["qwen3"])
    full = ref.apply_chat_template([SYSTEM, *TURNS], tokenize=False)
    alone = ref.apply_chat_template([SYSTEM, *TURNS[:2]], tokenize=False)
    assert "assistant\nIt is four." in full and "assistant\n<think>\n\n</think>\n\nIt" in alone
    with pytest.raises(ValueError, match="rewrites earlier turns.*its own sample"):
        tok.render_chat([SYSTEM, *TURNS])


def test_mistral_multi_turn_matches_transformers_and_trains_each_answer_with_eos(folders):
    tok, chat = _assert_matches_transformers(folders["mistral"], TURNS, gen=False)
    assert chat.input_ids[0] == tok.bos_id and chat.input_ids.count(tok.bos_id) == 1
    assert _trained_text(tok, chat.input_ids, chat.loss_mask) == [
        " It is four. ✓</s>",
        " Fine, 日本!</s>",
    ]
    assert (
        tok.render_prompt(TURNS[:3])
        == _reference(folders["mistral"])(
            _reference(folders["mistral"]).apply_chat_template(TURNS[:3], tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
    )


def test_mistral_template_errors_name_the_cause(folders):
    """Roles that do not alternate: the template's raise_exception, as a ValueError. A system
    message goes into the LAST user message only, so a chat that ends with the assistant's turn
    renders without it while its prompt has it: refused as a rewrite (the real v0.3 template
    drops the system message from such a chat), as a prompt it renders as transformers does."""
    tok, ref = load_tokenizer(folders["mistral"]), _reference(folders["mistral"])
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.render_chat([TURNS[0], TURNS[0]])
    assert "Be brief." not in ref.apply_chat_template([SYSTEM, *TURNS[:2]], tokenize=False)
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        tok.render_chat([SYSTEM, *TURNS[:2]])
    prompt = ref.apply_chat_template([SYSTEM, TURNS[0]], tokenize=False)
    assert "Be brief." in prompt
    assert (
        tok.render_prompt([SYSTEM, TURNS[0]]) == ref(prompt, add_special_tokens=False)["input_ids"]
    )
