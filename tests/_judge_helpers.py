"""Shared pieces of the judge tests (tests/rewards/test_judge_server.py,
tests/rewards/test_judge_server_jobs.py, tests/rewards/test_judge_limits.py,
tests/rewards/test_judges.py, tests/rewards/test_judges_as_rewards.py):
the item every request is about, a judge held back by a gate, a plain HTTP post, and a scripted
stand-in for a judge's policy.

Every wait is bounded by a generous deadline (`conftest.wait_for` for states; `HTTP_TIMEOUT_S`
for a request): a machine shared with busy neighbours is many times slower than a quiet one, and a
wait that holds returns at once.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import httpx

from posttrain.models import ByteTokenizer
from posttrain.policy import Completion
from posttrain.rewards.judge_server import JUDGE_PATH

ITEM = {"question": "5 + 7 =", "answer": "12"}
HTTP_TIMEOUT_S = 120.0
"""Seconds a test's HTTP request or judge client may take: generous, never the thing tested."""


class Gated:
    """A real judge that waits for `gate` before each call (and records the completions of each
    call), so that a test can hold a batch in the judge and fill the queue at will."""

    def __init__(self, inner):
        self.inner, self.gate, self.calls = inner, threading.Event(), []

    def judge(self, completions, items):
        self.calls.append(list(completions))
        if not self.gate.wait(HTTP_TIMEOUT_S):
            raise TimeoutError("gate never opened")
        return self.inner.judge(completions, items)


def post(url, request_id, completions, items=None, **extra):
    """POST /v1/judge with one ITEM per completion (unless `items`); the httpx response."""
    body = {
        "request_id": request_id,
        "completions": completions,
        "items": items if items is not None else [ITEM] * len(completions),
        **extra,
    }
    return httpx.post(url + JUDGE_PATH, json=body, timeout=HTTP_TIMEOUT_S)


def scores(results):
    return [r.score for r in results]


class ScriptedPolicy:
    """Stands in for a judge `Policy`: answers each prompt with `reply(prompt_text)` and records
    the calls (prompt texts and generation settings)."""

    def __init__(self, reply, max_seq_len=512):
        self.tokenizer = ByteTokenizer()
        self.spec = SimpleNamespace(max_seq_len=max_seq_len)
        self.reply, self.calls = reply, []

    def generate(self, prompts, **settings):
        texts = [self.tokenizer.decode(p) for p in prompts]
        self.calls.append((texts, settings))
        return [
            Completion(i, 0, list(p), [], self.reply(t), [], "eos")
            for i, (p, t) in enumerate(zip(prompts, texts))
        ]
