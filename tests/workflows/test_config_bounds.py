"""Every field of every recipe's Config has its bounds checked before a run writes anything.

The walk (`test_every_bad_value_fails_in_validation`): for each recipe and each leaf key of its
Config at TINY size, values of the wrong kind for the field's type (from its annotation):

    int      -1, 0, 1 (until one is accepted: that is the field's lower bound), 1.5, "x", True;
             lengths (max_seq_len, max_new_tokens) also 10**6 float    -1.0, 0.0 (likewise), nan,
             inf, "x", True bool     "x", 2, None str      an unknown name, "", 3, None (None only
             where the field is not Optional) dict     "x", {"bogus": 1}           list / tuple
             "x", [], [1]

Each must fail in validation (`override`, i.e. the Config's `__post_init__`) with a ValueError
or TypeError whose message names the field (`Config.<key>`), or be a value the field documents:
the table
`ACCEPTED` (key -> the accepted boundary value), written by hand from the docs. Every accepted
value is then run: it is in the recipe's TINY overrides or in one of its `EDGE` runs
(`test_accepted_boundary_values_run`, checked complete by `test_every_accepted_value_is_run`).

Bounds that need the task's data (a held-out split larger than the task has questions, a prompt
that leaves no room for `max_new_tokens`, a `max_seq_len` no training row fits) fail in
`check_task_fits` before `start_run`: `test_data_bounds_fail_before_the_run_folder_exists`
asserts the field is named and no run folder exists.
"""

from __future__ import annotations

import math
import re
import typing

import pytest

from posttrain import cli
from posttrain.workflows import config_keys, override
from posttrain.workflows.recipes import config_annotation

RECIPES = ["demo", "dpo", "grpo", "ppo", "reward_model", "rft", "sft"]

ACCEPTED = {
    # seeds, folders
    "seed": 0,
    "task.eval_seed": 0,
    "prompt_seed": 0,
    "out_dir": "nope",  # a relative folder
    # trackers: none by default; any name; relative paths (null: in the run folder)
    "logging.trackers": [],
    "logging.experiment": "nope",
    "logging.wandb_dir": "nope",
    "logging.mlflow_tracking_uri": "nope",
    "data.seed": 0,
    # own data: None trains on the task; 0 holds no rows out of data.train
    "data.train": None,
    "data.eval": None,
    "data.eval_fraction": 0.0,
    "data.eval_rows": 1,
    # held-out items: optional for SFT and the reward model, needed where RL / DPO compare
    "task.eval_size": (0, 1),
    # 0 switches off: checkpoints, validation metrics, held-out items (SFT, reward model),
    # sampled evaluation, warmup, weight decay, decay to 0, the more-SFT baseline, KL, smoothing,
    # SimPO's and the reward model's margin, LoRA dropout
    "checkpoint.every": 0,
    "eval.every": 0,
    "eval.samples": 0,
    "optim.warmup_steps": 0,
    "optim.weight_decay": 0.0,
    "optim.min_lr_ratio": 0.0,
    "sft.warmup_steps": 0,
    "sft.weight_decay": 0.0,
    "sft.min_lr_ratio": 0.0,
    "baseline.steps": 0,
    "rl.kl_coef": 0.0,
    "rollout.max_staleness": 0,  # only samples of the current weights
    "label_smoothing": 0.0,
    "simpo_gamma": 0.0,
    "margin": 0.0,
    "adapters.dropout": 0.0,
    "rewards.funcs": [],  # no reward functions: the task's verifier scores
    "rewards.weights": [],  # every function weighs 1.0
    # 1 is the least of a count or length
    "checkpoint.keep_last": 1,
    "eval.max_new_tokens": 1,
    "sampling.max_new_tokens": 1,
    "optim.batch_size": 1,
    "optim.grad_accum_steps": 1,
    "sft.grad_accum_steps": 1,
    "optim.loss_chunk_tokens": 1,  # a chunk of one token (the reward model refuses chunks)
    "sft.loss_chunk_tokens": 1,
    "optim.steps": 1,
    "sft.batch_size": 1,
    "sft.steps": 1,
    "sft.demonstrations": 1,
    "task.train_size": 1,
    "adapters.rank": 1,
    "rollout.kv_cache_gib": 1,
    "rl.max_num_gen_batches": 1,
    "rl.minibatch_size": 1,
    "rl.ppo_epochs": 1,
    "rl.prompts_per_step": 1,
    "rl.group_size": 1,
    "rl.overlong_buffer_len": 0,  # DAPO's overlong punishment off
    "rl.overlong_penalty_factor": 0.0,
    "val_pairs": 1,
    **{f"parallel.{axis}": 1 for axis in ("dp_replicate", "dp_shard", "tp", "sp", "pp", "ep")},
    # rejection-sampling fine-tuning: one round of one prompt and one sample, one kept per prompt
    **{f"rft.{k}": 1 for k in ("rounds", "prompts_per_round", "samples_per_prompt")},
    **{f"rft.{k}": 1 for k in ("max_per_prompt", "steps", "batch_size", "grad_accum_steps")},
    "rft.loss_chunk_tokens": 1,
    **{"rft.warmup_steps": 0, "rft.weight_decay": 0.0, "rft.min_lr_ratio": 0.0},
}
"""The documented value each accepted boundary must be (any other accepted one is a defect);
a tuple: the values one recipe or another takes."""

