"""The synthetic-data pipeline (`posttrain.data.synthetic`): each stage on hand-made rows with
hand-computed removals, the stats table, provenance, failed scoring counted and removed, the
errors for bad configs, and an end-to-end run (tiny policy, chain_sum verifier) into one SFT step.
"""

from __future__ import annotations

import json
import time
from functools import partial

import pytest
import torch
from _waits import LATE_S

from posttrain.data import SFTDataset, SFTLoader
from posttrain.data.synthetic import (
    Decontaminate,
    ExactDedup,
    Length,
    MinScore,
    NearDedup,
    Score,
    SyntheticPipeline,
    build_stage,
    generate_candidates,
)
from posttrain.data.synthetic_stages import decontamination_ngrams, jaccard, word_ngrams
from posttrain.models import ByteTokenizer
from posttrain.rewards.verifier import VerifierResult, score_batch


def rows_of(*pairs, **extra):
    return [{"prompt": p, "completion": c, **extra} for p, c in pairs]


# --------------------------------------------------------------------------------------------
# Each stage on hand-made rows
# --------------------------------------------------------------------------------------------


def test_exact_dedup_collapses_whitespace_only():
    """5 rows; row 1 is row 0 with extra spaces/newline, row 3 repeats row 0 exactly, row 2 is
    another case ("X"), row 4 another prompt: 2 duplicates removed."""
    rows = rows_of(
        ("1+1=", "x 2"), (" 1+1= ", "x  2\n"), ("1+1=", "X 2"), ("1+1=", "x 2"), ("2+2=", "x 2")
    )
    kept, removed = ExactDedup().apply(rows)
    assert [r["completion"] for r in kept] == ["x 2", "X 2", "x 2"]
    assert removed == {"duplicate": 2}


def test_near_dedup_known_jaccard_within_a_prompt():
    """Word 2-grams of "a b c d" = {ab, bc, cd}, of "a b c e" = {ab, bc, ce}: 2 shared of 4,
    Jaccard 0.5. Threshold 0.5 drops the second; 0.51 keeps both; another prompt's identical
    completion is never compared."""
    assert jaccard(word_ngrams("a b c d", 2), word_ngrams("a b c e", 2)) == 0.5
    rows = rows_of(("p", "a b c d"), ("p", "a b c e"), ("q", "a b c d"))
    kept, removed = NearDedup(threshold=0.5, n=2).apply(rows)
    assert [(r["prompt"], r["completion"]) for r in kept] == [("p", "a b c d"), ("q", "a b c d")]
    assert removed == {"near_duplicate": 1}
    kept, removed = NearDedup(threshold=0.51, n=2).apply(rows)
    assert len(kept) == 3 and removed == {}
    # texts shorter than n words are one shingle each: equal words -> Jaccard 1
    assert jaccard(word_ngrams("7", 5), word_ngrams(" 7 ", 5)) == 1.0


def test_length_in_chars_and_tokens():
    """Chars of the stripped completion: "a"=1 < 2 too short, "ab"=2, "abcd"=4 kept,
    "abcde"=5 > 4 too long, " " = 0 too short. Tokens (ByteTokenizer: utf-8 bytes): "éé" is 2
    chars but 4 tokens, so max 3 tokens removes it and max 3 chars keeps it."""
    rows = rows_of(("p", "a"), ("p", "ab"), ("p", " abcd\n"), ("p", "abcde"), ("p", " "))
    kept, removed = Length(min_length=2, max_length=4).apply(rows)
    assert [r["completion"] for r in kept] == ["ab", " abcd\n"]
    assert removed == {"too_short": 2, "too_long": 1}
    rows = rows_of(("p", "éé"), ("p", "abc"))
    assert len(Length(max_length=3).apply(rows)[0]) == 2
    kept, removed = Length(max_length=3, unit="tokens", tokenizer=ByteTokenizer()).apply(rows)
    assert [r["completion"] for r in kept] == ["abc"] and removed == {"too_long": 1}


def test_min_score_keeps_at_or_above_the_threshold():
    rows = [{"prompt": "p", "completion": str(s), "score": s} for s in (1.0, 0.5, 0.0, 0.99)]
    kept, removed = MinScore(0.99).apply(rows)
    assert [r["score"] for r in kept] == [1.0, 0.99] and removed == {"below_threshold": 2}


