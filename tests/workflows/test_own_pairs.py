"""Own preference data in one try: `posttrain run dpo data.train=pairs.parquet` and `posttrain
run reward_model data.train=...` train on the user's pairs (TRL's standard and conversational
forms) instead of pairs sampled from a policy, hold prompts out, and report the held-out
preference metrics every `eval.every` steps and before and after training. KTO takes TRL's
unpaired rows; the other losses refuse them by name. Runs are tiny-1m, two steps."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from posttrain import cli
from posttrain.models import ByteTokenizer
from posttrain.policy.policy import Policy
from posttrain.workflows import BatchOptimConfig, DataConfig
from posttrain.workflows.config import ModelConfig
from posttrain.workflows.own_pairs import own_pairs
from posttrain.workflows.preference import PreferenceRunConfig, run_preference

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [
    {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
    for a in range(5)
    for b in range(4)
]
SIZE = ["optim.steps=2", "optim.batch_size=4", "optim.warmup_steps=0", "progress=false"]


def _conversational(row: dict) -> dict:
    """TRL's conversational form of a standard (prompt, chosen, rejected) row."""
    return {
        "prompt": [{"role": "user", "content": row["prompt"]}],
        "chosen": [{"role": "assistant", "content": row["chosen"]}],
        "rejected": [{"role": "assistant", "content": row["rejected"]}],
    }


def _error(capsys, argv):
    with pytest.raises(SystemExit):
        cli.main(argv)
    return capsys.readouterr().err


def test_dpo_trains_on_own_pairs_from_the_command_line(tmp_path, monkeypatch, capsys):
    """Before: `data.train` was no key of the dpo recipe (a usage error)."""
    monkeypatch.chdir(tmp_path)
    pd.DataFrame(PAIRS).to_parquet("pairs.parquet")
    argv = ["run", "dpo", "data.train=pairs.parquet", "eval.every=1", "sft.steps=1"]
    assert cli.main([*argv, "sft.batch_size=4", *SIZE, "out_dir=run"]) == 0
    run = tmp_path / "run"
    results = json.loads((run / "results.json").read_text())
    assert results["dataset"] == "pairs.parquet (preference rows)"
    assert results["train_samples"] == 18 and results["val_samples"] == 2  # 0.1 of 20 prompts
    validation = results["validation"]
    names = {"val_loss", "val_chosen_reward", "val_rejected_reward", "val_reward_margin"}
    assert set(validation["before"]) == set(validation["after"]) == names | {"val_reward_accuracy"}
    # before training the policy is its reference: every implicit reward is 0, the loss log 2
    assert validation["before"]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert not {"before", "after", "pairs", "task_config"} & set(results)  # no task items
    # the reference: the SFT warm start on the training pairs' chosen responses
    sft = json.loads((run / "sft" / "results.json").read_text())
    assert sft["data"]["rows"] == 18 and sft["dataset"] == "a list (chat rows)"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics if "eval/val_reward_accuracy" in m] == [1, 2]
    assert metrics[-1]["eval/val_loss"] == pytest.approx(validation["after"]["val_loss"], 1e-6)
    report = (run / "results.md").read_text()
    assert "| held-out pairs (2) | loss | chosen_reward |" in report


def test_reward_model_trains_on_own_conversational_pairs(tmp_path, monkeypatch):
    """Before: `data.train` was no key of the reward_model recipe."""
    monkeypatch.chdir(tmp_path)
    Policy.from_spec("tiny-1m", seed=0).save(tmp_path / "start")
    rows = [_conversational(r) for r in PAIRS]
    pd.DataFrame(rows).to_json("pairs.jsonl", orient="records", lines=True)
    argv = ["run", "reward_model", "data.train=pairs.jsonl", "data.eval_fraction=0.2"]
    options = ["model.init_from=start", "eval.every=1", *SIZE, "out_dir=rm"]
    assert cli.main([*argv, *options]) == 0
    results = json.loads((tmp_path / "rm" / "results.json").read_text())
    assert results["dataset"] == "pairs.jsonl (preference rows)"
    assert (results["num_train_pairs"], results["num_held_out_pairs"]) == (16, 4)
    assert results["before"]["num_pairs"] == results["after"]["num_pairs"] == 4
    assert "pairs" not in results and not (tmp_path / "rm" / "sft").exists()  # init_from
    metrics = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").open()]
    evals = [m for m in metrics if "eval/pairwise_accuracy" in m]
    assert [m["step"] for m in evals] == [1, 2]
    assert evals[-1]["eval/pairwise_accuracy"] == results["after"]["accuracy"]


def _response_logps(policy: Policy, prompt: str, response: str) -> float:
    """Summed log-prob of the assistant turn (its end-of-turn token included) after `prompt`,
    each token read from a plain forward of the one rendered sequence."""
    prefix = policy.tokenizer.render_prompt([{"role": "user", "content": prompt}])
    rendered = policy.tokenizer.render_chat(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    )
    ids = rendered.input_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(policy.model(torch.tensor([ids]))[0].double(), dim=-1)
    return sum(
        float(logprobs[t - 1, ids[t]])
        for t in range(len(prefix), len(ids))
        if rendered.loss_mask[t]
    )


