"""What every recipe does at the start and the end of a run: refuse a used run folder, echo
the config and record the run's lineage (`start_run`; `posttrain.workflows.lineage`), the
held-out accuracy table and paired difference of results.md, results.json + results.md
(`write_results`), and the one plot of per-step curves (`plot_curves`).

The plot is a matplotlib Figure made outside pyplot (`posttrain.core.figures`), saved to the run
folder, not `posttrain.notebook.plots.plot_metrics`: nothing in the SDK imports the notebook
layer, and a recipe's run folder should look the same whether it ran from a shell, a notebook or
a job. It leaves matplotlib's backend alone, so the plots of a notebook stay inline after a
recipe ran in its kernel.

Example:
    >>> r = {"accuracy": 0.25, "ci_low": 0.1, "ci_high": 0.5, "num_items": 8}
    >>> print("\\n".join(accuracy_table([("before", None), ("after", r)])))
    | held-out (greedy) | accuracy | 95% Wilson CI | items |
    |---|---|---|---|
    | after | 0.250 | [0.100, 0.500] | 8 |
"""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import pandas as pd
import torch

from posttrain.core.checkpoint import check_new_run_dir
from posttrain.core.checkpoint_files import write_text_atomic
from posttrain.core.distributed import barrier, rank_and_world_size
from posttrain.core.figures import new_figure
from posttrain.core.run_lock import claim_run_dir
from posttrain.core.stage_files import count_lines, read_stage_file, write_stage_file
from posttrain.rewards.evaluation import wilson_interval
from posttrain.train.engine import Engine
from posttrain.workflows.config import BatchOptimConfig, SFTWarmStartConfig, validate
from posttrain.workflows.lineage import check_parents, write_lineage
from posttrain.workflows.parallel import ParallelPlan, check_world_size
from posttrain.workflows.rollout_config import RolloutConfig

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "start_run",
    "accuracy_table",
    "demo_split_lines",
    "validation_lines",
    "difference_line",
    "accuracy_of",
    "write_results",
    "write_table",
    "read_table",
    "plot_curves",
    "RunInterrupted",
    "stop_if_interrupted",
    "RESUMABLE_KEYS",
    "cached_pairs",
    "check_tokenizer_covers_task",
    "on_rank_zero",
]

T = TypeVar("T")

RESUMABLE_KEYS = (
    "resume",
    "progress",
    "checkpoint.",
    "parallel.",
    "out_dir",
    "optim.loss_chunk_tokens",
    "sft.loss_chunk_tokens",
)
"""Config keys (and key prefixes, ending in ".") that may differ between a run and its resume:
`parallel.*` (a sharded checkpoint reshards to another plan, world size included, and one of a
run without a plan loads under a plan), `loss_chunk_tokens` (the same loss up to float rounding:
a run that ran out of memory resumes with its loss chunked) and `out_dir` (a run folder that was
moved or copied resumes from its new place: a saved value that is a path inside the old folder
is compared as the same path inside the new one). Every other setting (model, data, schedule
length, ...) is compared with the saved config.json."""


class RunInterrupted(KeyboardInterrupt):
    """A stage stopped on Ctrl-C at a whole step: its checkpoint and a results.json marked
    interrupted are on disk, and no later stage runs. `resume=true` continues the run."""


def start_run(cfg: Any, *, sub_runs: Sequence[str] = (), checked: bool = False) -> Path:
    """Validate `cfg` again (a notebook may have changed a section in place) and check its
    `parallel` plan against the job (`check_world_size`), unless `checked` (`RecipeRun.start`
    did both already); refuse an `out_dir` (or its `sub_runs`, e.g. "sft") that already holds a
    run unless `cfg.resume`; on resume, compare `cfg` with the saved `config.json` (only
    `RESUMABLE_KEYS` may differ). Then (rank 0 of a process group, after every rank has
    checked) create the folder (0700), claim it for this process (`posttrain.core.run_lock`)
    and write `config.json` and
    `lineage.json` (`posttrain.workflows.lineage`: data hashes, code and package versions,
    parents); seed torch with `cfg.seed`. Returns the run folder.

    Raises:
        ValueError: before anything is written, for a bad config, a `parallel` plan that does
            not fit the job, a used run folder, a resume whose config differs from the saved
            one (naming the dotted key), a tokenizer that does not cover the task, or a
            missing parent run or data file (`check_parents`).
        RunDirInUseError: if another live process holds the folder.
    """
    if not checked:
        validate(cfg)
        check_world_size(cfg)
    check_tokenizer_covers_task(cfg)
    out = Path(cfg.out_dir)
    config = dataclasses.asdict(cfg)
    if not cfg.resume:
        for folder in (out, *(out / s for s in sub_runs)):
            try:
                check_new_run_dir(folder)
            except ValueError:
                raise ValueError(
                    f"Config.out_dir={str(out)!r} already holds a run ({folder} has metrics.jsonl "
                    f"or checkpoints): continue it with `posttrain resume {out}` (resume=True in "
                    "a notebook's Config), or choose a new out_dir"
                ) from None
    elif (out / "config.json").is_file():
        _check_resumed_config(json.loads((out / "config.json").read_text()), config, out)
    parents = check_parents(cfg, out, sub_runs)
    barrier()  # every rank has checked the folder before rank 0 writes into it
    if rank_and_world_size()[0] == 0:
        claim_run_dir(out)
        write_text_atomic(out / "config.json", json.dumps(config, indent=2, default=_described))
        write_lineage(cfg, out, config, parents)
    torch.manual_seed(cfg.seed)
    return out