SHORT = {"optim.steps": 1, "task.eval_size": 1, "eval.max_new_tokens": 1}
"""What keeps an EDGE run short (itself boundary values)."""
WARM = {"sft.steps": 1, "sft.batch_size": 1, "sft.warmup_steps": 0, "sft.min_lr_ratio": 0.0}
LOGGING = {
    k: "nope" for k in ("logging.experiment", "logging.wandb_dir", "logging.mlflow_tracking_uri")
}
"""Tracker options without a tracker: checked, never used (no tracker named)."""
EDGE: dict[str, list[dict]] = {
    "demo": [{"sampling.max_new_tokens": 1, "out_dir": "nope"}],
    "sft": [
        {
            **SHORT,
            **LOGGING,
            "checkpoint.every": 0,
            "task.eval_size": 0,
            "optim.warmup_steps": 0,
            "optim.weight_decay": 0.0,
            "optim.min_lr_ratio": 0.0,
            "optim.batch_size": 1,
            "optim.grad_accum_steps": 1,
            "task.train_size": 1,
            "adapters.method": "lora",
            "adapters.rank": 1,
            "adapters.dropout": 0.0,
            "optim.loss_chunk_tokens": 1,
            "out_dir": "nope",
        },
        {
            **SHORT,
            "checkpoint.every": 1,
            "checkpoint.keep_last": 1,
            "task.eval_seed": 0,
            "data.eval_fraction": 0.0,
            "data.eval_rows": 1,
        },
    ],
    "dpo": [
        {
            **SHORT,
            **LOGGING,
            **WARM,
            "sft.demonstrations": 1,
            "checkpoint.every": 0,
            "eval.every": 0,
            "sampling.max_new_tokens": 1,
            "optim.warmup_steps": 0,
            "optim.weight_decay": 0.0,
            "optim.min_lr_ratio": 0.0,
            "optim.batch_size": 1,
            "optim.grad_accum_steps": 1,
            "val_pairs": 1,
            "eval.samples": 0,
            "label_smoothing": 0.0,
            "adapters.method": "lora",
            "adapters.rank": 1,
            "adapters.dropout": 0.0,
            "optim.loss_chunk_tokens": 1,
            "sft.loss_chunk_tokens": 1,
            "out_dir": "nope",
        },
        {
            **SHORT,
            **WARM,
            "loss": "simpo",
            "simpo_gamma": 0.0,
            "checkpoint.keep_last": 1,
            "task.eval_seed": 0,
            "data.eval_fraction": 0.0,
            "data.eval_rows": 1,
        },
    ],
    "reward_model": [
        {
            **SHORT,
            **LOGGING,
            **WARM,
            "sft.demonstrations": 1,
            "checkpoint.every": 0,
            "eval.every": 0,
            "task.eval_size": 0,
            "sampling.max_new_tokens": 1,
            "optim.warmup_steps": 0,
            "optim.weight_decay": 0.0,
            "optim.min_lr_ratio": 0.0,
            "optim.batch_size": 1,
            "optim.grad_accum_steps": 1,
            "task.train_size": 1,
            "margin": 0.0,
            "prompt_seed": 0,
            "adapters.method": "lora",
            "adapters.rank": 1,
            "adapters.dropout": 0.0,
            "sft.loss_chunk_tokens": 1,
            "out_dir": "nope",
        },
        {
            **SHORT,
            **WARM,
            "checkpoint.every": 1,
            "checkpoint.keep_last": 1,
            "eval.every": 1,
            "task.eval_seed": 0,
            "data.eval_fraction": 0.0,
            "data.eval_rows": 1,
        },
    ],
    "grpo": [
        {
            **SHORT,
            **LOGGING,
            **WARM,
            "sft.demonstrations": 1,
            "checkpoint.every": 0,
            "eval.every": 0,
            "eval.samples": 0,
            "baseline.steps": 0,
            "sampling.max_new_tokens": 1,
            "optim.warmup_steps": 0,
            "optim.weight_decay": 0.0,
            "optim.min_lr_ratio": 0.0,
            "task.train_size": 1,
            "rl.kl_coef": 0.0,
            "rl.max_num_gen_batches": 1,
            "rl.minibatch_size": 1,
            "rl.ppo_epochs": 1,
            "rl.overlong_buffer_len": 0,
            "rl.overlong_penalty_factor": 0.0,
            "rl.prompts_per_step": 1,
            "adapters.method": "lora",
            "adapters.rank": 1,
            "adapters.dropout": 0.0,
            "optim.loss_chunk_tokens": 1,
            "sft.loss_chunk_tokens": 1,
            "out_dir": "nope",
        },
        {
            **SHORT,
            **WARM,
            "checkpoint.every": 1,
            "checkpoint.keep_last": 1,
            "baseline.steps": 1,
            "eval.samples": 0,
            "task.eval_seed": 0,
            "data.eval_fraction": 0.0,  # unused without data.train
            "data.eval_rows": 1,
        },
    ],
    "ppo": [
        {
            **SHORT,
            **LOGGING,
            **WARM,
            "sft.demonstrations": 1,
            "checkpoint.every": 0,
            "eval.every": 0,
            "eval.samples": 0,
            "sampling.max_new_tokens": 1,
            "optim.warmup_steps": 0,
            "optim.weight_decay": 0.0,
            "optim.min_lr_ratio": 0.0,
            "task.train_size": 1,
            "rl.kl_coef": 0.0,
            "rl.max_num_gen_batches": 1,
            "rl.minibatch_size": 1,
            "rl.ppo_epochs": 1,
            "rl.overlong_buffer_len": 0,
            "rl.overlong_penalty_factor": 0.0,
            "adapters.method": "lora",
            "adapters.rank": 1,
            "adapters.dropout": 0.0,
            "optim.loss_chunk_tokens": 1,
            "sft.loss_chunk_tokens": 1,
            "out_dir": "nope",
        },
        {
            **SHORT,
            **WARM,
            "checkpoint.every": 1,
            "checkpoint.keep_last": 1,
            "eval.samples": 0,
            "task.eval_seed": 0,
            "data.eval_fraction": 0.0,  # unused without data.train
            "data.eval_rows": 1,
        },
    ],
    "rft": [
        {
            **LOGGING,
            **WARM,
            "task.eval_size": 1,
            "eval.max_new_tokens": 1,
            "sft.demonstrations": 1,
            "sft.loss_chunk_tokens": 1,
            "checkpoint.every": 0,
            "eval.every": 0,
            "eval.samples": 0,
            "sampling.max_new_tokens": 1,
            "task.train_size": 1,
            "task.eval_seed": 10_000,  # TINY's 0 would hold the one training question out
            **{k: v for k, v in ACCEPTED.items() if k.startswith("rft.")},
            "out_dir": "nope",
        },
    ],
}
"""Runs at TINY size that take every accepted boundary value not already in TINY."""

