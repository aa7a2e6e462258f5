"""Tokenizers: text <-> token ids, and chat messages -> token ids + a loss mask.

Two implementations satisfy the `Tokenizer` protocol:

- `ByteTokenizer`: ids 0..255 are the utf-8 bytes, 256.. are special tokens (272 ids in all, the
  vocabulary of the tiny model presets). Needs no files.
- `HFTokenizer`: a Hugging Face `tokenizer.json` + `tokenizer_config.json` folder; chats are
  rendered with the folder's jinja chat template, the way `transformers` renders them.

`render_chat` is what SFT, DPO and RL use: `loss_mask[t]` is True for the tokens the model is
trained to produce (assistant content and the token that ends the assistant turn) and False for
everything else (BOS, role headers, system/user/tool content, the assistant header).

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

import functools
import json
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import tokenizers

ROLES = ("system", "user", "assistant", "tool")
"""Roles `render_chat` accepts."""

BYTE_TOKENIZER_FILE = "posttrain_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_CHAT_TEMPLATE_FILE = "chat_template.jinja"
HF_SPECIAL_TOKENS_FILE = "special_tokens_map.json"

# Special tokens that end a turn in common chat formats (ChatML/Qwen, Llama 3 incl. tool calls,
# Gemma, Phi-3). When one is a special token of the vocabulary and its text appears in the chat
# template, it is a stop id.
_KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

# The named special tokens transformers passes to a chat template (`special_tokens_map`).
_TEMPLATE_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")

# Used by `HFTokenizer` when the folder has no chat template: the byte tokenizer's role markers,
# as plain text, with EOS closing every turn (so EOS is the only stop id).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class RenderedChat:
    """Token ids of a rendered conversation and which of them are trained.

    Attributes:
        input_ids: token ids, length T.
        loss_mask: length T; True where the token is assistant content or the end of an
            assistant turn (trained), False elsewhere.

    Raises:
        ValueError: if the two lists differ in length.
    """

    input_ids: list[int]
    loss_mask: list[bool]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"RenderedChat: {len(self.input_ids)} input_ids but "
                             f"{len(self.loss_mask)} loss_mask entries; they must match")


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

    def render_chat(self, messages: list[dict], *,
                    add_generation_prompt: bool = False) -> RenderedChat: ...

    def render_prompt(self, messages: list[dict]) -> list[int]: ...

    def save(self, folder: str | os.PathLike) -> None: ...


def _check_messages(messages: Any) -> list[dict]:
    """Raise ValueError, naming the message index, unless `messages` is a non-empty chat."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; render_chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] is a {type(m).__name__}; each message must be a dict "
                             f"with string 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {role!r}; allowed roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] is {type(content).__name__}; "
                             f"it must be a string")
    return list(messages)


def _ids(ids: Sequence[int]) -> list[int]:
    # Accepts Python/numpy ints and 0-d integer tensors; a float raises TypeError.
    return [operator.index(i) for i in ids]


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
        names = {cls.PAD: "pad", cls.BOS: "bos", cls.EOS: "eos", cls.END: "end",
                 **{v: k for k, v in cls.ROLE_IDS.items()}}
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
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary "
                                 f"0..{self.VOCAB_SIZE - 1}")
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens:
                parts.append(self.token_name(i))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def render_chat(self, messages: list[dict], *,
                    add_generation_prompt: bool = False) -> RenderedChat:
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
        """Write `posttrain_tokenizer.json` (kind + format version) into `folder`."""
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        record = {"kind": "byte", "version": self.FORMAT_VERSION, "vocab_size": self.VOCAB_SIZE}
        (path / BYTE_TOKENIZER_FILE).write_text(json.dumps(record, indent=2) + "\n")


# --------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json + chat template
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _compile_chat_template(source: str):
    """Compile a chat template in the jinja environment transformers uses.

    Mirrors `transformers.utils.chat_template_utils._cached_compile_jinja_template`: a sandboxed
    environment with trim_blocks/lstrip_blocks, loop controls, a non-escaping `tojson`, and the
    `raise_exception` / `strftime_now` helpers; `{% generation %}` blocks render their body.
    """
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, {"content": ...} or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token {value!r} is neither a string nor a dict with 'content'")


