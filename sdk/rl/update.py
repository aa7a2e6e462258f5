"""The update half of an RL step, on a batch that is sampled, scored and has its advantages:
the frozen forwards (reference log-probs, old values, the trainer's own log-probs of a low-bit
sampler's rows), then `algo.ppo_epochs` passes of shuffled minibatches, one optimizer step each,
every data rank its share of each minibatch in micro-batches.

Notation: B = rows of the batch (or of a minibatch), T = padded tokens per row.

`RLUpdateEngine` is the training engine (`posttrain.train.engine.Engine`) with this half;
`posttrain.rl.trainer.RLTrainer` adds the rollout half and the step that joins them (see its
module docstring), and sets the fields declared here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posttrain.policy.policy import Policy
from posttrain.rl.algorithms import accumulate_metrics, policy_loss, step_units, value_loss
from posttrain.rl.config import RLAlgorithm
from posttrain.rl.engine_rollout import ManagedEngine
from posttrain.rl.lowbit_rollout import frozen_logprobs, scores_apart_from_sampler
from posttrain.rl.parallel import data_shares, padding_rows
from posttrain.rl.scoring import ValueHead, score_rows
from posttrain.train.engine import Engine

__all__ = ["RLUpdateEngine"]


class RLUpdateEngine(Engine):
    """The training engine with the update half of an RL step (see the module docstring).

    Attributes (set by the subclass, `RLTrainer`):
        policy: the trained `Policy`. algo: the `RLAlgorithm`.
        value_head: PPO's `ValueHead`, or None. reference: the frozen reference model, or None
            (no KL term, or a LoRA policy whose reference is its own base).
        micro_batch_size: rows per forward/backward of a data rank's share of a minibatch
            (None: the whole share at once).
        temperature, top_p: the sampler's settings; the rows are scored under them.
        share_prefix: score a group's rows in one packed sequence per prompt.
        loss_chunk_tokens: None, or response tokens per chunk of the head when scoring
            (`posttrain.policy.chunked_ce`).
        seed: seeds the minibatch shuffle (with the step count).
        rollout_quantization: None, or the low-bit format the rollouts were sampled with.
        rollout: the rollout engine (`ManagedEngine`): one apart from the policy has its rows
            rescored by the policy.
    """

    policy: Policy
    algo: RLAlgorithm
    value_head: ValueHead | None
    reference: nn.Module | None
    micro_batch_size: int | None
    temperature: float
    top_p: float
    share_prefix: bool
    loss_chunk_tokens: int | None = None
    seed: int
    rollout_quantization: str | None
    rollout: ManagedEngine

    def _update(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """algo.ppo_epochs passes of shuffled minibatches, one optimizer step per minibatch.
        Returns the metrics averaged over minibatches (first-minibatch ratio kept apart)."""
        B = batch["scores_B"].shape[0]
        size = self.algo.minibatch_size or B
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step_count)
        sums: dict[str, float] = {}
        n = 0
        for _epoch in range(self.algo.ppo_epochs):
            order = torch.randperm(B, generator=generator)
            for first in range(0, B, size):
                rows = order[first : first + size]
                metrics = self._optimizer_step({k: v[rows] for k, v in batch.items()})
                if n == 0:
                    sums["first_ratio_mean"] = metrics["ratio_mean"]
                    sums["first_clipfrac"] = metrics["clipfrac"]
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n += 1
        return {k: (v if k.startswith("first_") else v / n) for k, v in sums.items()}

    def _micro_batch_loss(
        self, model: nn.Module, m: dict[str, Tensor], units: Tensor, value_head: ValueHead | None
    ) -> tuple[Tensor, dict[str, Tensor], Tensor, Tensor | None]:
        """(loss share, metrics, logprobs_BT, values_BT) of micro-batch `m`: the policy loss plus
        `value_coef` x the value loss with a value head, normalised by the minibatch's `units`."""
        algo = self.algo
        logprobs_BT, values_BT, entropy_BT = self._forward(
            model, m, value_head=value_head, entropy=True
        )
        loss, metrics = policy_loss(
            logprobs_BT,
            m["old_logprobs_BT"],
            m["advantages_BT"],
            m["response_mask_BT"],
            algo=algo,
            ref_logprobs_BT=m.get("ref_logprobs_BT"),
            entropy_BT=entropy_BT,
            num_units_in_step=units,
            rollout_is_weights_BT=m.get("rollout_is_weights_BT"),
        )
        if values_BT is not None:
            v_loss, v_metrics = value_loss(
                values_BT,
                m["old_values_BT"],
                m["returns_BT"],
                m["response_mask_BT"],
                algo=algo,
                num_units_in_step=units,
            )
            loss = loss + algo.value_coef * v_loss
            metrics.update(v_metrics)
        return loss, metrics, logprobs_BT, values_BT

    def _optimizer_step(self, mb: dict[str, Tensor]) -> dict[str, float]:
        """One optimizer step on a minibatch of the global batch: this data rank's contiguous
        share of its rows (all of them with one data rank), in as many micro-batches as the
        largest share needs (a padding micro-batch runs the same forward and backward and
        contributes nothing); the gradients and metrics are summed over the data ranks (FSDP2/TP
        reduce the policy's, the runtime the value head's), then `update`. Returns the metrics."""
        algo, model, head = self.algo, self.policy.model, self.value_head
        model.train()
        units = step_units(mb["response_mask_BT"], algo.loss_agg_mode)  # the whole minibatch
        units_tokens = mb["response_mask_BT"].sum()
        rank, ranks = self.data_rank_and_size
        shares = data_shares(mb["scores_B"].shape[0], ranks)
        mine, largest = shares[rank], len(shares[0])
        micro = self.micro_batch_size or largest
        rounds = -(-largest // micro)
        totals: dict[str, Tensor] = {}
        for i in range(rounds):
            rows = mine[i * micro : (i + 1) * micro]
            m = (
                {k: v[rows.start : rows.stop] for k, v in mb.items()}
                if len(rows)
                else padding_rows(mb)
            )
            self._set_gradient_sync(i == rounds - 1)
            loss, metrics, logprobs_BT, values_BT = self._micro_batch_loss(model, m, units, head)
            if not len(rows):  # padding: the same graph and collectives, no contribution
                loss = logprobs_BT.sum() * 0.0 + (
                    0.0 if values_BT is None else values_BT.sum() * 0.0
                )
                metrics = {k: torch.zeros_like(v) for k, v in metrics.items()}
            loss.backward()
            accumulate_metrics(totals, metrics, m["response_mask_BT"].sum() / units_tokens)
        totals = self.runtime.reduce_metrics(totals)
        if head is not None:
            self.runtime.sum_module_grads(head)
        self._sum_gradients_across_ranks()  # the plan's own syncs (experts over dp x sp ranks)
        # the schedule steps once per RL step (RLTrainer._train_on_groups: `_step_schedule`)
        grad_norm, lr = self.update(totals["loss"], schedule=False)
        totals["lr"] = torch.tensor(lr)
        totals["grad_norm"] = grad_norm
        return {k: float(v) for k, v in totals.items()}

    def _forward(
        self,
        model: nn.Module,
        m: dict[str, Tensor],
        *,
        value_head: ValueHead | None,
        entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """`posttrain.rl.scoring.score_rows` of micro-batch `m` under the sampling distribution
        (the trainer's temperature and top-p); the entropy is differentiable only when
        algo.entropy_coef > 0."""
        return score_rows(
            model,
            m,
            value_head=value_head,
            temperature=self.temperature,
            top_p=self.top_p,
            share_prefix=self.share_prefix,
            entropy=entropy,
            entropy_grad=self.algo.entropy_coef > 0,
            chunk_tokens=self.loss_chunk_tokens,
        )

    @torch.no_grad()
    def _frozen_forward(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Reference log-probs and old values of the batch's rows: each data rank scores its
        contiguous share (a padding row when it has none), the shares are gathered."""
        rank, ranks = self.data_rank_and_size
        shares = data_shares(batch["scores_B"].shape[0], ranks)
        mine = shares[rank]
        rows = (
            {k: v[mine.start : mine.stop] for k, v in batch.items()}
            if len(mine)
            else padding_rows(batch)
        )
        out = self._frozen_outputs(rows)
        return self.runtime.gather_rows(out, [len(s) for s in shares]) if out else out

    def _frozen_outputs(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}

        def score(model: nn.Module) -> Tensor:  # the batch's log-probs under `model`
            return self._forward(model, batch, value_head=None)[0]

        if self.reference is not None:
            out["ref_logprobs_BT"] = score(self.reference)
        elif self.algo.kl_coef > 0:  # a LoRA policy: the reference is its base
            out["ref_logprobs_BT"] = frozen_logprobs(score, self.policy.model, base=True)
        apart = self.rollout.apart_from_policy
        if scores_apart_from_sampler(self.rollout_quantization, self.algo, engine_apart=apart):
            out["trainer_logprobs_BT"] = frozen_logprobs(score, self.policy.model)
        if self.value_head is not None:
            _, values_BT, _ = self._forward(self.policy.model, batch, value_head=self.value_head)
            assert values_BT is not None  # a value head gives values
            out["old_values_BT"] = values_BT
        return out