def test_decontaminate_by_known_ngram_per_held_out_set():
    """n=3. Held-out "web" has the 3-gram (quick, brown, fox); "math" (an item) has (3, +, 4)
    in its question. Row 0's prompt holds "QUICK brown fox" (case is ignored) -> web; row 1's
    completion holds "3 + 4" -> math; row 2 shares only 2-grams ("quick brown") -> kept."""
    assert ("3", "+", "4") in decontamination_ngrams("what is 3 + 4 ?", 3)
    held = {
        "web": ["the quick brown fox jumps"],
        "math": [{"question": "what is 3 + 4 ?", "answer": "7"}],
    }
    rows = rows_of(("a QUICK brown fox", "ok"), ("sum?", "so 3 + 4 = 7"), ("quick brown dog", "no"))
    kept, removed = Decontaminate(held, n=3).apply(rows)
    assert [r["prompt"] for r in kept] == ["quick brown dog"]
    assert removed == {"held_out:web": 1, "held_out:math": 1}
    # every text here is shorter than 13 tokens: the GPT-3 default finds nothing
    assert len(Decontaminate(held).apply(rows)[0]) == 3


# --------------------------------------------------------------------------------------------
# Pipeline: stats table and provenance
# --------------------------------------------------------------------------------------------


def test_stats_table_counts_each_stage_and_chains():
    """8 scored rows. exact_dedup: row 1 repeats row 0 (-1). near_dedup (n=2, 0.5): "a b c e"
    vs kept "a b c d" has Jaccard 0.5 (-1). length max 16: "a long completion" is 17 chars (-1).
    min_score 0.5: the 0.2 row (-1; 0.5 stays). decontaminate n=2 on "secret word": the row saying
    it (-1). 8 -> 7 -> 6 -> 5 -> 4 -> 3."""
    rows = [
        dict(r, score=s)
        for r, s in zip(
            rows_of(
                ("p", "a b c d"),
                ("p", "a b c d "),
                ("p", "a b c e"),
                ("q", "a long completion"),
                ("q", "low"),
                ("q", "a secret word"),
                ("r", "fine"),
                ("r", "fine too"),
            ),
            (1.0, 1.0, 1.0, 1.0, 0.2, 1.0, 1.0, 0.5),
        )
    ]
    pipe = SyntheticPipeline(
        [
            "exact_dedup",
            ("near_dedup", {"threshold": 0.5, "n": 2}),
            {"name": "length", "max_length": 16},
            MinScore(0.5),
            Decontaminate({"eval": ["the secret word"]}, n=2),
        ]
    )
    result = pipe.run(rows)
    stats = result.stats
    assert list(stats.stage) == [
        "exact_dedup",
        "near_dedup",
        "length",
        "min_score",
        "decontaminate",
    ]
    assert list(stats.rows_in) == [8, 7, 6, 5, 4]
    assert list(stats.removed) == [1, 1, 1, 1, 1]
    assert (stats.rows_in == stats.rows_out + stats.removed).all()
    assert list(stats.rows_in[1:]) == list(stats.rows_out[:-1])
    assert list(stats.reasons) == [
        {"duplicate": 1},
        {"near_duplicate": 1},
        {"too_long": 1},
        {"below_threshold": 1},
        {"held_out:eval": 1},
    ]
    assert stats.params[1] == "threshold=0.5, n=2, method=exact_jaccard"
    assert [r["completion"] for r in result.dataset_rows] == ["a b c d", "fine", "fine too"]
    for row in result.dataset_rows:
        assert [s["name"] for s in row["provenance"]["stages"]] == list(stats.stage)
        assert all(s["version"] == "1" for s in row["provenance"]["stages"])
    assert "provenance" not in rows[0]  # input rows untouched


def failing_verifier(completion, item):
    """Raises on "raise", hangs on "hang", else exact match (module level: pickles by name)."""
    if completion == "raise":
        raise RuntimeError("verifier bug")
    if completion == "hang":
        time.sleep(600)
    return 1.0 if completion == item["answer"] else 0.0


def test_score_counts_and_removes_error_and_timeout_through_the_runner():
    """Through `score_batch` with a 1 s budget: "raise" -> error, "hang" (600 s) -> timeout, both
    removed and counted; the others keep score and outcome (1.0 ok, 0.0 wrong, not dropped)."""
    item = {"question": "1+1=", "answer": "2"}
    rows = [{"prompt": "1+1=", "completion": c, "item": item} for c in ("2", "raise", "3", "hang")]
    stage = Score(partial(score_batch, failing_verifier, timeout_s=1.0, max_workers=2))
    start = time.monotonic()
    result = SyntheticPipeline([stage]).run(rows)
    assert time.monotonic() - start < 1.0 + LATE_S  # cut at the budget, not after 600 s
    assert result.stats.reasons[0] == {"error": 1, "timeout": 1}
    assert int(result.stats.removed[0]) == 2
    assert [(r["completion"], r["score"], r["outcome"]) for r in result.dataset_rows] == [
        ("2", 1.0, "ok"),
        ("3", 0.0, "wrong"),
    ]
    assert "score_batch(<function failing_verifier" in result.stats.params[0]
    assert "timeout_s=1.0" in result.stats.params[0]


