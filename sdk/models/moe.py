"""Mixture-of-Experts feed-forward: top-k token-choice routing over SwiGLU experts, with the
Switch Transformer load-balancing loss.

Notation: N = tokens (batch x sequence, flattened), D = model dim, E = experts, K = experts per
token (top-k), H = expert hidden dim, S = shared-expert hidden dim, A = N * K token-expert
assignments.

One layer (the Qwen2-MoE block of HF transformers, `Qwen2MoeSparseMoeBlock`):

    probs_NE = softmax(router(x_ND))                     # fp32
    weights_NK, experts_NK = topk(probs_NE, K)           # optionally renormalised to sum 1
    y_ND = sum_k weights_NK[:, k] * expert[experts_NK[:, k]](x_ND)
         + sigmoid(shared_expert_gate(x_ND)) * shared_expert(x_ND)     # when S > 0
    expert_e(x) = down_e(silu(gate_e(x)) * up_e(x))      # SwiGLU, weights stacked along dim 0

The experts' weights are stacked parameters `gate_proj`, `up_proj` [E, H, D] and `down_proj`
[E, D, H] (nn.Linear's [out, in] layout per expert), so an expert-parallel plan can split them
along dim 0; the per-expert compute is `MoEFeedForward._run_experts`, which a dispatcher calls
for the experts a rank holds.

After every forward the layer keeps its auxiliary load-balancing loss in `aux_loss`;
`moe_aux_loss(model)` adds them up over the model's MoE layers.

Example:
    >>> import torch
    >>> moe = MoEFeedForward(dim=8, hidden_dim=16, num_experts=4, experts_per_token=2)
    >>> y = moe(torch.randn(2, 3, 8))
    >>> tuple(y.shape), tuple(moe.aux_loss.shape)
    ((2, 3, 8), ())
    >>> float(load_balancing_loss(torch.full((4, 2), 0.5), torch.tensor([[0], [1], [0], [1]]), 2))
    1.0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MoEFeedForward", "SwiGLU", "load_balancing_loss", "moe_aux_loss", "moe_layers"]


def load_balancing_loss(router_probs_NE: Tensor, selected_NK: Tensor, num_experts: int) -> Tensor:
    """Auxiliary load-balancing loss of one router: `E * sum_i f_i * P_i`.

    Switch Transformer (Fedus et al. 2022, eq. 4-6): `f_i` is the fraction of tokens dispatched
    to expert i and `P_i` the mean router probability of expert i. For top-k routing `f_i` counts
    every one of a token's k choices (`f` sums to K), as HF transformers'
    `load_balancing_loss_func` does, so the minimum, reached by perfectly uniform routing, is K
    (1.0 for top-1, the Switch form). Gradients flow through `P` only (`f` is a count).

    Unlike HF's function, which concatenates the router logits of all layers before computing one
    loss, this is the loss of one layer; `moe_aux_loss` sums the layers, as the paper adds one
    loss per router.

    Args:
        router_probs_NE: [N, E] float softmax probabilities of the router (rows sum to 1).
        selected_NK: [N, K] int64 experts chosen per token.
        num_experts: E.

    Returns:
        fp32 scalar; 0.0 (differentiable) when N = 0.

    Raises:
        ValueError: if the shapes disagree with each other or with `num_experts`.
    """
    if (
        router_probs_NE.dim() != 2
        or selected_NK.dim() != 2
        or router_probs_NE.shape[0] != selected_NK.shape[0]
        or router_probs_NE.shape[1] != num_experts
    ):
        raise ValueError(
            f"router_probs must be [N, E={num_experts}] and selected [N, K]; got "
            f"{tuple(router_probs_NE.shape)} and {tuple(selected_NK.shape)}"
        )
    probs_NE = router_probs_NE.float()
    num_tokens = probs_NE.shape[0]
    if num_tokens == 0:
        return probs_NE.sum() * 0.0
    counts_E = F.one_hot(selected_NK, num_experts).sum(dim=(0, 1)).to(probs_NE.dtype)
    fraction_E = counts_E / num_tokens  # f_i, summing to K
    mean_prob_E = probs_NE.mean(dim=0)  # P_i
    return num_experts * (fraction_E * mean_prob_E).sum()


class SwiGLU(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` without biases (Shazeer 2020, GLU variants;
    HF `Qwen2MoeMLP`). Maps [..., D] to [..., D]."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEFeedForward(nn.Module):
    """Top-k token-choice Mixture-of-Experts feed-forward (drop-in for a transformer MLP).

    See the module docstring for the computation. The router runs in the input dtype; its softmax,
    the top-k and the aux loss in fp32; the combine weights are cast back to the input dtype
    (as HF `Qwen2MoeTopKRouter`). No capacity limit: every token reaches its k experts.

    Args:
        dim: D, model dim (input and output).
        hidden_dim: H, hidden dim of each routed expert (HF `moe_intermediate_size`).
        num_experts: E >= 1 routed experts.
        experts_per_token: K, in 1..E.
        norm_topk_prob: renormalise the K chosen probabilities to sum to 1 (HF `norm_topk_prob`;
            Qwen1.5-MoE: False, Qwen3-MoE: True).
        shared_expert_dim: S, hidden dim of an always-on SwiGLU expert scaled by a sigmoid gate
            (HF `shared_expert_intermediate_size`); 0 for none.
        router_aux_loss_coef: weight of this layer's aux loss in a training objective (read by
            `moe_aux_loss(model, scaled=True)`; HF `router_aux_loss_coef`).
        init_std: standard deviation of the normal initialisation of every weight.

    Attributes:
        router: nn.Linear(D, E, bias=False).
        gate_proj, up_proj: [E, H, D] parameters; down_proj: [E, D, H].
        shared_expert: `SwiGLU(D, S)` or None; shared_expert_gate: nn.Linear(D, 1) or None.
        aux_loss: fp32 scalar `load_balancing_loss` of the last forward (None before any).

    Raises:
        ValueError: naming the argument, if a size is not a positive integer (S: non-negative),
            K is outside 1..E, or the coefficient is negative or not finite.
    """

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        experts_per_token: int,
        norm_topk_prob: bool = False,
        shared_expert_dim: int = 0,
        router_aux_loss_coef: float = 0.0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("dim", dim, 1),
            ("hidden_dim", hidden_dim, 1),
            ("num_experts", num_experts, 1),
            ("shared_expert_dim", shared_expert_dim, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"MoEFeedForward {name}={value!r}; must be an integer >= {low}")
        if (
            not isinstance(experts_per_token, int)
            or isinstance(experts_per_token, bool)
            or not 1 <= experts_per_token <= num_experts
        ):
            raise ValueError(
                f"MoEFeedForward experts_per_token={experts_per_token!r}; must be in "
                f"1..num_experts={num_experts}"
            )
        coef = float(router_aux_loss_coef)
        if not (coef >= 0.0 and coef < float("inf")):
            raise ValueError(
                f"MoEFeedForward router_aux_loss_coef={router_aux_loss_coef!r}; must "
                "be a finite number >= 0"
            )
        self.dim, self.hidden_dim, self.num_experts = dim, hidden_dim, num_experts
        self.experts_per_token = experts_per_token
        self.norm_topk_prob = bool(norm_topk_prob)
        self.router_aux_loss_coef = coef
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        if shared_expert_dim > 0:
            self.shared_expert: SwiGLU | None = SwiGLU(dim, shared_expert_dim)
            self.shared_expert_gate: nn.Linear | None = nn.Linear(dim, 1, bias=False)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.aux_loss: Tensor | None = None
        self.reset_parameters(init_std)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Every weight (router, experts, shared expert and its gate) drawn from N(0, std), as
        HF `Qwen2MoePreTrainedModel._init_weights` with `initializer_range`."""
        for p in self.parameters():
            p.normal_(0.0, std)

    def route(self, x_ND: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(probs_NE fp32, weights_NK in x's dtype, experts_NK int64) for tokens `x_ND` [N, D]."""
        logits_NE = self.router(x_ND)
        probs_NE = torch.softmax(logits_NE.float(), dim=-1)
        weights_NK, experts_NK = torch.topk(probs_NE, self.experts_per_token, dim=-1)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return probs_NE, weights_NK.to(x_ND.dtype), experts_NK

    def _run_experts(
        self,
        tokens_sorted_by_expert: Tensor,
        counts_per_expert: Tensor | list[int],
        expert_range: range,
        weights: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Apply experts to tokens already grouped by expert.

        Args:
            tokens_sorted_by_expert: [A', D] rows for the experts of `expert_range`, in that
                order: the first `counts_per_expert[0]` rows go to `expert_range[0]`, and so on.
            counts_per_expert: [len(expert_range)] int64 tensor (or list of ints) of rows per
                expert; they sum to A'. A tensor is read on the host once (one sync).
            expert_range: indices into dim 0 of the stacked weights (all E experts, unless a
                parallel plan has split them and passes its local ones).
            weights: {"gate_proj", "up_proj", "down_proj"} stacked weights to use instead of
                this module's own (an expert-parallel rank's local shards).

        Returns:
            [A', D] expert outputs in the same row order (not yet weighted by the router).

        Raises:
            ValueError: if the counts do not match `expert_range` or the number of rows.
        """
        counts = (
            counts_per_expert.tolist()
            if isinstance(counts_per_expert, Tensor)
            else list(counts_per_expert)
        )
        if len(counts) != len(expert_range) or sum(counts) != tokens_sorted_by_expert.shape[0]:
            raise ValueError(
                f"counts_per_expert {counts} must have one entry per expert of "
                f"{expert_range} and sum to the {tokens_sorted_by_expert.shape[0]} "
                "rows"
            )
        w = weights or {
            "gate_proj": self.gate_proj,
            "up_proj": self.up_proj,
            "down_proj": self.down_proj,
        }
        outputs = []
        for expert, rows_AD in zip(expert_range, torch.split(tokens_sorted_by_expert, counts)):
            if rows_AD.shape[0] == 0:
                continue
            hidden_AH = F.silu(rows_AD @ w["gate_proj"][expert].t()) * (
                rows_AD @ w["up_proj"][expert].t()
            )
            outputs.append(hidden_AH @ w["down_proj"][expert].t())
        if not outputs:
            # No rows here. The result still depends on the rows and the weights: an
            # expert-parallel rank that received none must run the backward all-to-all its peers
            # run, and its expert weights get their (zero) gradients.
            return tokens_sorted_by_expert + 0.0 * sum(t.sum() for t in w.values())
        return torch.cat(outputs, dim=0)

    def experts_forward(self, rows_AD: Tensor, counts_E: Tensor) -> Tensor:
        """Expert outputs for rows grouped by expert (`counts_E` [E] rows per expert): all
        experts here; an expert-parallel plan replaces this with its token dispatch."""
        return self._run_experts(rows_AD, counts_E, range(self.num_experts))

    def forward(self, x: Tensor) -> Tensor:
        """[..., D] -> [..., D] (same dtype); stores the aux loss of this call in `aux_loss`."""
        shape = x.shape
        x_ND = x.reshape(-1, self.dim)
        probs_NE, weights_NK, experts_NK = self.route(x_ND)
        self.aux_loss = load_balancing_loss(probs_NE, experts_NK, self.num_experts)

        # Group the N * K assignments by expert (stable: tokens keep their order within one).
        experts_A = experts_NK.reshape(-1)
        order_A = torch.argsort(experts_A, stable=True)
        token_A = order_A // self.experts_per_token
        counts_E = torch.bincount(experts_A, minlength=self.num_experts)
        out_AD = self.experts_forward(x_ND[token_A], counts_E)
        out_AD = out_AD * weights_NK.reshape(-1)[order_A].unsqueeze(-1)
        y_ND = torch.zeros_like(x_ND).index_add_(0, token_A, out_AD)

        if self.shared_expert is not None and self.shared_expert_gate is not None:
            y_ND = y_ND + torch.sigmoid(self.shared_expert_gate(x_ND)) * self.shared_expert(x_ND)
        return y_ND.reshape(shape)

    def extra_repr(self) -> str:
        shared = self.shared_expert.gate_proj.out_features if self.shared_expert is not None else 0
        return (
            f"dim={self.dim}, hidden_dim={self.hidden_dim}, num_experts={self.num_experts}, "
            f"experts_per_token={self.experts_per_token}, norm_topk_prob={self.norm_topk_prob}, "
            f"shared_expert_dim={shared}, router_aux_loss_coef={self.router_aux_loss_coef}"
        )


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The `MoEFeedForward` modules of `model`, in module order (empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_aux_loss(model: nn.Module, *, scaled: bool = False) -> Tensor | None:
    """Sum over the MoE layers of `model` of the aux loss each stored in its last forward.

    Args:
        model: any module; its `MoEFeedForward` submodules are found with `model.modules()`.
        scaled: multiply each layer's loss by its `router_aux_loss_coef` (the term a training
            objective adds) instead of returning the raw sum.

    Returns:
        fp32 scalar (differentiable, on the layers' device), or None for a model without MoE
        layers.

    Raises:
        RuntimeError: if an MoE layer has not run a forward yet (no aux loss stored).
    """
    layers = moe_layers(model)
    if not layers:
        return None
    missing = [i for i, m in enumerate(layers) if m.aux_loss is None]
    if missing:
        raise RuntimeError(
            f"MoE layers {missing} (in module order) hold no aux loss: call "
            "moe_aux_loss after a forward pass of the model"
        )
    total: Tensor | None = None
    for m in layers:
        assert m.aux_loss is not None  # `missing` above is empty
        term = m.aux_loss * m.router_aux_loss_coef if scaled else m.aux_loss
        total = term if total is None else total + term
    return total
