"""Tokenizers: text <-> token ids, and chat messages -> token ids + a loss mask.

Two implementations satisfy the `Tokenizer` protocol:

- `ByteTokenizer`: ids 0..255 are the utf-8 bytes, 256.. are special tokens (272 ids in all, the
  vocabulary of the tiny model presets). Needs no files.
- `HFTokenizer`: a Hugging Face `tokenizer.json` + `tokenizer_config.json` folder; chats are
  rendered with the folder's jinja chat template, the way `transformers` renders them.

`render_chat` is what SFT, DPO and RL use: `loss_mask[t]` is True for the tokens the model is
trained to produce (assistant content and the token that ends the assistant turn) and False for
everything else (BOS, role headers, system/user/tool content, the assistant header).

The shared pieces (`ROLES`, `RenderedChat`, the message checks) are in `posttrain.models.chat`;
`HFTokenizer` and its chat-template compilation are in `posttrain.models.hf_tokenizer`.

Example:
    >>> from posttrain.models.tokenizer import ByteTokenizer, load_tokenizer
    >>> tok = ByteTokenizer()
    >>> chat = tok.render_chat([{"role": "user", "content": "2+2?"},
    ...                         {"role": "assistant", "content": "4"}])
    >>> [tok.decode([i], skip_special_tokens=False) for i in chat.input_ids]
    ['<|bos|>', '<|user|>', '2', '+', '2', '?', '<|end|>', '<|assistant|>', '4', '<|end|>']
    >>> chat.loss_mask
    [False, False, False, False, False, False, False, False, True, True]
    >>> tok.decode(tok.encode("héllo", add_bos=True))
    'héllo'
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

from posttrain.models.chat import RenderedChat, _check_messages, _ids
from posttrain.models.hf_tokenizer import HF_TOKENIZER_FILE, HFTokenizer

BYTE_TOKENIZER_FILE = "posttrain_tokenizer.json"


@runtime_checkable
class Tokenizer(Protocol):
    """What `Policy`, the data pipeline and the recipes need from a tokenizer.

    `bos_id` is None for models without a BOS token (Qwen2); then no BOS is ever added and
    "exactly one BOS" in `render_chat` means "none". `pad_id` may equal `eos_id`: padding is
    masked by position, never by id. `stop_ids` holds EOS and the end-of-turn id(s).
    """

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def stop_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def render_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = False
    ) -> RenderedChat: ...

    def render_prompt(self, messages: list[dict]) -> list[int]: ...

    def save(self, folder: str | os.PathLike) -> None: ...


# --------------------------------------------------------------------------------------------
# Byte tokenizer
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ByteTokenizer:
    """utf-8 bytes plus special tokens; for tiny models and tests. Needs no files.

    Ids: 0..255 are byte values; 256 `<|pad|>`, 257 `<|bos|>`, 258 `<|eos|>`, 259 `<|system|>`,
    260 `<|user|>`, 261 `<|assistant|>`, 262 `<|end|>` (end of turn), 263 `<|tool|>`; 264..271
    are reserved (`<|reserved_N|>`). `vocab_size` is 272.

    Chat format: `<|bos|>`, then per message `<|role|>` + utf-8 content + `<|end|>`; with
    `add_generation_prompt`, a final `<|assistant|>`. Nothing follows the last message; EOS is
    added only by `encode(..., add_eos=True)`. `stop_ids` = {`<|eos|>`, `<|end|>`}.

    `encode` never produces special ids from text: the string "<|end|>" is 7 bytes.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hi", add_bos=True, add_eos=True)
        [257, 104, 105, 258]
        >>> tok.render_prompt([{"role": "user", "content": "hi"}])
        [257, 260, 104, 105, 262, 261]
    """

    PAD: ClassVar[int] = 256
    BOS: ClassVar[int] = 257
    EOS: ClassVar[int] = 258
    END: ClassVar[int] = 262
    ROLE_IDS: ClassVar[dict[str, int]] = {"system": 259, "user": 260, "assistant": 261, "tool": 263}
    VOCAB_SIZE: ClassVar[int] = 272
    FORMAT_VERSION: ClassVar[int] = 1

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.EOS, self.END})

    @classmethod
    def token_name(cls, token_id: int) -> str:
        """Text of a special id, e.g. 262 -> '<|end|>'. Raises ValueError for a byte id."""
        names = {
            cls.PAD: "pad",
            cls.BOS: "bos",
            cls.EOS: "eos",
            cls.END: "end",
            **{v: k for k, v in cls.ROLE_IDS.items()},
        }
        if not 256 <= token_id < cls.VOCAB_SIZE:
            raise ValueError(f"{token_id} is not a special id (256..{cls.VOCAB_SIZE - 1})")
        return f"<|{names.get(token_id, f'reserved_{token_id}')}|>"

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """utf-8 bytes of `text`, optionally with BOS first and EOS last."""
        ids = list(text.encode("utf-8"))
        return ([self.BOS] if add_bos else []) + ids + ([self.EOS] if add_eos else [])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; byte runs that are not valid utf-8 decode to U+FFFD.

        Special ids are dropped, or written as their names with `skip_special_tokens=False`.

        Raises:
            ValueError: for an id outside 0..vocab_size-1.
        """
        parts: list[str] = []
        run = bytearray()
        for i in _ids(ids):
            if 0 <= i < 256:
                run.append(i)
                continue
            if not 256 <= i < self.VOCAB_SIZE:
                raise ValueError(
                    f"token id {i} is outside the byte tokenizer's vocabulary "
                    f"0..{self.VOCAB_SIZE - 1}"
                )
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens:
                parts.append(self.token_name(i))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def render_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = False
    ) -> RenderedChat:
        """Token ids and loss mask of a conversation (format in the class docstring).

        Raises:
            ValueError: naming the index of a malformed message and the allowed roles.
        """
        ids, mask = [self.BOS], [False]
        for m in _check_messages(messages):
            body = list(m["content"].encode("utf-8")) + [self.END]
            ids.append(self.ROLE_IDS[m["role"]])
            mask.append(False)
            ids.extend(body)
            mask.extend([m["role"] == "assistant"] * len(body))
        if add_generation_prompt:
            ids.append(self.ROLE_IDS["assistant"])
            mask.append(False)
        return RenderedChat(ids, mask)

    def render_prompt(self, messages: list[dict]) -> list[int]:
        """`render_chat(messages, add_generation_prompt=True).input_ids`."""
        return self.render_chat(messages, add_generation_prompt=True).input_ids

    def save(self, folder: str | os.PathLike) -> None:
        """Write `posttrain_tokenizer.json` (kind + format version) into `folder`, and the same
        tokenizer as `tokenizer.json` + `tokenizer_config.json` for transformers (see
        `posttrain.models.byte_tokenizer_hf`): `AutoTokenizer.from_pretrained(folder)` gives the
        same ids, special tokens and chat template. `load_tokenizer` reads the first file."""
        from posttrain.models.byte_tokenizer_hf import write_hf_files

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        record = {"kind": "byte", "version": self.FORMAT_VERSION, "vocab_size": self.VOCAB_SIZE}
        (path / BYTE_TOKENIZER_FILE).write_text(json.dumps(record, indent=2) + "\n")
        write_hf_files(self, path)


