"""A researcher's own data in one try: `posttrain run sft data.train=FILE` runs with no task key,
holds rows out, and reports their validation loss and greedy exact match every `eval.every`
steps (metrics.jsonl), before and after training (results.json, results.md); the same from a
notebook with a DataFrame. Two SFT steps of tiny-1m each."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest
import torch

from posttrain import cli
from posttrain.policy.policy import Policy
from posttrain.workflows import DataConfig, SFTConfig, run_sft
from posttrain.workflows.config import BatchOptimConfig, EvalConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(5) for b in range(4)]
SIZE = ["optim.steps=2", "optim.batch_size=4", "optim.warmup_steps=0", "progress=false"]


def _error(capsys, argv):
    with pytest.raises(SystemExit):
        cli.main(argv)
    return capsys.readouterr().err


def test_own_data_runs_from_the_command_line_in_one_try(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    pd.DataFrame(ROWS).to_parquet("rows.parquet")
    pd.DataFrame(ROWS).to_json("rows.jsonl", orient="records", lines=True)
    # what a new user met: a data file as the task, then its options, then its held-out size;
    # every refusal now names data.train
    err = _error(capsys, ["run", "sft", "task.name=rows.parquet", *SIZE])
    assert "Config.task.name='rows.parquet'" in err and "data.train=FILE" in err
    err = _error(capsys, ["run", "sft", "task.name=rows.jsonl", *SIZE])
    assert "Config.task.options" in err and "data.train=FILE" in err
    err = _error(capsys, ["run", "sft", "eval.every=1", *SIZE])
    assert "Config.eval.every=1" in err and "data.train" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl", "rows.parquet"]

    argv = ["run", "sft", "data.train=rows.parquet", "eval.every=1", "eval.max_new_tokens=3"]
    assert cli.main([*argv, *SIZE, "out_dir=run"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    validation = results["validation"]
    assert validation["rows"] == 2  # 0.1 of 20 rows held out
    assert results["data"]["rows"] == 18  # ... and not trained on
    assert results["dataset"] == "rows.parquet (prompt_completion rows)"
    assert set(validation["before"]) == set(validation["after"]) == {"val_loss", "val_exact_match"}
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "eval/val_loss" in m] == [1, 2]
    # the last step's evaluation is of the weights evaluated after training
    assert metrics[-1]["eval/val_loss"] == pytest.approx(validation["after"]["val_loss"], 1e-5)
    assert metrics[-1]["eval/val_exact_match"] == validation["after"]["val_exact_match"]
    report = (tmp_path / "run" / "results.md").read_text()
    assert "| held-out rows (2) | val_loss | val_exact_match |" in report


def _loss_by_hand(policy: Policy, rows: list[dict]) -> float:
    """Token-mean cross-entropy of the answers (and end of turn) of `rows`: each row rendered
    alone, the next-token log-softmax read at the trained positions."""
    total, count = 0.0, 0
    for row in rows:
        messages = [
            {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": row["completion"]},
        ]
        rendered = policy.tokenizer.render_chat(messages)
        ids = torch.tensor([rendered.input_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(policy.model(ids)[0].float(), dim=-1)
        for t in range(1, len(rendered.input_ids)):
            if rendered.loss_mask[t]:
                total -= float(logprobs[t - 1, rendered.input_ids[t]])
                count += 1
    return total / count


def test_a_notebook_trains_on_a_dataframe_and_scores_its_own_eval_rows(tmp_path):
    train, held = pd.DataFrame(ROWS[:16]), ROWS[16:]
    cfg = SFTConfig(
        data=DataConfig(train=train, eval=held),
        optim=BatchOptimConfig(steps=2, batch_size=4, warmup_steps=0),
        eval=EvalConfig(max_new_tokens=3),
        out_dir=str(tmp_path / "nb"),
        progress=False,
    )
    results = run_sft(cfg)
    assert results["data"]["rows"] == 16 and results["validation"]["rows"] == 4
    policy = Policy.from_pretrained(tmp_path / "nb" / "policy")
    policy.model.eval()
    after = results["validation"]["after"]
    assert after["val_loss"] == pytest.approx(_loss_by_hand(policy, held), rel=1e-5)
    prompts = [
        policy.tokenizer.render_prompt([{"role": "user", "content": r["prompt"]}]) for r in held
    ]
    answers = [c.text.strip() for c in policy.generate(prompts, max_new_tokens=3, temperature=0.0)]
    exact = sum(a == r["completion"] for a, r in zip(answers, held)) / len(held)
    assert after["val_exact_match"] == exact
    config = json.loads((tmp_path / "nb" / "config.json").read_text())
    assert config["data"]["train"] == "<DataFrame, 16 rows>"


class Replies:
    """A sampler that answers the i-th prompt with `replies[i]` (the tokens a tiny policy
    sampled, the text replaced)."""

    def __init__(self, policy: Policy, replies: list[str]) -> None:
        self.policy, self.replies, self.tokenizer = policy, replies, policy.tokenizer

    def generate(self, prompts, **sampling):
        out = self.policy.generate(prompts, **sampling)
        return [dataclasses.replace(c, text=self.replies[c.prompt_index]) for c in out]


def test_exact_match_is_the_share_of_stripped_answers_equal_to_the_rows():
    from posttrain.workflows.own_data import HeldOut

    policy = Policy.from_spec("tiny-1m", seed=0)
    rows = [
        ROWS[0],
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "5"}]},
        ROWS[2],
    ]
    held = HeldOut(rows, "sft", policy.tokenizer, max_seq_len=64, max_new_tokens=2, batch_size=2)
    # row 0's answer is "0"; the chat row's "5"; row 2's "2"
    assert held.exact_match(Replies(policy, [" 0\n", "6", "2"])) == pytest.approx(2 / 3)
    text_rows = HeldOut(
        [{"text": "a b c"}], "cpt", policy.tokenizer, max_seq_len=64, max_new_tokens=2, batch_size=2
    )
    assert set(text_rows.metrics(policy.model, policy.spec)) == {"val_loss"}  # no answers


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"train": "rows.xlsx"}, r"DataConfig\.train='rows\.xlsx'; must be a \.jsonl/\.json"),
        ({"eval": "e.jsonl"}, r"DataConfig\.eval=.*None without data\.train"),
        ({"train": "r.csv", "eval_fraction": 1.0}, r"eval_fraction=1\.0; must be below 1"),
        ({"train": "r.csv", "split": "train"}, r"DataConfig\.split='train'; must be None"),
    ],
)
def test_a_bad_data_section_names_its_field(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)


def test_rows_of_another_format_are_refused_before_anything_is_written(tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text('{"question": "q", "reply": "r"}\n')
    err = _error(capsys, ["run", "sft", f"data.train={tmp_path / 'rows.jsonl'}", "out_dir=x"])
    assert "data.train=" in err and "columns ['question', 'reply']" in err
    assert "prompt_completion (columns prompt, completion)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]


class Recorder(Replies):
    """`Replies` that also keeps the prompts it was asked (token ids)."""

    def generate(self, prompts, **sampling):
        self.prompts = [list(p) for p in prompts]
        return super().generate(prompts, **sampling)


def test_exact_match_of_a_multi_turn_chat_is_the_reply_to_its_last_user_turn():
    """Before, only prompt/completion rows and two-message chats were scored: a multi-turn
    chat gave no `val_exact_match` at all."""
    from posttrain.workflows.own_data import HeldOut

    policy = Policy.from_spec("tiny-1m", seed=0)
    chat = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": "4"},
    ]
    after_tool = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "call clock"},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "noon"},
    ]
    rows = [{"messages": chat}, {"messages": after_tool}, {"messages": chat[1:3]}]
    held = HeldOut(rows, "sft", policy.tokenizer, max_seq_len=64, max_new_tokens=2, batch_size=2)
    sampler = Recorder(policy, ["4 ", "3"])  # the chat's reply is right, the short one's wrong
    assert held.exact_match(sampler) == 0.5  # the reply after a tool turn is not scored
    # the prompt is the whole conversation before the last assistant turn, as rendered in training
    assert sampler.prompts == [
        policy.tokenizer.render_prompt(chat[:-1]),
        policy.tokenizer.render_prompt(chat[1:2]),
    ]
    assert set(held.metrics(policy.model, policy.spec)) == {"val_loss", "val_exact_match"}