def test_score_accepts_a_judge_and_refuses_a_per_completion_verifier():
    class StubJudge:
        def judge(self, completions, items):
            return [
                VerifierResult(0.7, "ok")
                if c == "good"
                else VerifierResult(0.0, "error", "unparsable")
                for c in completions
            ]

    rows = rows_of(("q", "good"), ("q", "bad"))
    result = SyntheticPipeline([Score(StubJudge())]).run(rows)
    assert [(r["score"], r["outcome"]) for r in result.dataset_rows] == [(0.7, "ok")]
    assert result.stats.reasons[0] == {"error": 1}
    with pytest.raises(TypeError, match="partial\\(score_batch, verifier"):
        SyntheticPipeline([Score(lambda completion, item: 1.0)]).run(rows)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_a_stage_that_removes_every_row_is_named_with_its_params():
    rows = [{"prompt": "p", "completion": c, "score": 0.5} for c in "abc"]
    with pytest.raises(
        ValueError,
        match=r"stage 'min_score' \(threshold=0.9\) removed all 3 "
        r"rows that came in \(reasons: \{'below_threshold': 3\}",
    ):
        SyntheticPipeline([ExactDedup(), MinScore(0.9)]).run(rows)


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: NearDedup(threshold=1.5),
            r"NearDedup.threshold=1.5; must be a finite number in \[0, 1\]",
        ),
        (lambda: NearDedup(threshold=-0.1), r"NearDedup.threshold=-0.1"),
        (lambda: NearDedup(n=0), r"NearDedup.n=0; must be an integer >= 1"),
        (lambda: Length(min_length=5, max_length=2), r"min_length=5 > Length.max_length=2"),
        (lambda: Length(), r"needs min_length, max_length or both"),
        (
            lambda: Length(max_length=3, unit="words"),
            r"Length.unit='words'; allowed: 'chars', 'tokens'",
        ),
        (lambda: Length(max_length=3, unit="tokens"), r"needs a tokenizer"),
        (lambda: Length(min_length=-1), r"Length.min_length=-1; must be an integer >= 0"),
        (lambda: MinScore(float("nan")), r"MinScore.threshold=nan; must be a finite number"),
        (
            lambda: Decontaminate({"eval": ["a b"]}, n=0),
            r"Decontaminate.n=0; must be an integer >= 1",
        ),
        (lambda: Decontaminate({}), r"Decontaminate.held_out=\{\}; must be a non-empty dict"),
        (lambda: Decontaminate({"eval": "one text"}), r"held_out\['eval'\] is a str"),
        (
            lambda: build_stage("fuzzy_dedup"),
            r"unknown synthetic-data stage 'fuzzy_dedup'; "
            r"registered synthetic-data stages: .*exact_dedup",
        ),
        (
            lambda: build_stage(("length", {"max_chars": 3})),
            r"stage 'length' has no option\(s\) "
            r"\['max_chars'\]; allowed: .*max_length",
        ),
        (lambda: SyntheticPipeline([]), r"stages must be a non-empty list"),
    ],
)
def test_bad_parameters_name_the_field_and_what_is_allowed(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_config_errors_come_before_any_scoring_or_generation():
    def never(completions, items):
        raise AssertionError("the scorer ran")

    rows = rows_of(("p", "a"))
    with pytest.raises(ValueError, match=r"stage 'min_score' reads row field\(s\) \['score'\]"):
        SyntheticPipeline([Score(never), ExactDedup(), MinScore(0.5)][1:]).run(rows)
    with pytest.raises(ValueError, match=r"stage 'min_score' reads row field\(s\) \['score'\]"):
        SyntheticPipeline([MinScore(0.5), Score(never)]).run(rows)

    class NoGenerate:
        tokenizer = ByteTokenizer()

        def generate(self, *args, **kwargs):
            raise AssertionError("generated")

    with pytest.raises(ValueError, match=r"stage 'min_score' reads row field\(s\) \['score'\]"):
        SyntheticPipeline([MinScore(0.5)]).generate_and_run(NoGenerate(), ["1+2="], n=2)
    for kwargs, message in [
        ({"n": 0}, r"n=0; must be an integer >= 1"),
        ({"source": ""}, r"source=''; must be a non-empty str"),
        ({"max_new_tokens": 0}, r"max_new_tokens=0"),
        ({"prompts": [{"answer": "3"}]}, r"prompts\[0\] .* str 'question'"),
        ({"prompts": []}, r"prompts is empty"),
    ]:
        options = {"prompts": ["1+2="], **kwargs}
        with pytest.raises(ValueError, match=message):
            generate_candidates(NoGenerate(), options.pop("prompts"), **options)


# --------------------------------------------------------------------------------------------
# End to end: tiny policy, chain_sum verifier, one SFT step
# --------------------------------------------------------------------------------------------


def test_end_to_end_tiny_policy_chain_sum_into_one_sft_step(tmp_path):
    """6 chain_sum prompts; 2 greedy samples each from a "teacher" (an untrained tiny-1m: its
    two samples are the same text, so exact_dedup removes 6) and 2 sampled ones from the policy
    (another tiny-1m). Their answers are wrong, so the score threshold is 0.0. A "probe"
    held-out set holds prompt 0's question, so decontamination removes prompt 0's 3 rows left
    after dedup (the real held-out questions share no 13-gram with the training ones)."""
    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.train import token_cross_entropy_sum

    task = chain_sum_task(size=6, held_out_size=4)
    items = task.train_items[:6]
    teacher, policy = Policy.from_spec("tiny-1m", seed=1), Policy.from_spec("tiny-1m", seed=0)
    pipeline = SyntheticPipeline(
        [  # built (and checked) before anything is generated
            Score(partial(score_batch, task.verifier, timeout_s=5.0, max_workers=1)),
            ExactDedup(),
            NearDedup(),
            Decontaminate({"chain_sum_held_out": task.held_out(), "probe": [items[0]["question"]]}),
            Length(min_length=1, max_length=7),
            MinScore(0.0),
        ]
    )
    rows = generate_candidates(
        teacher,
        items,
        n=2,
        max_new_tokens=8,
        temperature=0.0,
        seed=0,
        source="teacher:tiny-1m-seed1",
    ) + generate_candidates(policy, items, n=2, max_new_tokens=8, seed=0, source="policy:tiny-1m")
    result = pipeline.run(rows)
    stats = result.stats
    print("\n" + stats.to_string())
    assert int(stats.rows_in[0]) == 24 and stats.reasons[1] == {"duplicate": 6}
    assert (stats.rows_in == stats.rows_out + stats.removed).all()
    assert list(stats.rows_in[1:]) == list(stats.rows_out[:-1])
    # after dedup prompt 0 has 3 rows: the teacher's one greedy text and the policy's two
    assert stats.reasons[3] == {"held_out:probe": 3}
    rows = result.dataset_rows
    assert rows and all(r["prompt_id"] != 0 for r in rows)
    assert {r["source"] for r in rows} <= {"teacher:tiny-1m-seed1", "policy:tiny-1m"}
    for row in rows:
        assert row["seed"] == 0 and row["item"]["question"] == items[row["prompt_id"]]["question"]
        assert 0 <= row["sample_index"] < 4 and isinstance(row["prompt_id"], int)
        assert row["outcome"] in ("ok", "wrong", "format_error") and row["score"] >= 0.0
        assert row["provenance"]["generation"]["max_new_tokens"] == 8
        assert [s["name"] for s in row["provenance"]["stages"]] == list(stats.stage)

    path = result.to_jsonl(tmp_path / "synthetic.jsonl")
    back = [json.loads(line) for line in path.read_text().splitlines()]
    assert [b["completion"] for b in back] == [r["completion"] for r in rows]
    assert back[0]["provenance"]["stages"][0]["params"]["scorer"].startswith("score_batch(")
    assert len(SFTDataset(path, policy.tokenizer, max_seq_len=128)) == len(rows)

    dataset = SFTDataset(result.to_sft_rows(), policy.tokenizer, max_seq_len=128)
    batch = SFTLoader(dataset, batch_size=2, seed=0).next_batch()
    model = policy.model
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(batch.input_ids, mask=batch.attention_mask, input_pos=batch.position_ids)
    loss_sum, num_tokens = token_cross_entropy_sum(logits, batch.labels)
    loss = loss_sum / num_tokens
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and int(num_tokens) > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
