"""Rejection-sampling fine-tuning (`posttrain.workflows.rft`): what a round keeps is what a
hand-run of the task's own scorer on the same samples keeps; rounds train on it, stop at the
time budget and resume; the recipe's results and bad config values."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain import cli
from posttrain.envs import chain_sum_task
from posttrain.models.tokenizer import ByteTokenizer
from posttrain.policy import Policy
from posttrain.policy.sampling import Completion
from posttrain.workflows import override
from posttrain.workflows.config import SamplingConfig
from posttrain.workflows.rft import MaxPerPrompt, rft_rounds, sample_verified
from posttrain.workflows.rft_config import RFTConfig


class ScriptedSampler:
    """A sampler whose answers are written out: the prompt of each of `items` gets
    `_answers(item)`; records the calls' sampling settings."""

    def __init__(self, items):
        self.tokenizer, self.calls = ByteTokenizer(), []
        self.items = {tuple(self._render(it["question"])): it for it in items}

    def _render(self, question):
        return self.tokenizer.render_prompt([{"role": "user", "content": question}])

    def generate(self, prompts, *, seed=0, n=1, **sampling):
        self.calls.append({"seed": seed, "n": n, **sampling})
        out = []
        for i, prompt in enumerate(prompts):
            texts = _answers(self.items[tuple(prompt)])
            assert len(texts) == n
            for j, text in enumerate(texts):
                ids = self.tokenizer.encode(text)
                out.append(Completion(i, j, list(prompt), ids, text, [0.0] * len(ids), "eos"))
        return out


def _answers(item):
    """Five answers to a chain_sum item: the gold answer twice, once padded with spaces, a wrong
    number and an empty answer."""
    gold = str(item["answer"])
    return [gold, gold, f" {gold} ", str(int(gold) + 1), ""]


@pytest.fixture(scope="module")
def task():
    return chain_sum_task(size=40, held_out_size=4)


def _hand_kept(items, scorer_of, keep, cap):
    """(question, answer) pairs a hand-run of reasoning-gym's own scorer keeps: full credit,
    not blank, first of each whitespace-collapsed answer with keep="distinct", at most `cap`
    per prompt; and the number of samples with full credit."""
    kept, verified = [], 0
    for item in items:
        seen, taken = set(), 0
        for text in _answers(item):
            if scorer_of(text, item) != 1.0:
                continue
            verified += 1
            key = " ".join(text.split())
            if not key or (keep == "distinct" and key in seen):
                continue
            seen.add(key)
            if cap is not None and taken >= cap:
                continue
            taken += 1
            kept.append((item["question"], text))
    return kept, verified


@pytest.mark.parametrize(
    "keep, cap, count", [("distinct", None, 3), ("all", 2, 6), ("all", None, 9)]
)
def test_a_round_keeps_what_the_scorer_accepts(task, keep, cap, count):
    """3 items x 5 answers: the gold answer and its padded copy score 1.0 with reasoning-gym's
    scorer (the answer stripped, as the held-out evaluation scores), the wrong one and the
    empty one 0.0: 9 of 15 verified, pass rate 0.6. keep="distinct" keeps one per item (the
    three verified answers are one answer once whitespace is collapsed); keep="all" with a cap
    of 2 keeps the first two; keep="all" without a cap keeps all three."""
    import reasoning_gym

    items = task.train_items[:3]
    scorer = reasoning_gym.create_dataset("chain_sum", size=1, seed=0, **task.config)
    expected, verified = _hand_kept(
        items, lambda text, item: scorer.score_answer(text.strip(), item), keep, cap
    )
    assert verified == 9 and len(expected) == count
    sampler = ScriptedSampler(items)
    rft = RFTConfig(samples_per_prompt=5, keep=keep, max_per_prompt=cap)
    got = sample_verified(
        sampler, items, task.verifier, rft, SamplingConfig(temperature=0.7), seed=3, timeout_s=5.0
    )
    assert [(r["prompt"], r["completion"]) for r in got.rows] == expected
    assert got.counts == {
        "prompts": 3,
        "samples": 15,
        "scoring_failed": 0,
        "verified": 9,
        "prompts_solved": 3,
        "kept": len(expected),
        "pass_rate": 0.6,
        "solved_share": 1.0,
        "kept_share": len(expected) / 15,
    }
    assert sampler.calls[0]["n"] == 5 and sampler.calls[0]["temperature"] == 0.7
    assert got.stats["rows_out"].iloc[-1] == len(expected)


class _Wrong(ScriptedSampler):
    """Every answer off by one."""

    def generate(self, prompts, **options):
        return [
            Completion(
                c.prompt_index, c.sample_index, c.prompt_ids, c.token_ids, t, c.logprobs, "eos"
            )
            for c in super().generate(prompts, **options)
            for t in [str(int(c.text.strip() or 0) + 7)]
        ]


def test_a_round_with_no_verified_answer_keeps_nothing(task):
    items = task.train_items[:2]
    got = sample_verified(
        _Wrong(items),
        items,
        task.verifier,
        RFTConfig(samples_per_prompt=5),
        SamplingConfig(),
        seed=0,
        timeout_s=5.0,
    )
    assert got.rows == [] and got.counts["verified"] == 0 and got.counts["pass_rate"] == 0.0
    assert list(got.stats["stage"]) == ["score"]


