"""`HFTokenizer`: a Hugging Face `tokenizer.json` + `tokenizer_config.json` folder, with chats
rendered by the folder's jinja chat template the way `transformers` renders them.

The chat template is compiled in the sandboxed jinja environment transformers uses
(`_compile_chat_template`); the loss mask of a rendered chat comes from the character spans of
the assistant turns. The `Tokenizer` protocol and `load_tokenizer` are in
`posttrain.models.tokenizer`.

Example (a tokenizer.json folder; transformers' `save_pretrained` writes one):
    >>> tok = HFTokenizer.from_folder("checkpoints/qwen2.5-0.5b-instruct")   # doctest: +SKIP
    >>> tok.render_prompt([{"role": "user", "content": "hi"}])               # doctest: +SKIP
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.models.chat import RenderedChat, _check_messages, _ids

if TYPE_CHECKING:
    import tokenizers

HF_TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"
HF_CHAT_TEMPLATE_FILE = "chat_template.jinja"
HF_SPECIAL_TOKENS_FILE = "special_tokens_map.json"

# Special tokens that end a turn in common chat formats (ChatML/Qwen, Llama 3 incl. tool calls,
# Gemma, Phi-3). When one is a special token of the vocabulary and its text appears in the chat
# template, it is a stop id.
_KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

# The named special tokens transformers passes to a chat template (`special_tokens_map`).
_TEMPLATE_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Used by `HFTokenizer` when the folder has no chat template: the byte tokenizer's role markers,
# as plain text, with EOS closing every turn (so EOS is the only stop id).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


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
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
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
                raise ValueError(
                    f"chat_template lists templates {sorted(map(str, named))} but "
                    f"none named 'default'"
                )
            template = named["default"]
        if template is not None and not isinstance(template, str):
            raise ValueError(f"chat_template must be a string, got {type(template).__name__}")
        self.chat_template: str | None = template
        self._template_tokens = {
            k: t
            for k in _TEMPLATE_TOKEN_KEYS
            if (t := _token_text(self._config.get(k))) is not None
        }

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
            raise ValueError(
                f"tokenizer_config {key}={token!r} is not in the vocabulary of tokenizer.json"
            )
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
            config.update(
                {
                    k: v
                    for k, v in legacy.items()
                    if k in _TEMPLATE_TOKEN_KEYS and config.get(k) is None
                }
            )
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
    def unk_id(self) -> int | None:
        """Id of the unknown token, or None when the model has none (byte-level BPE covers
        every text, so it never needs one)."""
        unk = self._template_tokens.get("unk_token") or getattr(
            self._backend.model, "unk_token", None
        )
        return None if unk is None else self._backend.token_to_id(unk)

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
            return template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._template_tokens,
            )
        except jinja2.TemplateError as e:
            raise ValueError(
                f"the chat template could not render {len(messages)} message(s): {e}"
            ) from e

    def _assistant_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            try:
                head = self._render_text(messages[:i], True)
            except ValueError as e:
                raise ValueError(
                    f"assistant message {i}: the chat template cannot render the "
                    f"prompt before it ({e})"
                ) from e
            upto = self._render_text(messages[: i + 1], False)
            if not (upto.startswith(head) and text.startswith(upto)):
                raise ValueError(
                    f"the chat template renders messages[:{i}] differently once later messages "
                    f"follow (it rewrites earlier turns), so the loss mask of assistant message "
                    f"{i} cannot be located; render each assistant turn as its own sample"
                )
            spans.append((len(head), len(upto[len(head) :].rstrip()) + len(head)))
        return spans

    def render_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = False
    ) -> RenderedChat:
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
        mask = [
            any(max(s, a) < min(e, b) or (s == e and a <= s < b) for a, b in spans)
            for s, e in encoding.offsets
        ]
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
        special = {
            t.content: i for i, t in self._backend.get_added_tokens_decoder().items() if t.special
        }
        stops = {self._eos_id}
        template = self.chat_template or FALLBACK_CHAT_TEMPLATE
        stops.update(special[t] for t in _KNOWN_END_OF_TURN if t in special and t in template)
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        try:
            head = self._render_text(probe[:1], True)
            turn = self._render_text(probe, False)[len(head) :].rstrip()
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
        (path / HF_CONFIG_FILE).write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )

    def __repr__(self) -> str:
        return (
            f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id}, stop_ids={sorted(self.stop_ids)})"
        )