class HFTokenizer:
    """A Hugging Face fast tokenizer (`tokenizer.json`) with its chat template.

    Args:
        backend: a `tokenizers.Tokenizer`.
        config: the contents of `tokenizer_config.json`; read are `bos_token`, `eos_token`,
            `pad_token` (strings or {"content": ...} dicts, or null) and `chat_template` (a
            string, or a list of {"name", "template"} from which "default" is used).

    Special ids: `eos_token` is required. Without `bos_token` (Qwen2) `bos_id` is None and no
    BOS is ever added. Without `pad_token`, `pad_id` is `eos_id`. `stop_ids` holds EOS, the
    special token that closes an assistant turn in the template (found by rendering a probe
    chat) and any of <|im_end|>, <|eot_id|>, <|eom_id|>, <end_of_turn>, <|end|> that is a
    special token and appears in the template. `vocab_size` counts the tokenizer's ids incl.
    added tokens; a model's embedding may be larger (padded).

    `encode` uses no post-processor (BOS/EOS only on request) and, like transformers, turns the
    text of added tokens into their ids.

    Chats: the template is rendered as `transformers`' `apply_chat_template(tokenize=False)`
    does; the whole text is tokenized once; a token is trained if its character span overlaps
    an assistant span: from the end of the assistant header (the text of `messages[:i]` with
    the generation prompt) to the end of message i (the text of `messages[:i+1]`), without
    trailing whitespace (the newline after <|im_end|> is not trained). A template that rewrites
    earlier turns when later ones follow (e.g. drops past reasoning) cannot be masked this way
    and raises ValueError. Exactly one BOS starts the ids when the model has one, whether or
    not the template emits it. Without a chat template, `FALLBACK_CHAT_TEMPLATE` is used:
    the byte tokenizer's role markers as plain text, `<|role|>\\n` + content + EOS per message.

    Example (a tokenizer.json folder; transformers' `save_pretrained` writes one):
        tok = HFTokenizer.from_folder("checkpoints/qwen2.5-0.5b-instruct")
        chat = tok.render_chat([{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"}])
        tok.decode([i for i, m in zip(chat.input_ids, chat.loss_mask) if m],
                   skip_special_tokens=False)   # 'hello<|im_end|>'
    """

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any]) -> None:
        self._backend = backend
        self._config = dict(config)
        template = self._config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            if "default" not in named:
                raise ValueError(f"chat_template lists templates {sorted(map(str, named))} but "
                                 f"none named 'default'")
            template = named["default"]
        if template is not None and not isinstance(template, str):
            raise ValueError(f"chat_template must be a string, got {type(template).__name__}")
        self.chat_template: str | None = template
        self._template_tokens = {k: t for k in _TEMPLATE_TOKEN_KEYS
                                 if (t := _token_text(self._config.get(k))) is not None}

        eos = self._template_tokens.get("eos_token")
        if eos is None:
            raise ValueError("tokenizer_config has no eos_token; it is needed to end generation")
        self._eos_id = self._resolve(eos, "eos_token")
        bos = self._template_tokens.get("bos_token")
        self._bos_id = None if bos is None else self._resolve(bos, "bos_token")
        pad = self._template_tokens.get("pad_token")
        self._pad_id = self._eos_id if pad is None else self._resolve(pad, "pad_token")
        self._stop_ids = self._find_stop_ids()

    def _resolve(self, token: str, key: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config {key}={token!r} is not in the vocabulary of "
                             f"tokenizer.json")
        return token_id

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> HFTokenizer:
        """Load `tokenizer.json` and, when present, `tokenizer_config.json`,
        `special_tokens_map.json` (older checkpoints; fills special tokens the config lacks) and
        `chat_template.jinja` (takes precedence over the config's `chat_template`, as in
        transformers).

        Raises:
            FileNotFoundError: if `tokenizer.json` is missing.
            ValueError: if the special tokens cannot be resolved.
        """
        from tokenizers import Tokenizer as Backend

        path = Path(folder)
        if not (path / HF_TOKENIZER_FILE).is_file():
            raise FileNotFoundError(f"{path / HF_TOKENIZER_FILE} not found")
        config: dict[str, Any] = {}
        if (path / HF_CONFIG_FILE).is_file():
            config = json.loads((path / HF_CONFIG_FILE).read_text(encoding="utf-8"))
        if (path / HF_SPECIAL_TOKENS_FILE).is_file():
            legacy = json.loads((path / HF_SPECIAL_TOKENS_FILE).read_text(encoding="utf-8"))
            config.update({k: v for k, v in legacy.items()
                           if k in _TEMPLATE_TOKEN_KEYS and config.get(k) is None})
        if (path / HF_CHAT_TEMPLATE_FILE).is_file():
            config["chat_template"] = (path / HF_CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        return cls(Backend.from_file(str(path / HF_TOKENIZER_FILE)), config)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`; BOS (if the model has one) and EOS only when asked."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        bos = [self._bos_id] if add_bos and self._bos_id is not None else []
        return bos + ids + ([self._eos_id] if add_eos else [])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (the tokenizer.json decoder)."""
        return self._backend.decode(_ids(ids), skip_special_tokens=skip_special_tokens)

    def _render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        import jinja2

        template = _compile_chat_template(self.chat_template or FALLBACK_CHAT_TEMPLATE)
        try:
            return template.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **self._template_tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template could not render {len(messages)} message(s): "
                             f"{e}") from e

    def _assistant_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            try:
                head = self._render_text(messages[:i], True)
            except ValueError as e:
                raise ValueError(f"assistant message {i}: the chat template cannot render the "
                                 f"prompt before it ({e})") from e
            upto = self._render_text(messages[: i + 1], False)
            if not (upto.startswith(head) and text.startswith(upto)):
                raise ValueError(
                    f"the chat template renders messages[:{i}] differently once later messages "
                    f"follow (it rewrites earlier turns), so the loss mask of assistant message "
                    f"{i} cannot be located; render each assistant turn as its own sample")
            spans.append((len(head), len(upto[len(head):].rstrip()) + len(head)))
        return spans

    def render_chat(self, messages: list[dict], *,
                    add_generation_prompt: bool = False) -> RenderedChat:
        """Token ids and loss mask of a conversation rendered with the chat template.

        Raises:
            ValueError: naming the index of a malformed message and the allowed roles; when the
                template rejects the conversation (`raise_exception`) or rewrites earlier turns.
        """
        messages = [dict(m) for m in _check_messages(messages)]
        text = self._render_text(messages, add_generation_prompt)
        spans = self._assistant_spans(messages, text)
        encoding = self._backend.encode(text, add_special_tokens=False)
        ids = list(encoding.ids)
        mask = [any(max(s, a) < min(e, b) or (s == e and a <= s < b) for a, b in spans)
                for s, e in encoding.offsets]
        if self._bos_id is not None:
            lead = 0
            while lead < len(ids) and ids[lead] == self._bos_id:
                lead += 1
            ids = [self._bos_id] + ids[lead:]
            mask = [False] + mask[lead:]
        return RenderedChat(ids, mask)

    def render_prompt(self, messages: list[dict]) -> list[int]:
        """`render_chat(messages, add_generation_prompt=True).input_ids`."""
        return self.render_chat(messages, add_generation_prompt=True).input_ids

    def _find_stop_ids(self) -> frozenset[int]:
        special = {t.content: i for i, t in self._backend.get_added_tokens_decoder().items()
                   if t.special}
        stops = {self._eos_id}
        template = self.chat_template or FALLBACK_CHAT_TEMPLATE
        stops.update(special[t] for t in _KNOWN_END_OF_TURN if t in special and t in template)
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        try:
            head = self._render_text(probe[:1], True)
            turn = self._render_text(probe, False)[len(head):].rstrip()
        except ValueError:
            return frozenset(stops)  # the template wants another shape of chat; skip the probe
        tail = self._backend.encode(turn, add_special_tokens=False).ids[-1:]
        stops.update(i for i in tail if i in special.values())
        return frozenset(stops)

    def save(self, folder: str | os.PathLike) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template) to
        `folder`; `from_folder` and transformers' `AutoTokenizer.from_pretrained` read them."""
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(path / HF_TOKENIZER_FILE))
        config = dict(self._config)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (path / HF_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                           encoding="utf-8")

    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, pad_id={self.pad_id}, stop_ids={sorted(self.stop_ids)})")


def load_tokenizer(folder: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """The tokenizer saved in `folder`: `posttrain_tokenizer.json` -> `ByteTokenizer`,
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
            raise ValueError(f"{path / BYTE_TOKENIZER_FILE} has kind={record.get('kind')!r}; "
                             f"known kinds: 'byte'")
        if record.get("version") != ByteTokenizer.FORMAT_VERSION:
            raise ValueError(f"{path / BYTE_TOKENIZER_FILE} has version={record.get('version')!r};"
                             f" this posttrain reads version {ByteTokenizer.FORMAT_VERSION}")
        return ByteTokenizer()
    if (path / HF_TOKENIZER_FILE).is_file():
        return HFTokenizer.from_folder(path)
    hint = (" (tokenizer.model is a sentencepiece file; convert it to tokenizer.json with "
            "transformers' save_pretrained)" if (path / "tokenizer.model").is_file() else "")
    raise FileNotFoundError(f"{path} has neither {BYTE_TOKENIZER_FILE} (byte tokenizer) nor "
                            f"{HF_TOKENIZER_FILE} (Hugging Face tokenizer){hint}")