UNK_SHARE_MAX = 0.01
"""Largest share of a task's tokens that may be the unknown token under `model.init_from`."""


def _described(value: Any) -> str:
    """How config.json names an object a notebook put in a config (own data: a DataFrame)."""
    size = f", {len(value)} rows" if hasattr(value, "__len__") else ""
    return f"<{type(value).__name__}{size}>"


def check_tokenizer_covers_task(cfg: Any, probe: int = 16) -> None:
    """Refuse (before anything is written) a `model.init_from` policy whose tokenizer turns
    more than `UNK_SHARE_MAX` of the task's text into its unknown token: `probe` rows of the
    task (reasoning-gym items from `task.eval_seed`, or the data file's first rows), encoded.

    Raises:
        ValueError: naming `Config.model.init_from`, the share and an example.
    """
    folder = getattr(getattr(cfg, "model", None), "init_from", None)
    if folder is None or not hasattr(cfg, "task"):
        return
    from posttrain.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None:
        return
    texts = _probe_texts(cfg.task, probe)
    ids = [tokenizer.encode(t) for t in texts]
    total = sum(len(i) for i in ids)
    share = sum(i.count(unk) for i in ids) / max(total, 1)
    if share > UNK_SHARE_MAX:
        example = next(t for t, i in zip(texts, ids) if unk in i)
        raise ValueError(
            f"Config.model.init_from={folder!r}: its tokenizer turns {share:.0%} of "
            f"the task's tokens into the unknown token (e.g. in {example[:80]!r}); "
            "use a policy whose tokenizer covers the data"
        )


def _probe_texts(task: Any, n: int) -> list[str]:
    if task.is_file:  # the first lines as they are (JSON punctuation is in every vocabulary)
        with open(task.name, encoding="utf-8", errors="replace") as f:
            return [line for _, line in zip(range(n), f) if line.strip()]
    import reasoning_gym

    ds = reasoning_gym.create_dataset(task.name, size=n, seed=task.eval_seed, **task.options)
    return [f"{item['question']} {item['answer']}" for item in ds]


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_ADDED_DEFAULTS = {
    **{f"parallel.{k}": v for k, v in dataclasses.asdict(ParallelPlan()).items()},
    **{
        f"sft.{f.name}": getattr(SFTWarmStartConfig(), f.name)
        for f in dataclasses.fields(BatchOptimConfig)
        if f.name not in ("steps", "lr", "batch_size")
    },
    **{f"rollout.{k}": v for k, v in dataclasses.asdict(RolloutConfig()).items()},
}
"""Keys that a config.json written before they existed lacks (the `parallel` section; the SFT
warm start's optimizer fields besides steps, lr and batch_size; the `rollout` section of the
recipes other than grpo and ppo); at these values they mean what that run did."""


def _check_resumed_config(saved: dict, now: dict, out: Path) -> None:
    saved, now = _flat(saved), _flat(json.loads(json.dumps(now, default=str)))
    old_dir, new_dir = saved.get("out_dir"), now.get("out_dir")
    for key in sorted(set(saved) | set(now)):
        moved = _rebased(saved.get(key), old_dir, new_dir)  # a path inside a moved run folder
        if key.startswith(RESUMABLE_KEYS) or now.get(key) in (saved.get(key), moved):
            continue
        if key not in saved and key in _ADDED_DEFAULTS and now[key] == _ADDED_DEFAULTS[key]:
            continue
        allowed = ", ".join(k + "*" if k.endswith(".") else k for k in RESUMABLE_KEYS)
        raise ValueError(
            f"resume: {out / 'config.json'} has {key}={saved.get(key)!r}, this run "
            f"has {key}={now.get(key)!r}; only {allowed} may change on resume "
            "(use a new out_dir for a different run)"
        )


