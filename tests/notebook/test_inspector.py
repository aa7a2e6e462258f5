"""posttrain.notebook.inspector on hand-built groups with known values: frames and filters,
save/load, rescoring with an edited verifier, compare_rewards, replay_step."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from _figure_helpers import pyplot_untouched
from matplotlib.figure import Figure

from posttrain.models import ByteTokenizer
from posttrain.notebook import (
    FRAME_COLUMNS,
    RESCORE_COLUMNS,
    TOKEN_COLUMNS,
    compare_rewards,
    load_rollouts,
    replay_step,
    rescore,
    rollouts_frame,
    save_rollouts,
    to_groups,
)
from posttrain.rewards import VerifierResult
from posttrain.rl import Group, ReplayBuffer, Trajectory

TOK = ByteTokenizer()
ITEMS = [
    {"question": "3+4=", "answer": "7", "metadata": {"terms": [3, 4]}},
    {"question": "10-8=", "answer": "2", "metadata": {"terms": [10, -8]}},
]


def traj(group_id, text, reward, outcome, *, version=0, info=None, mask=None, extra=0):
    """A trajectory whose completion is `text` in bytes (+ `extra` observation tokens)."""
    ids = TOK.encode(text) + [TOK.END] * extra
    prompt = TOK.render_prompt([{"role": "user", "content": ITEMS[group_id]["question"]}])
    return Trajectory(
        group_id=group_id,
        prompt_ids=prompt,
        completion_ids=ids,
        logprobs=[-0.25 * (k + 1) for k in range(len(ids))],
        reward=reward,
        outcome=outcome,
        finish_reason="stop",
        text=text,
        policy_version=version,
        info=info or {},
        completion_mask=mask,
    )


def groups():
    """Rows 0-5: rewards [1, 0, 0, 1, 0, 0]; outcomes ok, wrong, format_error, ok, wrong, error;
    num_tokens 1, 3, 0, 1, 3, 2 (row 5 has 2 sampled + 1 observation token)."""
    return [
        Group(
            [
                traj(0, "7", 1.0, "ok", version=3),
                traj(0, "7.0", 0.0, "wrong", version=3, info={"verifier_reason": "expected 7"}),
                traj(0, "", 0.0, "format_error", version=3),
            ]
        ),
        Group(
            [
                traj(1, "2", 1.0, "ok", version=3),
                traj(1, "two", 0.0, "wrong", version=3),
                traj(
                    1,
                    "2 ",
                    0.0,
                    "error",
                    version=3,
                    info={"error": "env raised"},
                    mask=[True, True, False],
                    extra=1,
                ),
            ]
        ),
    ]


def exact(completion, item):
    text = completion.strip()
    if not text:
        return VerifierResult.failure("format_error", "empty")
    return 1.0 if text == item["answer"] else 0.0


def lenient(completion, item):
    """`exact`, edited to accept any number equal to the answer ("7.0" for 7)."""
    text = completion.strip()
    if not text:
        return VerifierResult.failure("format_error", "empty")
    try:
        return float(float(text) == float(item["answer"]))
    except ValueError:
        return 0.0


# ------------------------------------------------------------------ frames and filters


def test_frame_columns_and_values():
    frame = rollouts_frame(groups(), items=ITEMS)
    assert tuple(frame.columns) == FRAME_COLUMNS and frame.index.name == "row"
    assert frame["group_id"].tolist() == [0, 0, 0, 1, 1, 1]
    assert frame["sample"].tolist() == [0, 1, 2, 0, 1, 2]
    assert frame["prompt"].tolist() == ["3+4="] * 3 + ["10-8="] * 3
    assert frame["answer"].tolist() == ["7"] * 3 + ["2"] * 3
    assert frame["reward"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert frame["num_tokens"].tolist() == [1, 3, 0, 1, 3, 2]
    assert frame["reason"].tolist() == ["", "expected 7", "", "", "", "env raised"]
    assert frame["policy_version"].tolist() == [3] * 6
    assert frame["advantage"].isna().all() and frame.loc[5, "item"] == ITEMS[1]
    # Without items, a tokenizer gives the prompt text (special tokens dropped).
    assert rollouts_frame(groups(), tokenizer=TOK)["prompt"].tolist()[0] == "3+4="
    assert rollouts_frame(groups())["prompt"].isna().all()


def test_prompt_records_give_their_prompt_text():
    # A PromptTask record names its prompt "prompt", not "question"; a conversational one holds
    # messages, shown as the last user turn's text.
    chat = {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+0="}],
        "answer": "2",
    }
    frame = rollouts_frame(groups(), items=[{"prompt": "3+4=", "answer": "7"}, chat])
    assert frame["prompt"].tolist() == ["3+4="] * 3 + ["2+0="] * 3
    assert frame["answer"].tolist() == ["7"] * 3 + ["2"] * 3


@pytest.mark.parametrize(
    "filters, rows",
    [
        (dict(min_reward=0.5), [0, 3]),
        (dict(max_reward=0.0), [1, 2, 4, 5]),
        (dict(outcome="wrong"), [1, 4]),
        (dict(outcome=["ok", "error"]), [0, 3, 5]),
        (dict(min_len=2), [1, 4, 5]),
        (dict(max_len=1), [0, 2, 3]),
        (dict(min_len=1, max_len=2, max_reward=0.0), [5]),
    ],
)
def test_filters_keep_the_rows_of_the_full_frame(filters, rows):
    frame = rollouts_frame(groups(), **filters)
    assert frame.index.tolist() == rows
    again = rollouts_frame(rollouts_frame(groups()), **filters)  # a frame filters the same way
    assert again.index.tolist() == rows


def test_bad_filters_and_sources():
    with pytest.raises(ValueError, match="unknown outcome.*'ok'"):
        rollouts_frame(groups(), outcome="correct")
    with pytest.raises(ValueError, match="1 items for 2 groups"):
        rollouts_frame(groups(), items=ITEMS[:1])
    with pytest.raises(TypeError, match="cannot read rollouts from a int"):
        rollouts_frame(3)


def test_buffer_source_and_items_by_group_id():
    buffer = ReplayBuffer(mode="off_policy")
    buffer.add(groups(), advantages=[0.5, -0.5, 0.0, 1.0, [-1.0, -0.5, 0.0], 0.0])
    frame = rollouts_frame(buffer, items={0: ITEMS[0], 1: ITEMS[1]})
    assert frame["advantage"].tolist() == [0.5, -0.5, 0.0, 1.0, -0.5, 0.0]
    assert frame["reward"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert frame["num_tokens"].tolist() == [1, 3, 0, 1, 3, 2]
    assert frame["prompt"].tolist()[3] == "10-8="


# ------------------------------------------------------------------ save / load / to_groups


def test_save_load_round_trip(tmp_path):
    path = tmp_path / "rollouts" / "step3.jsonl"
    assert save_rollouts(groups(), path, items=ITEMS) == 6
    loaded = load_rollouts(path)
    expected = rollouts_frame(groups(), items=ITEMS, tokens=True)
    pd.testing.assert_frame_equal(loaded, expected)
    assert tuple(loaded.columns) == FRAME_COLUMNS + TOKEN_COLUMNS
    assert to_groups(loaded) == groups()  # every Trajectory field, exactly (logprobs too)
    assert to_groups(path) == groups()
    # Rescoring a saved file needs neither the task nor a tokenizer.
    assert rescore(path, exact, timeout_s=None)["new_outcome"].tolist()[:3] == [
        "ok",
        "wrong",
        "format_error",
    ]

    assert save_rollouts(groups(), path, items=ITEMS, append=True) == 6
    assert len(load_rollouts(path)) == 12
    record = json.loads(path.read_text().splitlines()[0])
    assert record["rollouts_format"] == 1 and record["advantage"] is None


def test_load_rejects_other_formats(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"rollouts_format": 99}) + "\n")
    with pytest.raises(ValueError, match="rollouts_format 99"):
        load_rollouts(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="r.jsonl:1 is not JSON"):
        load_rollouts(path)
    with pytest.raises(FileNotFoundError):
        load_rollouts(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no \\['prompt_ids'"):
        to_groups(rollouts_frame(groups()))


# ------------------------------------------------------------------ rescore / compare


def test_rescore_with_an_edited_verifier_changes_exactly_the_expected_rows():
    frame = rollouts_frame(groups(), items=ITEMS)
    same = rescore(frame, exact)  # the verifier the rollouts were scored with
    assert tuple(same.columns) == RESCORE_COLUMNS
    assert same["changed"].tolist() == [False] * 5 + [True]  # row 5 was an env error
    edited = rescore(frame, lenient)
    assert edited["changed"].tolist() == [False, True, False, False, False, True]
    assert edited["new_outcome"].tolist() == ["ok", "ok", "format_error", "ok", "wrong", "ok"]
    assert edited["new_reward"].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert edited["old_outcome"].tolist() == frame["outcome"].tolist()
    # A filtered frame rescored keeps its row labels.
    assert rescore(frame[frame.outcome == "wrong"], lenient).index.tolist() == [1, 4]


def test_a_raising_verifier_gives_error_rows_not_zero_rewards():
    def broken(completion, item):
        return item["solution"]  # KeyError: the edit used a field the items do not have

    result = rescore(groups(), broken, items=ITEMS, timeout_s=30.0)
    assert result["new_outcome"].tolist() == ["error"] * 6
    assert result["new_reward"].tolist() == [0.0] * 6
    assert result["new_reason"].str.startswith("KeyError").all()
    with pytest.raises(ValueError, match="have no task item"):
        rescore(groups(), exact)


def test_compare_rewards_summary_by_hand():
    """Before: rewards [1,0,0,1,0,0], outcomes ok 2, wrong 2, format_error 1, error 1: the
    error row has no reward, so the mean is over the 5 judged rows, 2/5 (accuracy 2/6). After
    `lenient`: rewards [1,1,0,1,0,1] (mean 4/6), ok 4, wrong 1, format_error 1, error 0
    (accuracy 4/6). Two rows changed."""
    with pyplot_untouched():
        summary, fig = compare_rewards(rescore(groups(), lenient, items=ITEMS))
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    s = summary.to_dict("index")
    assert s["rows"] == {"before": 6.0, "after": 6.0, "change": 0.0}
    assert s["reward_mean"]["before"] == pytest.approx(2 / 5)
    assert s["reward_mean"]["after"] == pytest.approx(2 / 3)
    assert s["reward_mean"]["change"] == pytest.approx(2 / 3 - 2 / 5)
    assert s["accuracy"]["before"] == pytest.approx(2 / 6)
    assert s["accuracy"]["change"] == pytest.approx(2 / 6)
    assert [
        s[f"outcome_{o}"]["before"] for o in ("ok", "wrong", "format_error", "timeout", "error")
    ] == [2, 2, 1, 0, 1]
    assert [
        s[f"outcome_{o}"]["after"] for o in ("ok", "wrong", "format_error", "timeout", "error")
    ] == [4, 1, 1, 0, 0]
    assert s["rows_changed"]["change"] == 2 and math.isnan(s["rows_changed"]["before"])

    # Unpaired: two sets of rollouts (e.g. two steps): [1 ok, 0 wrong, 0 format_error] has mean
    # 1/3; [1 ok, 0 wrong, error] has mean 1/2 over its two judged rows.
    summary, _ = compare_rewards(groups()[:1], groups()[1:])
    assert summary.loc["reward_mean"].tolist() == pytest.approx([1 / 3, 1 / 2, 1 / 6])
    assert summary.loc["outcome_error", "after"] == 1 and "rows_changed" not in summary.index
    with pytest.raises(ValueError, match="needs a rescore"):
        compare_rewards(rollouts_frame(groups()))


# ------------------------------------------------------------------ replay


class FakeRLTrainer:
    """The seam replay_step calls: train_on_groups(groups) -> row."""

    def __init__(self):
        self.policy = type("P", (), {"tokenizer": TOK})()
        self.seen = None

    def train_on_groups(self, groups):
        self.seen = groups
        return {"step": 1, "groups_kept": len(groups)}


def test_replay_step_feeds_saved_groups_to_the_trainer_seam(tmp_path):
    save_rollouts(groups(), tmp_path / "r.jsonl", items=ITEMS)
    trainer = FakeRLTrainer()
    assert replay_step(trainer, tmp_path / "r.jsonl") == {"step": 1, "groups_kept": 2}
    assert trainer.seen == groups()
    bad = groups()
    bad[0].trajectories[0].completion_ids[0] = 999
    with pytest.raises(ValueError, match="token id 999, outside this policy's vocabulary"):
        replay_step(trainer, bad)


def _rl_trainer():
    from posttrain.envs import chain_sum_task
    from posttrain.policy import Policy
    from posttrain.rl import RLAlgorithm, RLTrainer

    policy = Policy.from_spec("tiny-1m", seed=0)
    return RLTrainer(
        policy,
        torch.optim.AdamW(policy.model.parameters(), lr=1e-3),
        task=chain_sum_task(size=16, held_out_size=2),
        algo=RLAlgorithm.grpo(group_size=4, kl_coef=0.0),
        prompts_per_step=2,
        max_new_tokens=4,
        progress=False,
        seed=0,
    )


def test_replay_step_on_an_rl_trainer(tmp_path):
    """Replaying a saved file trains exactly as training on the groups themselves (bit for
    bit); an object without the seam gets a TypeError naming it."""
    from posttrain.rl import collect_groups

    with pytest.raises(TypeError, match="train_on_groups"):
        replay_step(object(), groups())
    trainer = _rl_trainer()
    sampled = collect_groups(
        trainer.policy, trainer.task.builders(0, 2), group_size=4, max_new_tokens=4, seed=0
    )
    for group in sampled:  # a fresh policy never answers right: give the groups a signal
        group.trajectories[0].reward, group.trajectories[0].outcome = 1.0, "ok"
    save_rollouts(sampled, tmp_path / "r.jsonl")
    row = trainer.train_on_groups(sampled)
    twin = _rl_trainer()
    replayed = replay_step(twin, tmp_path / "r.jsonl")
    assert row["grad_norm"] > 0 and row["groups_zero_signal"] == 0
    for key in ("loss", "reward_mean", "grad_norm", "accuracy", "step"):
        assert replayed[key] == row[key], key
    for a, b in zip(trainer.policy.model.parameters(), twin.policy.model.parameters()):
        assert torch.equal(a, b)
