"""A recipe's task data: the held-out items and their greedy evaluation (`held_out_items`,
`evaluate`), the SFT/CPT training set (`build_dataset`), the reasoning-gym task that RL and
preference pairs draw their prompts from (`training_task`), and the checks that the data fits
the config before a run writes anything (`check_seq_len` needs no data; `check_task_fits`
generates a few items).

Held-out items: `task.eval_size` distinct questions generated from `task.eval_seed`; every
training set (SFT rows, RL prompts, pair prompts) drops every one of those questions.

Example:
    >>> from posttrain.workflows.config import TaskConfig
    >>> items, scorer = held_out_items(TaskConfig(eval_size=3))
    >>> len(items), len({it["question"] for it in items})
    (3, 3)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.data.rows import BadRowError
from posttrain.data.sft import (
    CPTDataset,
    SFTDataset,
    load_sft_rows,
    load_text_documents,
    reasoning_gym_sft_rows,
)
from posttrain.models.tokenizer import Tokenizer
from posttrain.policy.policy import Policy
from posttrain.rewards.evaluation import EvalResult, evaluate_generations
from posttrain.verifiers.reasoning_gym import task_score
from posttrain.verifiers.reasoning_gym_gold import GoldReport, check_gold
from posttrain.workflows.config import ROOT, TaskConfig, fail
from posttrain.workflows.task_checks import check_gym_task, check_seq_len

if TYPE_CHECKING:
    from reasoning_gym.dataset import ProceduralDataset  # the task's items and scorer

    from posttrain.policy.rollout_engine import RolloutEngine

__all__ = [
    "PROBE_ITEMS",
    "check_seq_len",
    "check_gym_task",
    "held_out_items",
    "build_dataset",
    "training_task",
    "check_task_fits",
    "evaluate",
]

PROBE_ITEMS = 64
"""Training items (the first ones the run trains on) whose lengths `check_task_fits` measures."""


def _reasoning_gym(task: TaskConfig, size: int, seed: int) -> ProceduralDataset:
    import reasoning_gym

    return reasoning_gym.create_dataset(task.name, size=size, seed=seed, **task.options)


def held_out_items(task: TaskConfig) -> tuple[list[dict], ProceduralDataset]:
    """`task.eval_size` distinct task items from `task.eval_seed` and the task dataset (its
    scorer).

    The training set drops every row whose question is among these, so the evaluation is held
    out even on small tasks whose question space the training set covers (2-term, 1-2 digit
    chain_sum has about 8k distinct questions). Items whose upstream gold fails its check
    (`posttrain.verifiers.reasoning_gym_gold.check_gold`) are skipped, as the RL task skips them.
    """
    ds = _reasoning_gym(task, size=4 * task.eval_size + 100, seed=task.eval_seed)
    items, seen = [], set()
    for item in check_gold(task.name, ds, ds):
        if item["question"] not in seen:
            seen.add(item["question"])
            items.append(item)
    if len(items) < task.eval_size:
        raise ValueError(
            f"{task.name} gave only {len(items)} distinct questions for "
            f"task.eval_size={task.eval_size}; lower task.eval_size"
        )
    return items[: task.eval_size], ds


def build_dataset(
    cfg: Any,
    tokenizer: Tokenizer,
    exclude: set[str],
    gold: GoldReport | None = None,
    *,
    size: int | None = None,
) -> tuple[SFTDataset | CPTDataset, int]:
    """The training dataset of `cfg` (SFTDataset or CPTDataset) without questions in `exclude`,
    and the number of rows dropped for that. Items of a reasoning-gym task whose upstream gold
    fails its check are not trained on; they are counted in `gold` (a `GoldReport`; a new one
    when None), as the RL task counts them. `size`: the first `size` rows only (a probe)."""
    task, dataset_cls = cfg.task, SFTDataset if cfg.mode == "sft" else CPTDataset
    if task.is_file:
        rows = load_sft_rows(task.name) if cfg.mode == "sft" else load_text_documents(task.name)
        return dataset_cls(rows[:size], tokenizer, max_seq_len=cfg.max_seq_len), 0
    gold = GoldReport(task.name) if gold is None else gold
    train_size = task.train_size if size is None else min(size, task.train_size)
    rows = reasoning_gym_sft_rows(
        task.name,
        size=train_size,
        seed=cfg.seed,
        item_filter=lambda ds, items: check_gold(task.name, ds, items, gold),
        **task.train_options,  # the demonstrations' options (`task.demo_options`)
    )
    kept = [r for r in rows if r["messages"][0]["content"] not in exclude]
    if not kept:
        raise ValueError("every training row is a held-out question; raise task.train_size")
    examples: list[dict] | list[str] = kept
    if cfg.mode == "cpt":
        examples = [f"{r['messages'][0]['content']} {r['messages'][1]['content']}" for r in kept]
    return dataset_cls(examples, tokenizer, max_seq_len=cfg.max_seq_len), len(rows) - len(kept)


def check_task_fits(cfg: Any, at: str = ROOT) -> None:
    """What a recipe config asks of its task's data, checked after `validate(cfg)` and before
    the run writes anything (`RecipeRun.start` calls it between the two):

      * `task.eval_size` distinct held-out questions exist (`held_out_items`);
      * every held-out prompt, rendered as evaluation renders it, leaves room in `cfg.model`
        for `eval.max_new_tokens`, and the first `PROBE_ITEMS` training prompts (from `seed`,
        or `prompt_seed` where the config has one) for `sampling.max_new_tokens`;
      * SFT/CPT (a config with `mode`): `max_seq_len` keeps a trained token of one of the
        first `PROBE_ITEMS` training rows at least (longer rows are cut, or dropped and
        counted, when the run builds its dataset);
      * own data (`data.train` set, `posttrain.workflows.own_data`): its rows read, of an
        accepted format, and some keep a trained token within `max_seq_len` (the config's
        `check_own_data(tokenizer)` where it has one: the pair recipes); nothing else;
      * preference pairs (a config with `max_seq_len` and `pairs`): `max_seq_len` holds the
        longest of those prompts with a full `sampling.max_new_tokens` answer (or the task's
        own answer, with `pairs.reference_answer`) and the end of the turn.

    Bounds that need no data (types, ranges, the model's own limit) are the config's own
    `check` (`check_seq_len`). Lengths are token counts of `cfg.model`'s tokenizer.

    Raises:
        ValueError: naming the dotted field, its allowed bound and the lengths measured.
    """
    task, model = cfg.task, cfg.model
    limit, tokenizer = model.max_seq_len(), model.tokenizer()
    chat = getattr(cfg, "mode", "sft") == "sft"
    if getattr(getattr(cfg, "data", None), "given", False):
        from posttrain.workflows.own_data import own_data

        check = getattr(cfg, "check_own_data", None)  # a recipe's own reading (pairs)
        if check is not None:
            check(tokenizer)
        else:
            own_data(cfg, tokenizer)  # the rows' source, format and lengths; the task is unused
        return
    if task.eval_size and not task.is_file:
        try:
            items, _ = held_out_items(task)
        except ValueError as e:
            raise ValueError(f"{at}.task.eval_size={task.eval_size}: {e}") from None
        _check_room(
            f"{at}.eval.max_new_tokens",
            cfg.eval.max_new_tokens,
            _prompt_lengths(tokenizer, items, chat),
            limit,
            "held-out prompt",
        )
        _check_not_all_held_out(cfg, at, {it["question"] for it in items})
    if task.is_file:
        if not Path(task.name).is_file():
            raise ValueError(f"{at}.task.name={task.name!r}: no such data file")
        probe = []
    else:
        probe = list(
            _reasoning_gym(
                task,
                size=min(PROBE_ITEMS, task.train_size),
                seed=getattr(cfg, "prompt_seed", cfg.seed),
            )
        )
    sampling = getattr(cfg, "sampling", None)
    if sampling is not None and probe:
        _check_room(
            f"{at}.sampling.max_new_tokens",
            sampling.max_new_tokens,
            _prompt_lengths(tokenizer, probe, chat),
            limit,
            "training prompt",
        )
    if hasattr(cfg, "mode"):
        _check_rows_fit(cfg, at, tokenizer)
    elif hasattr(cfg, "max_seq_len") and hasattr(cfg, "pairs") and probe:
        _check_pairs_fit(cfg, at, tokenizer, probe)


def _check_not_all_held_out(cfg: Any, at: str, held_out: set[str]) -> None:
    """A run's training items (`task.train_size` from `seed`; the warm start's
    `sft.demonstrations`; the reward model's `pairs.num_prompts` from `prompt_seed`) drop the
    held-out questions: up to `PROBE_ITEMS` of them, not every one may be held out."""
    task = cfg.task
    sizes = [("task.train_size", task.train_size, cfg.seed)]
    if getattr(getattr(cfg, "sft", None), "demonstrations", None) is not None:
        sizes.append(("sft.demonstrations", cfg.sft.demonstrations, cfg.seed))
    if hasattr(cfg, "prompt_seed"):
        sizes.append(("pairs.num_prompts", cfg.pairs.num_prompts, cfg.prompt_seed))
    for key, n, seed in sizes:
        if n <= PROBE_ITEMS and all(
            it["question"] in held_out for it in _reasoning_gym(task, size=n, seed=seed)
        ):
            raise fail(
                f"{at}.{key}",
                n,
                f"larger: every one of the first {n} training "
                f"questions is a held-out one (task.eval_seed={task.eval_seed} draws "
                "the held-out split; another eval_seed keeps them apart)",
            )


def _prompt_lengths(tokenizer: Tokenizer, items: list[dict], chat: bool) -> list[int]:
    """Token counts of the items' questions as `generate_for_items` renders them."""
    if chat:
        return [
            len(tokenizer.render_prompt([{"role": "user", "content": it["question"]}]))
            for it in items
        ]
    return [len(tokenizer.encode(it["question"], add_bos=True)) for it in items]


def _check_room(
    name: str, new_tokens: int, lengths: list[int], limit: int | None, what: str
) -> None:
    longest = max(lengths, default=0)
    if limit is not None and longest + new_tokens > limit:
        raise fail(
            name,
            new_tokens,
            f"at most {limit - longest}: the longest {what} has "
            f"{longest} tokens and the model holds {limit}",
        )


def _check_rows_fit(cfg: Any, at: str, tokenizer: Tokenizer) -> None:
    try:
        build_dataset(cfg, tokenizer, set(), size=PROBE_ITEMS)
    except BadRowError:
        raise  # a malformed row of a data file: the data's error, not max_seq_len's
    except ValueError as e:
        raise fail(
            f"{at}.max_seq_len",
            cfg.max_seq_len,
            f"larger: no training row keeps a trained token within it ({e})",
        ) from None


def _check_pairs_fit(cfg: Any, at: str, tokenizer: Tokenizer, probe: list[dict]) -> None:
    prompt = [{"role": "user", "content": probe[0]["question"]}]
    end = (
        len(tokenizer.render_chat(prompt + [{"role": "assistant", "content": "x"}]).input_ids)
        - len(tokenizer.render_prompt(prompt))
        - len(tokenizer.encode("x"))
    )
    needed = []
    for item, length in zip(probe, _prompt_lengths(tokenizer, probe, chat=True)):
        answer = len(tokenizer.encode(str(item["answer"]))) if cfg.pairs.reference_answer else 0
        needed.append(length + max(cfg.sampling.max_new_tokens, answer) + max(end, 1))
    if max(needed) > cfg.max_seq_len:
        raise fail(
            f"{at}.max_seq_len",
            cfg.max_seq_len,
            f"at least {max(needed)}: the longest of "
            f"the first {len(probe)} training prompts with an answer of "
            f"sampling.max_new_tokens={cfg.sampling.max_new_tokens} tokens"
            f"{' (or the task answer)' if cfg.pairs.reference_answer else ''} and the "
            "end of the turn",
        )


def evaluate(
    policy: Policy | RolloutEngine,
    items: list[dict],
    ds: ProceduralDataset,
    *,
    max_new_tokens: int,
    chat: bool = True,
) -> EvalResult:
    """Greedy held-out accuracy scored by the task dataset `ds`, sampled by `policy` (a
    `Policy`, or a rollout engine: `evaluate_generations`). A CPT model saw "question
    answer" as plain text, so it is evaluated with `chat=False` (it continues the raw question)."""
    return evaluate_generations(
        policy,
        items,
        max_new_tokens=max_new_tokens,
        chat=chat,
        score_fn=lambda text, item: task_score(ds, text.strip(), item),
    )


def training_task(cfg: Any, *, size: int, seed: int, held_out: list[dict] | None = None) -> Any:
    """The reasoning-gym task `cfg.task` names, as a `ReasoningGymTask` of `size` items from
    `seed` without the held-out questions (`task.eval_size` from `task.eval_seed`): the prompts
    of RL and of preference pairs, scored by its verifier. `held_out`: the items the SFT stage
    held out (`held_out_items`), which the task's own split must equal.

    Raises:
        RuntimeError: if the task's held-out items differ from `held_out`.
    """
    from posttrain.envs.reasoning_gym_env import ReasoningGymTask

    task = ReasoningGymTask(
        name=cfg.task.name,
        size=size,
        seed=seed,
        config=dict(cfg.task.options),
        held_out_size=cfg.task.eval_size,
        held_out_seed=cfg.task.eval_seed,
    )
    if held_out is not None and (
        [it["question"] for it in task.held_out()] != [it["question"] for it in held_out]
    ):
        raise RuntimeError("the task's held-out items differ from the SFT stage's")
    return task
