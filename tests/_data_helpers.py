"""Shared pieces of the data tests (tests/data/test_data_samples.py,
tests/data/test_data_packing.py,
tests/data/test_data_loader.py): the byte tokenizer, chat rows, the label of an untrained position.

Byte tokenizer ids used in pinned values: 257 <|bos|>, 258 <|eos|>, 260 <|user|>,
261 <|assistant|>, 262 <|end|>; bytes: 'h' 104, 'i' 105, 'k' 107, 'o' 111.
"""

from __future__ import annotations

from posttrain.data import IGNORE_INDEX
from posttrain.models import ByteTokenizer

X = IGNORE_INDEX
"""The label of a position that is not trained."""
TOK = ByteTokenizer()


def chat(prompt: str, answer: str) -> dict:
    """A two-message chat row: the user's `prompt`, the assistant's `answer`."""
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    }
