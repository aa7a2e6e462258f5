"""Teacher-student distillation with GKD (Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes", https://arxiv.org/abs/2306.13649).

Notation: B = rows in a batch, T = tokens per row, V = vocabulary (shared by student and teacher),
N = trained positions (labels != -100). Divergences are in nats.

Three pieces, each usable alone (the first two live in `posttrain.train.distill_loss`):

* `generalized_jsd_loss`: the generalised Jensen-Shannon divergence JSD(beta) of the paper's
  eq. (1) between the student's and the teacher's next-token distributions, a pure function equal
  to TRL's `GKDTrainer.generalized_jsd_loss` (beta = 0: forward KL(teacher || student), beta = 1:
  reverse KL(student || teacher), as TRL defines them).
* `GKDLoss`, registered as "gkd": the `Trainer` objective. It holds a frozen teacher `Policy`,
  runs it under `torch.no_grad()` on the very batch the student sees, and trains the JSD summed
  over completion tokens, token-normalised over the whole optimizer step (like "sft_ce").
* Data: off-policy (supervised KD) trains on fixed completions, e.g. the teacher's own from
  `teacher_generate` fed through `SFTDataset`; on-policy GKD wraps the loader in `OnPolicyData`,
  which, with probability `lmbda` per batch (TRL's name), replaces the batch's completions by the
  student's samples of the same prompts (TRL `GKDTrainer.training_step`). The swap happens when
  the batch is fetched, before the trainer counts the step's tokens, so the normaliser is exact;
  the coin and the sampling seed come from the global torch RNG, which the trainer seeds,
  restores on a rolled-back step and checkpoints, so a resumed run draws the same batches.

Example (tiny-1m student, tiny-2m teacher; both use the 272-token byte vocabulary):
    >>> import torch
    >>> from posttrain.data import SFTDataset, SFTLoader
    >>> from posttrain.policy import Policy
    >>> from posttrain.train import Trainer, get_loss
    >>> student = Policy.from_spec("tiny-1m", seed=0)
    >>> teacher = Policy.from_spec("tiny-2m", seed=1)
    >>> rows = teacher_generate(teacher, ["1+1=", "2+3="], max_new_tokens=6, seed=0)
    >>> sorted(rows[0])
    ['completion', 'prompt']
    >>> loader = SFTLoader(SFTDataset(rows, student.tokenizer, max_seq_len=64), batch_size=2)
    >>> data = OnPolicyData(loader, student, lmbda=0.5, max_new_tokens=6)
    >>> loss = get_loss("gkd", teacher=teacher, student=student, beta=0.5)
    >>> opt = torch.optim.AdamW(student.model.parameters(), lr=1e-3)
    >>> Trainer(student.model, opt, data=data, loss=loss, progress=False).fit(2)["step"].tolist()
    [1, 2]
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from posttrain.core.checks import check_int
from posttrain.data.loader import IGNORE_INDEX, Batch, Sample, collate_padded
from posttrain.policy.engine_slot import EngineSlot
from posttrain.policy.policy import Policy, generate_for_items
from posttrain.policy.sampling import _check_sampling_args
from posttrain.train.distill_loss import (  # the divergence and the objective
    REDUCTIONS,
    GKDLoss,
    _check_fraction,
    generalized_jsd_loss,
)

if TYPE_CHECKING:
    from posttrain.policy.rollout_engine import RolloutEngine

__all__ = [
    "REDUCTIONS",
    "generalized_jsd_loss",
    "GKDLoss",
    "OnPolicyData",
    "on_policy_batch",
    "teacher_generate",
]

# --------------------------------------------------------------------------------------------
# Data: the student's own completions (on-policy) and the teacher's (off-policy)
# --------------------------------------------------------------------------------------------


def on_policy_batch(
    student: Policy,
    batch: Batch,
    *,
    temperature: float = 0.9,
    max_new_tokens: int = 128,
    top_p: float = 1.0,
    top_k: int | None = None,
    engine: RolloutEngine | None = None,
) -> Batch:
    """`batch` with every row's completion replaced by a sample of the student.

    A row's prompt is its tokens up to the first trained one (for `SFTDataset` rows: the rendered
    chat up to and including the assistant header); the student samples a completion of it
    (`Policy.generate`, seeded from the global torch RNG) and the new row trains every sampled
    token, the stop token included (TRL `generate_on_policy_outputs` keeps the first EOS too).
    Rows that train nothing (padding rows) are kept as they are. The result is right-padded with
    the student tokenizer's `pad_id` (`collate_padded`).

    Args:
        student: the policy being trained.
        batch: an unpacked `Batch` (attention_mask None).
        temperature, max_new_tokens, top_p, top_k: sampling settings (`Policy.generate`).
        engine: a rollout engine that samples in the student's place (`posttrain.policy.
            rollout_engine`), already holding its current weights (`OnPolicyData` syncs it);
            None samples with `student.generate`. Its seed is drawn from the global torch RNG
            the same way, so the builtin engine gives the same batch bit for bit.

    Returns:
        A new `Batch` with as many rows as `batch`.

    Raises:
        ValueError: for a packed batch, or bad sampling settings.
    """
    if batch.attention_mask is not None:
        raise ValueError(
            "on-policy distillation needs unpacked batches (SFTLoader(pack=False)): "
            "a packed row holds several prompts"
        )
    trained_BT = batch.labels != IGNORE_INDEX
    if batch.num_samples == 0 or not bool(trained_BT.any()):
        return batch
    ids_BT, labels_BT = batch.input_ids, batch.labels
    first = {b: int(w[0]) for b in range(ids_BT.shape[0]) if (w := trained_BT[b].nonzero()).numel()}
    prompts = {b: ids_BT[b, : t + 1].tolist() for b, t in first.items()}  # up to the first target
    sampler: Policy | RolloutEngine = student if engine is None else engine
    sampled = dict(
        zip(
            prompts,
            sampler.generate(
                list(prompts.values()),
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
            ),
        )
    )
    samples = []
    for b in range(ids_BT.shape[0]):
        if b not in prompts:  # trains nothing: kept as it is
            samples.append(Sample(ids_BT[b].clone(), labels_BT[b].clone()))
            continue
        prompt, new = prompts[b], sampled[b].token_ids
        samples.append(
            Sample.from_loss_mask(prompt + new, [False] * len(prompt) + [True] * len(new))
        )
    return collate_padded(samples, student.tokenizer.pad_id)


class _Sampling(TypedDict):
    """The student's sampling settings of `OnPolicyData` (keywords of `on_policy_batch`)."""

    temperature: float
    max_new_tokens: int
    top_p: float
    top_k: int | None


class OnPolicyData:
    """A loader whose batches, with probability `lmbda` each, carry the student's own
    completions instead of the given ones (GKD's student-data fraction; TRL `lmbda`).

    `next_batch()` fetches the next batch of `data`; then, if a coin drawn from the global torch
    RNG (`torch.rand(()) < lmbda`; not drawn when lmbda is 0 or 1) says so, returns
    `on_policy_batch(student, batch, ...)`. lmbda = 0 passes the batches through (off-policy /
    supervised KD), lmbda = 1 is fully on-policy. `state_dict()` holds the wrapped loader's state
    and the batch counts; the RNG states are the trainer's (seeded, restored after a rolled-back
    step, checkpointed), so a resumed run continues with the same coins and samples.

    Args:
        data: an unpacked SFT loader (`SFTLoader(pack=False)`: anything with `next_batch()`
            returning `Batch`); its `rank` / `world_size` are passed through.
        student: the `Policy` being trained (the same model object the `Trainer` gets).
        lmbda: fraction of on-policy batches, in [0, 1].
        temperature, max_new_tokens, top_p, top_k: the student's sampling settings; TRL's GKD
            defaults are temperature 0.9, max_new_tokens 128, top_p 1, no top-k.
        engine: the rollout engine that samples the student's completions: "builtin" (the
            default, `student.generate`), "vllm" (a server started from the student at the
            first on-policy batch, its model and log in `run_dir/vllm/`, synced with the
            student's weights before every later one), or a `RolloutEngine` instance (synced
            likewise; the caller closes it). Close the data (`close()`, or `with`) when
            training ends to stop a server it started.
        run_dir, engine_options: where the vllm engine writes (a temporary folder when None)
            and its start options (`VLLMEngine.start`).

    Attributes:
        batches, on_policy_batches: batches fetched and how many of them were the student's.

    Raises:
        ValueError: for lmbda outside [0, 1], a packed loader, bad sampling settings, or an
            unknown engine name (the allowed ones listed).
        TypeError: for a `data` without `next_batch()`, a `student` that is not a `Policy`, or
            an engine that is neither a name nor a `RolloutEngine`.
    """

    def __init__(
        self,
        data: Any,
        student: Policy,
        *,
        lmbda: float = 0.5,
        temperature: float = 0.9,
        max_new_tokens: int = 128,
        top_p: float = 1.0,
        top_k: int | None = None,
        engine: str | RolloutEngine = "builtin",
        run_dir: str | os.PathLike | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        _check_fraction(
            "lmbda",
            lmbda,
            "the fraction of batches whose completions the student "
            "samples: 0 is off-policy, 1 fully on-policy",
        )
        if not callable(getattr(data, "next_batch", None)):
            raise TypeError(
                f"data must have a next_batch() method (e.g. posttrain.data."
                f"SFTLoader); got {type(data).__name__}"
            )
        if not isinstance(student, Policy):
            raise TypeError(
                f"student must be a posttrain.policy.Policy; got {type(student).__name__}"
            )
        if getattr(data, "pack", False):
            raise ValueError(
                "OnPolicyData needs an unpacked loader (SFTLoader(pack=False)): a "
                "packed row holds several prompts"
            )
        check_int("max_new_tokens", max_new_tokens, minimum=1)
        _check_sampling_args(temperature, top_k, top_p)  # refused now, not at the first coin
        self.data, self.student, self.lmbda = data, student, lmbda
        self.sampling: _Sampling = {
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "top_p": top_p,
            "top_k": top_k,
        }
        self.batches = self.on_policy_batches = 0
        self.engine = EngineSlot(engine, run_dir=run_dir, options=engine_options)

    @property
    def rank(self) -> int:
        return getattr(self.data, "rank", 0)

    @property
    def world_size(self) -> int:
        return getattr(self.data, "world_size", 1)

    def next_batch(self) -> Batch:
        """The next batch, with the student's completions with probability `lmbda`."""
        batch = self.data.next_batch()
        self.batches += 1
        on_policy = self.lmbda == 1 or (0 < self.lmbda < 1 and float(torch.rand(())) < self.lmbda)
        if not on_policy:
            return batch
        self.on_policy_batches += 1
        if self.engine.name == "builtin":  # the student itself, bit for bit as before
            return on_policy_batch(self.student, batch, **self.sampling)
        engine = self.engine.sampler(self.student)  # the student's weights of this step
        return on_policy_batch(self.student, batch, **self.sampling, engine=engine)

    def close(self) -> None:
        """Stop an engine the data started (a vllm server); a later batch starts a new one."""
        self.engine.close()

    def __enter__(self) -> OnPolicyData:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """{"data": the wrapped loader's state, "batches", "on_policy_batches"}."""
        return {
            "data": self.data.state_dict(),
            "batches": self.batches,
            "on_policy_batches": self.on_policy_batches,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        self.batches, self.on_policy_batches = state["batches"], state["on_policy_batches"]

    def __repr__(self) -> str:
        return f"OnPolicyData(lmbda={self.lmbda}, {self.sampling}, data={type(self.data).__name__})"


def teacher_generate(
    teacher: Policy | RolloutEngine,
    prompts: Sequence[str],
    *,
    n: int = 1,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[dict[str, str]]:
    """Off-policy distillation data: the teacher's completions of `prompts` as SFT rows.

    Each prompt is a user turn, rendered with the teacher tokenizer's chat template plus the
    assistant header (`tokenizer.render_prompt`), as `SFTDataset` renders it, and sampled `n`
    times (`Policy.generate`, seeded by `seed`; the global RNG is untouched).

    Args:
        teacher: the teacher `Policy`, or a rollout engine holding its weights
            (`posttrain.policy.rollout_engine`: "builtin" gives the same rows as the policy,
            "vllm" samples them with a vLLM server; the vllm engine refuses settings it would
            sample differently, by name).
        prompts: user messages (non-empty str).
        n, max_new_tokens, temperature, top_p, top_k: sampling settings (`Policy.generate`).
        seed: sampling seed; the same seed gives the same rows.

    Returns:
        Rows {"prompt": user message, "completion": the decoded sample}, prompt-major, ready for
        `posttrain.data.SFTDataset` (which appends and trains the end-of-turn token). Samples
        whose text is blank (the teacher stopped at once) are left out, since an SFT row needs a
        non-empty answer: compare `len(rows)` with `n * len(prompts)`. A sample cut at
        `max_new_tokens` is kept as it is.

    Raises:
        ValueError: for prompts that are not a non-empty list of non-empty str, or bad sampling
            settings.
    """
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of str (user messages)")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            raise ValueError(f"prompts[{i}]={p!r}; each prompt must be a non-empty str")
    [(_, _, completions)] = generate_for_items(
        teacher,
        [{"question": p} for p in prompts],
        batch_size=len(prompts),
        seed=seed,
        n=n,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    return [
        {"prompt": prompts[c.prompt_index], "completion": c.text}
        for c in completions
        if c.text.strip()
    ]
