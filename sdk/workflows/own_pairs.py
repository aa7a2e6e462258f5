"""Own preference data for the DPO family and the reward model: a recipe's `data:` section
(`posttrain.workflows.own_data.DataConfig`) read as pairs instead of pairs sampled from a policy.

Rows (TRL's dataset types, standard or conversational form):

    preference            prompt, chosen, rejected          every loss, and the reward model
    unpaired_preference   prompt, completion, label (bool)  loss=kto only

`prompt` is a str or a list of {"role", "content"} messages; `chosen`, `rejected` and
`completion` a str or TRL's `[{"role": "assistant", "content": ...}]`. KTO takes either kind:
a pair gives one desirable and one undesirable row (`pairs_to_kto_rows`, as TRL's KTO trainer
unpairs a paired set). The held-out rows are `data.eval`, or `data.eval_fraction` of the
prompts of `data.train` (drawn with `data.seed`) with all their rows, so that no held-out
prompt is trained on; at most `data.eval_rows` of them are scored. Rows that cannot be used
(over `max_seq_len` tokens, an empty response, chosen equal to rejected, a malformed field)
are left out and counted by reason in the dataset's `stats` (results.json "data"), never
trained on silently; a source with no usable row is refused naming `data.train`.

Held-out metrics (`held_out_metrics`; the recipe's eval_fn every `eval.every` steps,
metrics.jsonl `eval/val_*`, and results.json "validation" before and after training). DPO family
(`_PairObjective.metrics`): TRL's `DPOTrainer` evaluation metrics `eval_loss`,
`eval_rewards/chosen`, `eval_rewards/rejected`, `eval_rewards/margins`,
`eval_rewards/accuracies` (`_compute_loss`), here `val_loss` (the mean held-out loss),
`val_chosen_reward`, `val_rejected_reward` (mean implicit rewards r = beta * (log pi(y|x) - log
pi_ref(y|x)), log-probs summed over the response tokens; SimPO and ORPO, which have no
reference: beta times the per-token mean log-prob, as TRL's CPO and ORPO trainers),
`val_reward_margin` (their mean difference) and `val_reward_accuracy`: the share of pairs whose
chosen reward is strictly above the rejected one, TRL's `(chosen_rewards >
rejected_rewards).float().mean()`; a tie counts as wrong, so it is 0 before training, where the
policy is its reference. KTO: the loss and the mean rewards of the desirable and undesirable
rows (no accuracy: its rows are unpaired). The reward model's are its pairwise accuracy
(r_chosen > r_rejected, TRL's `RewardTrainer` "accuracy") and Bradley-Terry loss.

The starting policy, which is also the reference of the losses that need one: `model.init_from`
when set (as TRL, whose reference is the model training starts from); otherwise the SFT warm
start (section `sft`, run folder `sft/`) on the training rows' chosen (desirable) responses,
the rule of the DPO paper when no SFT model of the data exists (Rafailov et al. 2023, section
4: "we initialize pi_ref by maximizing likelihood of preferred completions (x, y_w)"). The
recipe's task, pairs and sampling sections are then unused.

Example:
    >>> rows = [{"prompt": "1+1=", "completion": "2", "label": True}]
    >>> own_pair_rows(rows, kto=False)
    Traceback (most recent call last):
    ...
    ValueError: the rows have columns ['completion', 'label', 'prompt']: unpaired_preference \
rows, which loss=kto takes; this loss takes preference (columns prompt, chosen, rejected)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data import KTODataset, PreferenceDataset, pairs_to_kto_rows
from posttrain.data.sources import detect_format, read_records
from posttrain.policy.policy import Policy
from posttrain.workflows.data_config import DataConfig

__all__ = [
    "OwnPairs",
    "own_pairs",
    "own_pair_rows",
    "own_start_policy",
    "held_out_metrics",
    "own_pairs_markdown",
    "UNPAIRED_COLUMNS",
]

UNPAIRED_COLUMNS = ("prompt", "completion", "label")
"""TRL's unpaired preference rows (KTO)."""
_PAIRED = "preference (columns prompt, chosen, rejected)"
_UNPAIRED = f"unpaired_preference (columns {', '.join(UNPAIRED_COLUMNS)})"