LENGTHS = ("max_seq_len", "max_new_tokens")


def _tiny(name: str):
    module = cli.load_recipe(name)
    return module, override(module.Config(), getattr(module, "TINY", {}))


def _leaf(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _kinds(annotation) -> tuple[set[type], bool]:
    """The types an annotation names (`int | None` -> {int}, True)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:  # named values: their type's bad values
        return {type(a) for a in args}, False
    if type(None) in args:
        return {typing.get_origin(a) or a for a in args if a is not type(None)}, True
    return {typing.get_origin(annotation) or annotation}, False


def bad_values(key: str, annotation) -> list[tuple[object, bool]]:
    """(value, boundary) pairs for a field: boundary values (-1, 0, 1; -1.0, 0.0) are tried in
    order and the first one accepted ends the row (larger ones are in range)."""
    kinds, optional = _kinds(annotation)
    values: list[tuple[object, bool]] = []
    if int in kinds or float in kinds:
        if float in kinds:
            values += [(-1.0, True), (0.0, True), (math.nan, False), (math.inf, False)]
        else:
            values += [(-1, True), (0, True), (1, True), (1.5, False)]
        values += [("x", False), (True, False)]
        if key.endswith(LENGTHS):
            values.append((10**6, False))
    elif bool in kinds:
        values += [("x", False), (2, False)]
    elif str in kinds:
        values += [("nope", False), ("", False), (3, False)]
    elif dict in kinds:
        values += [("x", False), ({"bogus": 1}, False)]
    elif typing.Any in kinds:  # a data source: a path or an object
        values += [("rows.xlsx", False), (3, False)]
    elif kinds & {list, tuple}:
        values += [("x", False), ([], False), ([1], False)]
    else:
        raise AssertionError(f"{key}: no bad values for {annotation}")
    if not optional and not kinds & {dict}:
        values.append((None, False))
    return values


@pytest.mark.parametrize("name", RECIPES)
def test_every_bad_value_fails_in_validation(name):
    module, cfg = _tiny(name)
    accepted = {}
    for key in config_keys(cfg):
        for value, boundary in bad_values(key, config_annotation(cfg, key)):
            if boundary and key in accepted:
                continue  # the lower bound was found: larger values are in range
            try:
                override(cfg, {key: value})
            except (TypeError, ValueError) as e:
                assert re.search(rf"Config\.{re.escape(key)}(?![\w.])", str(e)), (
                    f"{name} {key}={value!r}: the error does not name the field: {e}"
                )
                continue
            assert key not in accepted, f"{name}: {key} takes {accepted[key]!r} and {value!r}"
            accepted[key] = value
    wrong = {k: v for k, v in accepted.items() if v not in _documented(k)}
    assert not wrong, f"{name} accepts values no doc gives a meaning: {wrong}"


def _documented(key: str) -> tuple:
    value = ACCEPTED.get(key, ())
    return value if isinstance(value, tuple) else (value,)


def _accepted(name: str) -> dict:
    """(key, value) of ACCEPTED that the recipe's validation takes, one key at a time."""
    module, cfg = _tiny(name)
    out = {}
    for key in config_keys(cfg):
        for value in _documented(key):
            try:
                override(cfg, {key: value})
            except (TypeError, ValueError):
                continue
            out[key] = value
            break
    return out


@pytest.mark.parametrize("name", RECIPES)
def test_every_accepted_value_is_run(name):
    """Each accepted boundary value is in the recipe's TINY config or one of its EDGE runs."""
    module, cfg = _tiny(name)
    runs = [{k: _leaf(cfg, k) for k in config_keys(cfg)}, *EDGE[name]]
    missing = {
        k: v
        for k, v in _accepted(name).items()
        if k != "out_dir" and not any(k in run and run[k] == v for run in runs)
    }
    assert not missing, f"{name}: accepted but never run: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("name, index", [(n, i) for n in RECIPES for i in range(len(EDGE[n]))])
def test_accepted_boundary_values_run(name, index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # out_dir "nope" is relative
    module, cfg = _tiny(name)
    edge = {"out_dir": str(tmp_path / "run"), **EDGE[name][index]}
    module.main(override(cfg, edge))
    out = tmp_path / edge["out_dir"]
    assert (out / "policy").is_dir() or (out / "results.json").is_file(), sorted(out.iterdir())


# Bounds that need the task's data: refused by check_task_fits before start_run.
DATA_BOUNDS = [
    ("sft", {"max_seq_len": 8}, r"Config\.max_seq_len=8; must be larger: no training row"),
    (
        "sft",
        {"task.eval_size": 20000},
        r"Config\.task\.eval_size=20000: chain_sum gave only \d+ distinct questions",
    ),
    (
        "sft",
        {"eval.max_new_tokens": 500},
        r"Config\.eval\.max_new_tokens=500; must be at most \d+: the longest held-out prompt",
    ),
    ("sft", {"mode": "cpt", "eval.max_new_tokens": 500}, r"Config\.eval\.max_new_tokens=500"),
    ("dpo", {"max_seq_len": 16}, r"Config\.max_seq_len=16; must be at least \d+"),
    (
        "grpo",
        {"sampling.max_new_tokens": 500},
        r"Config\.sampling\.max_new_tokens=500; must be at most \d+: the longest training prompt",
    ),
    (
        "grpo",
        {"task.eval_seed": 0, "task.train_size": 1, "task.eval_size": 1},
        r"Config\.task\.train_size=1; must be larger: every one of the first 1 training",
    ),
    (
        "dpo",
        {"task.eval_seed": 0, "sft.demonstrations": 2, "task.eval_size": 2},
        r"Config\.sft\.demonstrations=2; must be larger",
    ),
    ("reward_model", {"sampling.max_new_tokens": 480}, r"Config\.sampling\.max_new_tokens=480"),
]


@pytest.mark.parametrize(
    "name, overrides, message", DATA_BOUNDS, ids=[f"{n}-{next(iter(o))}" for n, o, _ in DATA_BOUNDS]
)
def test_data_bounds_fail_before_the_run_folder_exists(name, overrides, message, tmp_path):
    module, cfg = _tiny(name)
    cfg = override(cfg, {"out_dir": str(tmp_path / "run"), **overrides})
    with pytest.raises(ValueError, match=message):
        module.main(cfg)
    assert not (tmp_path / "run").exists()


def test_unusable_sampled_pairs_are_left_out_and_counted():
    """A sampled answer that is only an end token decodes to "" and one of invalid bytes to
    U+FFFD, three bytes: such pairs are data (the DPO and reward-model recipes leave them out,
    counted, before their split), not a failure after the warm start and the sampling."""
    from posttrain.models.tokenizer import ByteTokenizer
    from posttrain.preference.pairs import usable_pairs

    ok = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    empty = {"prompt": "2+2=", "chosen": "4", "rejected": ""}
    tokenizer = ByteTokenizer()
    prompt = len(tokenizer.render_prompt([{"role": "user", "content": "2+2="}]))
    # 4 sampled bytes that are not UTF-8 come back as 4 x U+FFFD = 12 bytes
    wide = {"prompt": "2+2=", "chosen": "4", "rejected": bytes([0xFF] * 4).decode(errors="replace")}
    rows, unusable = usable_pairs([ok, empty, wide, ok], tokenizer, max_seq_len=prompt + 8)
    assert rows == [ok, ok]
    assert unusable == {"empty_response": 1, "overlong": 1}
