"""The suite's one shared vLLM server (the session fixture `vllm_server` in tests/conftest.py)
and how a test lends it to a rollout engine or a trainer without the server being closed."""

from __future__ import annotations

from posttrain.policy.rollout_engine import VLLMEngine
from posttrain.policy.vllm_server import VLLMServer

SHARED_CLOSE = (
    "the shared vllm_server stays open until the test session ends (tests/conftest.py): lend "
    "it with _vllm_helpers.SharedServerEngine, or start a server of your own to test closing"
)


class SharedServerEngine(VLLMEngine):
    """A `VLLMEngine` over the shared `vllm_server`: `close()` marks the engine closed and leaves
    the server running, so `with SharedServerEngine(vllm_server) as engine:`, a trainer's
    `rollout_engine=SharedServerEngine(vllm_server, version=step)` and `build_rollout_engine`'s
    callers all leave it usable for the next test. The engine's versions count from `version`
    whatever version the server holds (an RLTrainer syncs a given engine before its first
    rollout)."""

    def __init__(self, server: VLLMServer, *, version: int = 0) -> None:
        super().__init__(server, version=version)
        self.closed = False

    def close(self) -> None:
        self.closed = True


def refuse_close() -> None:
    """Stands in for the shared server's `close` while the session runs."""
    raise RuntimeError(SHARED_CLOSE)


BLOCK = 128
"""vLLM's CPU KV block (tokens): a prompt longer than this is cached as a full block."""


def equivalence_prompts(tokenizer, count: int = 64) -> list[str | list[int]]:
    """`count` prompts (a multiple of 4) for engine-equivalence tests, a quarter of each kind:
    short text (1-60 characters, encoded with BOS by the engines), long text (130-330
    characters: one or two KV blocks and a partial one), chat-rendered prompts
    (`tokenizer.render_prompt` of a system and a user message, 20-300 tokens), and raw token-id
    lists whose lengths sit on and around the KV block boundaries (127, 128, 129, 255, 256, 257,
    ...). Drawn from a fixed seed; byte ids only in raw lists (never the pad id 256)."""
    import random

    if count % 4:
        raise ValueError(f"count={count} must be a multiple of 4 (four kinds of prompt)")
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-=.,?!\n"

    def text(lo: int, hi: int) -> str:
        return "".join(rng.choice(letters) for _ in range(rng.randint(lo, hi)))

    quarter = count // 4
    short: list[str | list[int]] = [text(1, 60) for _ in range(quarter)]
    long: list[str | list[int]] = [text(130, 330) for _ in range(quarter)]
    chat: list[str | list[int]] = [
        list(
            tokenizer.render_prompt(
                [
                    {"role": "system", "content": text(0, 40)},
                    {"role": "user", "content": text(10, 250)},
                ]
            )
        )
        for _ in range(quarter)
    ]
    edges = [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1, 1, 2, 3 * BLOCK]
    lengths = [edges[i] if i < len(edges) else rng.randint(4, 300) for i in range(quarter)]
    raw: list[str | list[int]] = [[rng.randrange(256) for _ in range(k)] for k in lengths]
    return [p for group in zip(short, long, chat, raw) for p in group]