def _prompt_key(row: Any) -> str:
    """The group a row is held out with: its prompt (messages compared as JSON)."""
    prompt = row.get("prompt") if isinstance(row, Mapping) else row
    return json.dumps(prompt, sort_keys=True, default=str)


def own_pair_rows(records: Sequence[Any], *, kto: bool) -> str:
    """The row kind of `records`: "preference", or "unpaired_preference" where `kto` allows it.

    Raises:
        ValueError: naming the columns found and the kinds the loss takes (`kto`: both).
    """
    columns = sorted({str(c) for r in records if isinstance(r, Mapping) for c in r})
    if set(UNPAIRED_COLUMNS) <= set(columns) and not {"chosen", "rejected"} & set(columns):
        if kto:
            return "unpaired_preference"
        raise ValueError(
            f"the rows have columns {columns}: unpaired_preference rows, which loss=kto takes; "
            f"this loss takes {_PAIRED}"
        )
    takes = f"{_PAIRED} or {_UNPAIRED}" if kto else _PAIRED
    try:
        detect_format(records, ("preference",))
    except ValueError as e:
        raise ValueError(f"{e}; {'loss=kto' if kto else 'this loss'} takes {takes}") from None
    return "preference"


@dataclass
class OwnPairs:
    """Own rows as the recipe trains on them.

    Attributes:
        train, held: the training and held-out datasets (`PreferenceDataset`, or `KTODataset`
            for KTO); `held` None when no row is held out.
        kind: "preference" or "unpaired_preference" (the rows as found).
        demonstrations: chat rows ({"messages": prompt + assistant turn}) of the chosen
            (desirable) responses of the training rows kept, for the SFT warm start.
        name: the source and its kind, for reports ("pairs.parquet (preference rows)").
    """

    train: PreferenceDataset | KTODataset
    held: PreferenceDataset | KTODataset | None
    kind: str
    demonstrations: list[dict]
    name: str


def _dataset(rows: list[Any], tokenizer: Any, max_seq_len: int, kto: bool, at: str) -> Any:
    cls = KTODataset if kto else PreferenceDataset
    try:
        return cls(rows, tokenizer, max_seq_len=max_seq_len, on_bad_row="skip")
    except ValueError as e:
        raise ValueError(f"{at}: {e}") from None