def _rebased(value: Any, old_dir: Any, new_dir: Any) -> Any:
    """`value`, if it is a path inside the folder that moved, as the same path in its new place;
    else itself. The folder that moved is `old_dir` -> `new_dir` less their common last parts:
    a sub-run `run/more_sft` moved with its run to `new/more_sft` moved `run` -> `new`, so its
    `model.init_from` `run/sft/policy` is now `new/sft/policy`."""
    if not (isinstance(value, str) and isinstance(old_dir, str) and isinstance(new_dir, str)):
        return value
    old, new = Path(old_dir).parts, Path(new_dir).parts
    same = 0
    while same < min(len(old), len(new)) - 1 and old[-1 - same] == new[-1 - same]:
        same += 1
    try:
        inside = Path(value).relative_to(Path(*old[: len(old) - same]))
    except ValueError:
        return value
    return str(Path(*new[: len(new) - same]) / inside)


def demo_split_lines(results: dict[str, Any], trained: str) -> list[str]:
    """results.md lines saying where the demonstrations came from when the task gave them their
    own options (`results["demo_config"]`, `TaskConfig.report`); none otherwise. `trained`: what
    else drew from the task's options ("GRPO prompts")."""
    if "demo_config" not in results:
        return []
    return [
        f"demonstrations (SFT rows) from {results['demo_config']}; held-out items and "
        f"{trained} from {results['task_config']}",
        "",
    ]


def accuracy_table(
    stages: Sequence[tuple[str, dict | None]], header: str = "held-out (greedy)"
) -> list[str]:
    """Markdown rows of (stage name, `EvalResult.as_dict()`) pairs; stages given None are
    left out."""
    lines = [f"| {header} | accuracy | 95% Wilson CI | items |", "|---|---|---|---|"]
    for name, r in stages:
        if r is not None:
            lines.append(
                f"| {name} | {r['accuracy']:.3f} | [{r['ci_low']:.3f}, "
                f"{r['ci_high']:.3f}] | {r['num_items']} |"
            )
    return lines


def validation_lines(validation: dict) -> list[str]:
    """Markdown rows of own data's held-out metrics before and after training
    (`{"rows": n, "before": {"val_loss": ..., "val_exact_match": ...}, "after": {...}}`)."""
    names = [k for k in ("val_loss", "val_exact_match") if k in validation.get("before", {})]
    lines = [
        f"| held-out rows ({validation['rows']}) | {' | '.join(names)} |",
        "|---" * (len(names) + 1) + "|",
    ]
    for stage in ("before", "after"):
        if stage in validation:
            values = " | ".join(f"{validation[stage][k]:.4f}" for k in names)
            lines.append(f"| {stage} | {values} |")
    return lines + [""]


def difference_line(label: str, d: dict) -> str:
    """One line for a `paired_bootstrap_diff` result."""
    return (
        f"{label}: {d['difference']:+.3f} (95% CI [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}], "
        f"{d['method']}, same {d['num_items']} items)"
    )


def accuracy_of(table: pd.DataFrame) -> dict[str, float]:
    """Accuracy with a 95% Wilson interval of an evaluation table's `correct` column."""
    successes, n = int(table["correct"].sum()), len(table)
    low, high = wilson_interval(successes, n)
    return {"accuracy": successes / n, "ci_low": low, "ci_high": high, "num_items": n}


def write_results(out: Path, results: dict[str, Any], markdown: str) -> None:
    """`results.json` (values JSON cannot hold written as strings; a stage file: a resumed run
    reads a finished stage's results back, `posttrain.core.stage_files`) and `results.md`;
    prints the markdown."""
    write_stage_file(out / "results.json", json.dumps(results, indent=2, default=str))
    write_text_atomic(out / "results.md", markdown)
    print(markdown)


def write_table(table: pd.DataFrame, path: Path) -> None:
    """An evaluation table as CSV, written atomically with its row count and sha256 recorded
    (a stage file, `posttrain.core.stage_files`: a resumed run reads it back, checked).

    Rows end in CRLF, as RFC 4180 has them: Python's csv writer quotes a field only when it holds
    a character of the line terminator, so with a bare "\n" a sampled completion holding "\r"
    was written unquoted and read back as two rows."""
    write_stage_file(path, table.to_csv(index=False, lineterminator="\r\n"), rows=len(table))


@overload
def read_table(path: Path, *, required: Literal[True], **read_csv: Any) -> pd.DataFrame: ...


@overload
def read_table(path: Path, *, required: bool = False, **read_csv: Any) -> pd.DataFrame | None: ...