def test_max_per_prompt_counts_whitespace_variants_of_a_prompt_as_one():
    rows = [{"prompt": p, "completion": c} for p, c in [("a b", "1"), ("a  b", "2"), ("c", "3")]]
    kept, removed = MaxPerPrompt(1).apply(rows)
    assert [r["completion"] for r in kept] == ["1", "3"] and removed == {"over_max_per_prompt": 1}
    with pytest.raises(ValueError, match=r"MaxPerPrompt\.max_per_prompt=0"):
        MaxPerPrompt(0)


def _rounds(task, tmp_path, policy, **changes):
    rft = RFTConfig(
        **{
            "rounds": 2,
            "prompts_per_round": 3,
            "samples_per_prompt": 5,
            "steps": 2,
            "batch_size": 2,
            "keep": "all",
            **changes,
        }
    )
    sampler = ScriptedSampler(task.train_items)
    return rft_rounds(
        policy,
        task,
        rft,
        SamplingConfig(),
        out=tmp_path,
        sampler=lambda p: sampler,
        progress=False,
    )


def test_rounds_fine_tune_on_the_kept_answers(task, tmp_path):
    """Two rounds of 3 prompts: each keeps the 3 verified answers of each prompt (9), trains 2
    SFT steps on them, changes the weights, and writes its row to metrics.jsonl and its kept
    rows to its folder."""
    torch.manual_seed(0)
    policy = Policy.from_spec("tiny-1m", seed=0)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    policy, rows = _rounds(task, tmp_path, policy)
    assert [(r["round"], r["kept"], r["sft_steps"]) for r in rows] == [(1, 9, 2), (2, 9, 2)]
    assert all(r["trained_tokens"] > 0 and r["step_time_s"] > r["train_s"] > 0 for r in rows)
    assert rows[1]["spent_s"] == pytest.approx(rows[0]["step_time_s"] + rows[1]["step_time_s"])
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in logged] == [1, 2]
    kept = (tmp_path / "rounds" / "round_2" / "kept.jsonl").read_text().splitlines()
    questions = {json.loads(line)["prompt"] for line in kept}
    assert questions == {it["question"] for it in task.train_items[3:6]}  # round 2's prompts
    assert any(not torch.equal(before[k], v) for k, v in policy.model.state_dict().items())


def test_a_budget_stops_the_rounds(task, tmp_path):
    """A budget below the first round's sampling time: that round trains nothing and no
    second round starts."""
    policy, rows = _rounds(task, tmp_path, Policy.from_spec("tiny-1m", seed=0), budget_s=1e-9)
    assert [(r["round"], r["kept"], r["sft_steps"]) for r in rows] == [(1, 9, 0)]
    assert "loss" not in rows[0]


def test_resume_reads_the_finished_rounds_back(task, tmp_path):
    """A run resumed after both rounds finished samples and trains nothing again: the rows and
    the weights are the saved ones."""
    policy, rows = _rounds(task, tmp_path, Policy.from_spec("tiny-1m", seed=0), rounds=1)
    rft = RFTConfig(rounds=1, prompts_per_round=3, samples_per_prompt=5, steps=2, batch_size=2)

    def no_sampling(p):
        raise AssertionError("a finished round sampled again")

    again, rows_again = rft_rounds(
        Policy.from_spec("tiny-1m", seed=1),
        task,
        rft,
        SamplingConfig(),
        out=tmp_path,
        sampler=no_sampling,
        resume=True,
        progress=False,
    )
    assert rows_again == rows
    for (k, v), w in zip(policy.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(v, w), k


def test_the_recipe_reports_rounds_and_held_out_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = cli.load_recipe("rft")
    cfg = override(module.Config(), {**module.TINY, "out_dir": str(tmp_path / "run")})
    results = module.main(cfg)
    rounds = module.TINY["rft.rounds"]
    assert results["rounds"] == rounds and results["method"] == "rft"
    assert {"after_sft", "after_rft", "difference", "sampled_after_rft", "sampled_difference"} <= (
        set(results)
    )
    assert [p["step"] for p in results["eval_curve"]] == list(range(rounds + 1))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = module.TINY["rft.prompts_per_round"] * module.TINY["rft.samples_per_prompt"]
    assert [(r["round"], r["samples"]) for r in rows] == [(r, samples) for r in (1, 2)]
    assert results["rft_train_s"] == pytest.approx(sum(r["step_time_s"] for r in rows))
    assert (tmp_path / "run" / "results.md").read_text().count("\n| 2 |") == 1


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"rft.keep": "best"}, "rft.keep"),
        ({"rft.rounds": 0}, "rft.rounds"),
        ({"rft.samples_per_prompt": 0}, "rft.samples_per_prompt"),
        ({"rft.prompts_per_round": 1.5}, "rft.prompts_per_round"),
        ({"rft.max_per_prompt": 0}, "rft.max_per_prompt"),
        ({"rft.budget_s": 0.0}, "rft.budget_s"),
        ({"rft.lr": float("nan")}, "rft.lr"),
        ({"sampling.temperature": 0.0}, "sampling.temperature"),
    ],
)
def test_bad_rft_values_are_refused_by_name(overrides, field):
    module = cli.load_recipe("rft")
    with pytest.raises(ValueError, match=rf"Config\.{field}="):
        override(module.Config(), overrides)
