"""Chat messages and their rendering: the roles, `RenderedChat` (token ids + loss mask) and the
message checks that every tokenizer's `render_chat` shares.

The tokenizers themselves are `posttrain.models.tokenizer.ByteTokenizer` and
`posttrain.models.hf_tokenizer.HFTokenizer`.

Example:
    >>> chat = RenderedChat(input_ids=[1, 2, 3], loss_mask=[False, True, True])
    >>> sum(chat.loss_mask)
    2
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
"""Roles `render_chat` accepts."""


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
            raise ValueError(
                f"RenderedChat: {len(self.input_ids)} input_ids but "
                f"{len(self.loss_mask)} loss_mask entries; they must match"
            )


def _check_messages(messages: Any) -> list[dict]:
    """Raise ValueError, naming the message index, unless `messages` is a non-empty chat."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
            f"got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; render_chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(
                f"messages[{i}] is a {type(m).__name__}; each message must be a dict "
                f"with string 'role' and 'content'"
            )
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(
                f"messages[{i}]['role'] is {role!r}; allowed roles: {', '.join(ROLES)}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}]['content'] is {type(content).__name__}; it must be a string"
            )
    return list(messages)


def _ids(ids: Sequence[int]) -> list[int]:
    # Accepts Python/numpy ints and 0-d integer tensors; a float raises TypeError.
    return [operator.index(i) for i in ids]