def _chat(prompt: Any, response: Any) -> dict:
    """A chat row of a validated prompt (str or messages) and response (str or TRL's
    [assistant message])."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    content = response if isinstance(response, str) else response[0]["content"]
    return {"messages": [*messages, {"role": "assistant", "content": content}]}


def own_pairs(data: DataConfig, tokenizer: Any, *, max_seq_len: int, kto: bool) -> OwnPairs:
    """The training and held-out rows of `data` (module docstring), tokenised by `tokenizer`
    as the recipe's datasets (`max_seq_len` tokens at most; `kto`: `KTODataset`s).

    Raises:
        FileNotFoundError, ValueError: naming `data.train` / `data.eval`: an unreadable source,
            rows of another kind (naming the columns found and the kinds the loss takes), or
            no usable row (naming the reasons rows were left out); a KTO held-out set of fewer
            than two rows (its KL estimate needs two) names `data.eval_fraction`.
    """
    try:
        found = read_records(data.train, split=data.split)
        kind = own_pair_rows(found, kto=kto)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"data.train={_shown(data.train)}: {e}") from None
    evaluated = None
    if data.eval is not None:
        try:
            evaluated = read_records(data.eval, split=data.eval_split)
            own_pair_rows(evaluated, kto=kto)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"data.eval={_shown(data.eval)}: {e}") from None
    # the records read once, split (by prompt) as DataConfig splits any rows
    read = dataclasses.replace(data, train=found, eval=evaluated, split=None, eval_split=None)
    accepted = ("prompt_completion",) if kind == "unpaired_preference" else ("preference",)
    train, held, _ = read.records(accepted, group_of=_prompt_key)
    if kto and kind == "preference":
        train, held = pairs_to_kto_rows(train), pairs_to_kto_rows(held)
    dataset = _dataset(train, tokenizer, max_seq_len, kto, f"data.train={_shown(data.train)}")
    where = "data.eval" if data.eval is not None else "data.eval_fraction"
    if kto and len(held) == 1:
        raise ValueError(
            f"{where}: 1 held-out KTO row; its KL estimate needs at least 2 (hold out more "
            "prompts, or set data.eval_fraction=0 for none)"
        )
    held_set = _dataset(held, tokenizer, max_seq_len, kto, where) if held else None
    rows = [train[i] for i in dataset.row_indices]
    demonstrations = [
        _chat(r["prompt"], r["completion"] if kto else r["chosen"])
        for r in rows
        if not kto or r["label"]
    ]
    return OwnPairs(
        dataset, held_set, kind, demonstrations, f"{_source_name(data.train)} ({kind} rows)"
    )


def own_start_policy(cfg: Any, out: Path, pairs: OwnPairs) -> tuple[Policy, dict | None]:
    """The starting policy (and reference) of a pair recipe on own data: `cfg.model.init_from`,
    or the SFT warm start on `pairs.demonstrations` (the first `sft.demonstrations` of them,
    where set) into `out/sft` (module docstring). Returns (policy, the warm start's results or
    None).

    Raises:
        ValueError: when a warm start is needed and no training row has a chosen
            (desirable) response (KTO rows all undesirable): set model.init_from.
    """
    if cfg.model.init_from is not None:
        return Policy.from_pretrained(cfg.model.init_from), None
    from posttrain.workflows.sft import warm_start

    demonstrations = pairs.demonstrations[: cfg.sft.demonstrations]
    if not demonstrations:
        raise ValueError(
            "data.train: no training row has a desirable completion for the SFT warm start "
            "(every KTO label is false); set model.init_from to the policy to start from"
        )
    results = warm_start(cfg, out, data=DataConfig(train=demonstrations, eval_fraction=0.0))
    return Policy.from_pretrained(out / "sft" / "policy"), results


def held_out_metrics(held: Any, before: dict[str, float], after: dict[str, float]) -> dict:
    """results.json "validation" of a run on own pairs: {"rows": held-out pairs (KTO: rows),
    "before": {...}, "after": {...}} from the trainer's evaluations ({"eval/val_loss": ...}; an
    empty one, e.g. no "before" when resuming, is left out); {"rows": 0} without held-out rows."""
    out: dict[str, Any] = {"rows": 0 if held is None else len(held)}
    for stage, values in (("before", before), ("after", after)):
        if values:
            out[stage] = {k.removeprefix("eval/"): v for k, v in values.items()}
    return out


def own_pairs_markdown(results: dict[str, Any]) -> str:
    """results.md of a preference run on own pairs (`results` as `run_preference` writes)."""
    loss, validation = results["loss"].upper(), results["validation"]
    unit = "rows" if loss == "KTO" else "pairs"
    lines = [
        f"# {loss} on {results['dataset']}",
        "",
        f"{results['objective']}, model {results['init_from'] or results['model']} "
        f"({results['params'] / 1e6:.2f}M params), {results['steps']} steps, "
        f"wall {results['wall_s']:.0f} s",
        "",
        f"{results['train_samples']} training / {results['val_samples']} held-out {unit}; "
        f"rows left out by reason: {results['data']['skipped_by_reason'] or 'none'}",
        "",
    ]
    names = list(validation.get("before", validation.get("after", {})))
    if names:
        lines += [
            f"| held-out {unit} ({validation['rows']}) | "
            + " | ".join(n.removeprefix("val_") for n in names)
            + " |",
            "|---" * (len(names) + 1) + "|",
        ]
        for stage in ("before", "after"):
            if stage in validation:
                values = " | ".join(f"{validation[stage][n]:.4f}" for n in names)
                lines.append(f"| {stage} | {values} |")
    return "\n".join(lines) + "\n"


def _shown(source: Any) -> str:
    return repr(source) if isinstance(source, str) else f"<{type(source).__name__}>"


def _source_name(source: Any) -> str:
    return str(source) if isinstance(source, (str, Path)) else f"a {type(source).__name__}"