def test_held_out_reward_accuracy_is_trls_on_a_hand_built_case(tmp_path):
    """TRL's DPOTrainer: rewards r = beta * (log pi(y|x) - log pi_ref(y|x)), accuracy the share
    of pairs with r_chosen > r_rejected, loss -log sigmoid(r_chosen - r_rejected). Recomputed
    here from plain forwards of the trained policy and of the reference (model.init_from: TRL's
    reference is the model training starts from) on four held-out pairs in TRL's
    conversational form."""
    start = tmp_path / "start"
    Policy.from_spec("tiny-1m", seed=0).save(start)
    held = [
        {"prompt": "7+7=", "chosen": "14", "rejected": "15"},
        {"prompt": "9+1=", "chosen": "10", "rejected": "11"},
        {"prompt": "6+3=", "chosen": "9", "rejected": "99"},
        {"prompt": "8+8=", "chosen": "16", "rejected": "61"},
    ]
    cfg = PreferenceRunConfig(
        data=DataConfig(train=[_conversational(r) for r in PAIRS], eval=pd.DataFrame(held)),
        model=ModelConfig(init_from=str(start)),
        optim=BatchOptimConfig(steps=2, batch_size=4, warmup_steps=0, lr=3e-3),
        out_dir=str(tmp_path / "run"),
        progress=False,
    )
    after = run_preference(cfg)["validation"]["after"]
    policy, reference = (
        Policy.from_pretrained(tmp_path / "run" / "policy"),
        Policy.from_pretrained(start),
    )
    policy.model.eval()
    reference.model.eval()
    beta = 0.1
    margins, chosen_rewards = [], []
    for r in held:
        chosen = beta * (
            _response_logps(policy, r["prompt"], r["chosen"])
            - _response_logps(reference, r["prompt"], r["chosen"])
        )
        rejected = beta * (
            _response_logps(policy, r["prompt"], r["rejected"])
            - _response_logps(reference, r["prompt"], r["rejected"])
        )
        margins.append(chosen - rejected)
        chosen_rewards.append(chosen)
    assert min(abs(m) for m in margins) > 1e-4  # no pair is a near tie: the accuracy is stable
    accuracy = sum(m > 0 for m in margins) / len(held)
    loss = sum(math.log1p(math.exp(-m)) for m in margins) / len(held)
    assert after["val_reward_accuracy"] == accuracy
    assert after["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert after["val_chosen_reward"] == pytest.approx(sum(chosen_rewards) / 4, rel=1e-4, abs=1e-7)
    assert after["val_reward_margin"] == pytest.approx(sum(margins) / 4, rel=1e-4, abs=1e-7)


def test_kto_takes_unpaired_rows_and_the_pair_losses_refuse_them(tmp_path, capsys):
    unpaired = [
        {"prompt": f"{a}+1=", "completion": str(a + 1 + (a % 2)), "label": a % 2 == 0}
        for a in range(10)
    ]
    own = own_pairs(
        DataConfig(train=unpaired, eval_fraction=0.2), ByteTokenizer(), max_seq_len=64, kto=True
    )
    assert own.kind == "unpaired_preference"
    assert (len(own.train), len(own.held)) == (8, 2)
    # the warm start learns the desirable training completions only, each after its prompt
    held_desirable = sum(item["desirable"] for item in own.held.items)
    assert len(own.demonstrations) == sum(r["label"] for r in unpaired) - held_desirable
    replies = {(r["prompt"], r["completion"]) for r in unpaired if r["label"]}
    assert {
        (d["messages"][0]["content"], d["messages"][1]["content"]) for d in own.demonstrations
    } <= replies

    pd.DataFrame(unpaired).to_json(tmp_path / "kto.jsonl", orient="records", lines=True)
    err = _error(capsys, ["run", "dpo", f"data.train={tmp_path / 'kto.jsonl'}", "out_dir=x"])
    assert "unpaired_preference rows, which loss=kto takes" in err
    assert "preference (columns prompt, chosen, rejected)" in err
    sft_rows = tmp_path / "sft.jsonl"
    sft_rows.write_text('{"prompt": "1+1=", "completion": "2"}\n')
    err = _error(capsys, ["run", "dpo", "loss=kto", f"data.train={sft_rows}", "out_dir=x"])
    assert "loss=kto takes preference (columns prompt, chosen, rejected) or " in err
    assert "unpaired_preference (columns prompt, completion, label)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kto.jsonl", "sft.jsonl"]


def test_held_out_pairs_are_whole_prompts():
    """Several pairs of one prompt are held out together: no held-out prompt is trained on."""
    rows = [{**r, "rejected": r["rejected"] + x} for r in PAIRS[:10] for x in ("", "0", "9")]
    data = DataConfig(train=rows, eval_fraction=0.3)
    train, held, _ = data.records(("preference",), group_of=lambda r: r["prompt"])
    assert len({r["prompt"] for r in held}) == 3 and len(held) == 9  # 3 of 10 prompts, 3 each
    assert {r["prompt"] for r in held}.isdisjoint(r["prompt"] for r in train)
    own = own_pairs(data, ByteTokenizer(), max_seq_len=64, kto=False)
    assert (len(own.train), len(own.held)) == (21, 9)
