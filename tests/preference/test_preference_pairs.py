"""Preference pairs by rejection sampling (`make_preference_pairs`): best vs worst of each
prompt's samples, failed verifications (timeouts, errors, format errors) excluded and every
outcome counted; pairs from a real policy are deterministic and feed the preference and KTO
datasets."""

from __future__ import annotations

import time

import pytest
from _train_helpers import TINY, tiny_model

from posttrain.data import KTODataset, PreferenceDataset, pairs_to_kto_rows
from posttrain.models import ByteTokenizer
from posttrain.policy import Completion, Policy
from posttrain.preference import make_preference_pairs
from posttrain.rewards import VerifierResult

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class _ScriptedPolicy:
    """`generate` returns the scripted texts of each prompt, in order."""

    tokenizer = ByteTokenizer()

    def __init__(self, texts_by_question):
        self.texts = texts_by_question
        self.calls = []

    def generate(self, prompts, *, n, seed, **kwargs):
        self.calls.append((len(prompts), n, seed))
        out = []
        for p, ids in enumerate(prompts):
            question = self.tokenizer.decode(ids).strip()
            texts = self.texts[question]
            assert len(texts) == n
            out += [Completion(p, k, list(ids), [], t, [], "eos") for k, t in enumerate(texts)]
        return out


RANK_BUDGET_S = 2.0
"""Budget of `_rank` calls: 'hang' sleeps 600 s past it; the others answer in milliseconds,
well within it even when the machine is busy."""


def _rank(completion, item):
    """A verifier: 'hang' times out, 'boom' raises, '' is a format error, else exact match."""
    if completion == "hang":
        time.sleep(600)
    if completion == "boom":
        raise RuntimeError("boom")
    if completion == "":
        return VerifierResult.failure("format_error", "empty")
    return VerifierResult.from_score(float(completion == item["answer"]))


def test_pairs_keep_best_vs_worst_exclude_failures_and_count_everything():
    items = [
        {"question": "q1", "answer": "1"},
        {"question": "q2", "answer": "2"},
        {"question": "q3", "answer": "3"},
        {"question": "q4", "answer": "4"},
        {"question": "q5", "answer": "5"},
    ]
    policy = _ScriptedPolicy(
        {
            "q1": ["9", "1", "boom", "1"],  # pair (1, 9); the error excluded, not a 0.0
            "q2": ["7", "8", "hang", "6"],  # all scored candidates wrong: skipped
            "q3": ["", "3", "3", "3"],  # format error ranks lowest: pair (3, "")
            "q4": ["boom", "boom", "hang", "4"],  # one usable candidate: too few
            "q5": ["5", "5", "5", "5"],  # all right: skipped
        }
    )
    rows, stats = make_preference_pairs(
        policy, items, rank=_rank, n=4, seed=7, prompts_per_batch=3, timeout_s=RANK_BUDGET_S
    )
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
        ("q1", "1", "9"),
        ("q3", "3", ""),
    ]
    assert rows[1]["rejected_outcome"] == "format_error" and rows[0]["chosen_score"] == 1.0
    assert (stats.prompts, stats.samples, stats.pairs) == (5, 20, 2)
    assert (stats.skipped_all_equal, stats.skipped_too_few) == (2, 1)
    assert stats.excluded == {"error": 3, "timeout": 2}
    assert stats.outcomes == {"ok": 10, "wrong": 4, "format_error": 1, "timeout": 2, "error": 3}
    assert [c[2] for c in policy.calls] == [7, 10]  # seed + first item index of each chunk

    rows, stats = make_preference_pairs(
        policy,
        items,
        rank=_rank,
        n=4,
        timeout_s=RANK_BUDGET_S,
        format_error="exclude",
        reference_answer=lambda item: item["answer"],
    )
    # q2's samples are all wrong: the reference answer is the chosen one; q3 now ties
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
        ("q1", "1", "9"),
        ("q2", "2", "7"),
    ]
    assert stats.excluded == {"error": 3, "timeout": 2, "format_error": 1}
    assert (stats.reference_chosen, stats.skipped_all_equal, stats.skipped_too_few) == (1, 3, 0)


def test_pairs_from_a_real_policy_are_deterministic_and_feed_the_datasets():
    policy = Policy(tiny_model(0), ByteTokenizer(), TINY)
    items = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]
    judge = lambda completion, item: float(len(completion) % 3)  # noqa: E731  a plain callable
    first = make_preference_pairs(policy, items, rank=judge, n=4, max_new_tokens=6, seed=1)
    again = make_preference_pairs(policy, items, rank=judge, n=4, max_new_tokens=6, seed=1)
    assert first == again and first[1].pairs >= 1
    PreferenceDataset(first[0], ByteTokenizer(), max_seq_len=64)
    KTODataset(pairs_to_kto_rows(first[0]), ByteTokenizer(), max_seq_len=64)
