"""`ByteTokenizer` as transformers reads it: `tokenizer.json` + `tokenizer_config.json`.

A policy folder of a tiny preset holds these two files next to `posttrain_tokenizer.json`, so
`transformers.AutoTokenizer.from_pretrained(folder)` returns a fast tokenizer with the same ids as
`ByteTokenizer` (instead of an empty one):

- text -> utf-8 bytes: a byte-level BPE with the 256 byte symbols as its whole vocabulary (id =
  byte value) and no merges, and no pre-tokenizer split (`use_regex=False`, no prefix space), so
  every byte of the text is one token and decoding restores the text;
- ids 256..271 are the special tokens (`ByteTokenizer.token_name`), bos/eos/pad set;
- `chat_template` renders `ByteTokenizer.render_chat`'s format, so
  `apply_chat_template(messages, add_generation_prompt=...)` gives the same ids.

One difference: transformers matches special-token text in its input ("<|end|>" -> 262), while
`ByteTokenizer.encode` never does (7 bytes). Text that holds such strings encodes differently.

Example:
    >>> import json, tempfile
    >>> from pathlib import Path
    >>> from posttrain.models.tokenizer import ByteTokenizer
    >>> with tempfile.TemporaryDirectory() as d:
    ...     write_hf_files(ByteTokenizer(), Path(d))
    ...     json.loads((Path(d) / "tokenizer_config.json").read_text())["eos_token"]
    '<|eos|>'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Protocol


class _ByteVocab(Protocol):
    """What is read of a `ByteTokenizer` (structural, so this module needs no import of it)."""

    VOCAB_SIZE: ClassVar[int]
    BOS: ClassVar[int]
    EOS: ClassVar[int]
    PAD: ClassVar[int]

    def token_name(self, token_id: int) -> str: ...


__all__ = ["CHAT_TEMPLATE", "byte_symbols", "write_hf_files"]

CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Jinja template of `ByteTokenizer.render_chat`: `<|bos|>`, `<|role|>` content `<|end|>` per
message, then `<|assistant|>` with `add_generation_prompt`."""


def byte_symbols() -> list[str]:
    """The printable character that byte-level BPE (GPT-2's table, `tokenizers`' ByteLevel)
    writes for each byte value 0..255; entry b is byte b's symbol."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    table, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_hf_files(tok: _ByteVocab, folder: Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for `tok` into existing `folder`."""
    special = [
        {
            "id": i,
            "content": tok.token_name(i),
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in range(256, tok.VOCAB_SIZE)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    spec: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {s: b for b, s in enumerate(byte_symbols())},
            "merges": [],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.token_name(tok.BOS),
        "eos_token": tok.token_name(tok.EOS),
        "pad_token": tok.token_name(tok.PAD),
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1_000_000_000,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