def read_table(path: Path, *, required: bool = False, **read_csv: Any) -> pd.DataFrame | None:
    """An evaluation table written by `write_table`, or None if the stage did not finish (no
    file, or a file without a record: its stage runs again). `read_csv` options go to
    `pandas.read_csv`.

    Args:
        required: the stage that writes it is already done and will not run again: a missing
            file raises FileNotFoundError, and a table written before tables carried records is
            read unverified, with a warning.

    Raises:
        StageFileError: naming the file and the rows recorded and found, if it was cut or
            changed after it was written (`posttrain.core.stage_files.read_stage_file`).
        FileNotFoundError: with `required`, if it is missing.
    """
    data = read_stage_file(path, count_rows=_csv_rows, required=required)
    return None if data is None else pd.read_csv(io.BytesIO(data), **read_csv)


def _csv_rows(data: bytes) -> int:
    return len(pd.read_csv(io.BytesIO(data)))


def cached_pairs(
    out: Path,
    *,
    resume: bool,
    make: Callable[[], tuple[list[dict], dict[str, Any]]],
    stats_file: str = "pair_stats.json",
) -> tuple[list[dict], dict[str, Any]]:
    """The rejection-sampling stage of a preference or reward-model run: `(rows, stats)` read
    back when resuming and both files are there and recorded, else `make()` (returning rows
    and a stats dict), written as stage files (`posttrain.core.stage_files`: atomic, with
    their row counts and sha256), the stats first and `pairs.jsonl` last.

    Raises:
        StageFileError: on resume, naming the file, if `pairs.jsonl` or the stats file was cut
            or changed after it was written (a resumed run would have trained on fewer pairs).
    """
    pairs_path, stats_path = out / "pairs.jsonl", out / stats_file
    if resume:
        pairs = read_stage_file(pairs_path, count_rows=count_lines)
        stats_data = read_stage_file(stats_path)
        if pairs is not None and stats_data is not None:
            return [json.loads(line) for line in pairs.splitlines()], json.loads(stats_data)
    rows, stats = make()
    write_stage_file(stats_path, json.dumps(stats, indent=2))
    write_stage_file(pairs_path, "".join(json.dumps(r) + "\n" for r in rows), rows=len(rows))
    return rows, stats


def on_rank_zero(make: Callable[[], T]) -> T:
    """`make()` on rank 0, its (picklable) result broadcast to every rank of the process group
    (a collective); `make()` itself without one. For a stage whose result every rank needs and
    that must not differ between ranks (rejection-sampled pairs: sampling on several GPUs need
    not give the same tokens), and that writes files (rank 0 alone writes)."""
    import torch.distributed as dist

    if rank_and_world_size()[1] == 1:
        return make()
    box: list[Any] = [make() if dist.get_rank() == 0 else None]  # the others': the broadcast
    dist.broadcast_object_list(box, src=0)
    return box[0]


def stop_if_interrupted(trainer: Engine, out: Path, results: dict[str, Any]) -> None:
    """After `trainer.fit`: if it stopped on Ctrl-C, write `results.json` / `results.md` marked
    interrupted with the real step count and raise `RunInterrupted` (so no later stage starts
    and the command line exits non-zero). Rank 0 writes; every rank raises."""
    if not trainer.interrupted:
        return
    done, planned = trainer.step_count, trainer.target_steps
    results = {**results, "interrupted": True, "steps_done": done, "steps_planned": planned}
    if rank_and_world_size()[0] == 0:
        write_results(
            out,
            results,
            f"# interrupted after step {done} of {planned}\n\n"
            f"The last whole step is checkpointed: rerun with resume=true to continue.\n",
        )
    raise RunInterrupted(
        f"{out}: interrupted after step {done} of {planned}; rerun with "
        "resume=true to continue from its checkpoint"
    )


def plot_curves(
    metrics: pd.DataFrame,
    path: Path,
    columns: Sequence[tuple[str, str]],
    *,
    xlabel: str,
    log_y: bool = False,
) -> Figure:
    """One row of panels, x = `metrics["step"]`, one per (column, axis label) present in
    `metrics`; rows where a column is NaN are skipped (sparse ones get point markers). Saved to
    `path` as PNG at 100 dpi (4 x 3 inches a panel).

    Returns the `matplotlib.figure.Figure` (outside pyplot: it shows inline only as a notebook
    cell's value or through `display`). Raises ValueError if no column of `columns` is in
    `metrics` (the message lists both)."""
    present = [(c, label) for c, label in columns if c in metrics]
    if not present:
        raise ValueError(
            f"plot_curves: none of the columns {[c for c, _ in columns]} is in the metrics "
            f"(columns: {list(metrics.columns)})"
        )
    fig = new_figure(figsize=(4 * len(present), 3), layout="tight")
    for ax, (column, label) in zip(fig.subplots(1, len(present), squeeze=False)[0], present):
        data = metrics[["step", column]].dropna()
        ax.plot(data["step"], data[column], lw=1, marker="." if len(data) < len(metrics) else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    return fig
