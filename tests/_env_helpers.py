"""Shared by the environment tests (tests/envs/test_code_envs.py,
tests/envs/test_python_tool_env.py): a policy that plays scripted turns."""

from __future__ import annotations

from posttrain.models import ByteTokenizer
from posttrain.policy import Completion, Policy


class ScriptedTurnsPolicy:
    """generate() answers every prompt with the next scripted text, as a stop-terminated turn
    (the `tiny-1m` spec; every token's log-prob -0.5)."""

    def __init__(self, texts):
        self.tokenizer, self.texts = ByteTokenizer(), list(texts)
        self.spec = Policy.from_spec("tiny-1m").spec

    def generate(self, prompts, *, n=1, seed=None, **_):
        text = self.texts.pop(0)
        ids = self.tokenizer.encode(text) + [ByteTokenizer.END]
        return [
            Completion(
                prompt_index=i // n,
                sample_index=i % n,
                prompt_ids=list(p),
                token_ids=ids,
                text=text,
                logprobs=[-0.5] * len(ids),
                finish_reason="eos",
            )
            for i, p in enumerate(prompts)
            for _ in range(n)
        ]