def load_tokenizer(folder: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """The tokenizer saved in `folder`: `posttrain_tokenizer.json` -> `ByteTokenizer` (checked
    first: a byte tokenizer's folder also holds a `tokenizer.json` for transformers),
    `tokenizer.json` -> `HFTokenizer`.

    Raises:
        FileNotFoundError: if `folder` does not exist or holds neither file.
        ValueError: if `posttrain_tokenizer.json` names an unknown kind or format version.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     ByteTokenizer().save(d)
        ...     load_tokenizer(d)
        ByteTokenizer()
    """
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {path} does not exist")
    if (path / BYTE_TOKENIZER_FILE).is_file():
        record = json.loads((path / BYTE_TOKENIZER_FILE).read_text(encoding="utf-8"))
        if record.get("kind") != "byte":
            raise ValueError(
                f"{path / BYTE_TOKENIZER_FILE} has kind={record.get('kind')!r}; known kinds: 'byte'"
            )
        if record.get("version") != ByteTokenizer.FORMAT_VERSION:
            raise ValueError(
                f"{path / BYTE_TOKENIZER_FILE} has version={record.get('version')!r};"
                f" this posttrain reads version {ByteTokenizer.FORMAT_VERSION}"
            )
        return ByteTokenizer()
    if (path / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer.from_folder(path)
    hint = (
        " (tokenizer.model is a sentencepiece file; convert it to tokenizer.json with "
        "transformers' save_pretrained)"
        if (path / "tokenizer.model").is_file()
        else ""
    )
    raise FileNotFoundError(
        f"{path} has neither {BYTE_TOKENIZER_FILE} (byte tokenizer) nor "
        f"{HF_TOKENIZER_FILE} (Hugging Face tokenizer){hint}"
    )
