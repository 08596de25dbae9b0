"""Routed experts: the feed-forward layer of a mixture of experts, which any network may use as its blocks' MLP
(models/moe/network.py's decoder does). Expert parallelism (models/parallel/expert_parallel.py) and the monitor's
routing statistics (app/observability/routing.py) find these layers in any network, so they live here, beside the
families, not in one of them.

Each token's router picks ``top_k`` of the experts by the softmax of its logits (in float32), and the layer adds
their outputs weighted by those probabilities (renormalised over the chosen ones where ``normalize_top_k``), plus an
always-on shared expert's where ``shared_expert_size``. With a ``capacity_factor`` an expert takes at most
ceil(capacity_factor x T x top_k / n_expert) token choices of each sequence, first come first served; the choices
beyond are dropped (the token keeps its residual and its other choices). Capacity and the load-balancing loss are per
sequence (DeepSeek-V3's sequence-wise balance), so neither depends on how a batch is split over ranks: one process and
any data-parallel layout route and drop the same tokens.

The experts hold their weights stacked, ``gate_proj``/``up_proj`` (n_expert, width, n_embd) and ``down_proj``
(n_expert, n_embd, width), and ``Experts.forward`` takes the routed tokens grouped by expert with each expert's count,
so expert parallelism shards the first dimension over ranks and exchanges the groups with all-to-all around it, and
nothing here changes. Each layer keeps what its last forward routed, for the loss and the monitor:
``tokens_per_expert`` (n_expert,), ``dropped_tokens`` and ``balance_loss``. Nothing here knows about processes,
devices or precision.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLUExpert(nn.Module):
    """One SwiGLU MLP: the always-on shared expert."""

    def __init__(self, n_embd: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(n_embd, width, bias=False)
        self.up_proj = nn.Linear(n_embd, width, bias=False)
        self.down_proj = nn.Linear(width, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """``n_expert`` SwiGLU MLPs with their weights stacked on a first dimension of experts. Their arithmetic is
    ``expert_outputs``, which expert parallelism (models/parallel/expert_parallel.py) runs on a rank's own slice of
    the weights (the shapes are read from the tensors)."""

    def __init__(self, n_expert: int, n_embd: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_expert, width, n_embd))
        self.up_proj = nn.Parameter(torch.empty(n_expert, width, n_embd))
        self.down_proj = nn.Parameter(torch.empty(n_expert, n_embd, width))

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``tokens`` (N, C) grouped by expert, in expert order: the first ``tokens_per_expert[0]`` rows for expert 0,
        and so on; rows past their sum are dropped choices, whose outputs are zero. Returns (N, C) in the same order."""
        return expert_outputs(self.gate_proj, self.up_proj, self.down_proj, tokens, tokens_per_expert)


def expert_outputs(gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, tokens: torch.Tensor,
                   tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``Experts.forward`` on the stacked weights given (expert parallelism passes a rank's own slice of them). On the
    meta device, which has no counts, the rows are shared evenly (the work of a balanced router: what FLOP counts and
    memory estimates see)."""
    n_expert = gate_proj.shape[0]
    if tokens.is_meta:
        share, extra = divmod(tokens.shape[0], n_expert)
        sizes = [share + (expert < extra) for expert in range(n_expert)]
    else:
        sizes = tokens_per_expert.tolist()
    outputs = []
    for expert, group in enumerate(tokens[: sum(sizes)].split(sizes)):
        hidden = F.silu(group @ gate_proj[expert].T) * (group @ up_proj[expert].T)
        outputs.append(hidden @ down_proj[expert].T)
    outputs.append(tokens.new_zeros(tokens.shape[0] - sum(sizes), tokens.shape[1]))
    return torch.cat(outputs)


class MoEFeedForward(nn.Module):
    """The router, the routed experts and the optional shared expert: one block's MLP."""

    def __init__(self, n_embd: int, n_expert: int, top_k: int, expert_size: int, shared_expert_size: int = 0,
                 normalize_top_k: bool = True, capacity_factor: float | None = None) -> None:
        """``n_expert`` experts of width ``expert_size``, ``top_k`` of them per token; a shared expert of width
        ``shared_expert_size`` (0: none); ``capacity_factor``: token choices an expert takes per sequence, as a
        multiple of an even share (None: all)."""
        super().__init__()
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(n_embd, n_expert, bias=False)
        self.experts = Experts(n_expert, n_embd, expert_size)
        self.shared_expert = SwiGLUExpert(n_embd, shared_expert_size) if shared_expert_size else None
        # what the last forward routed, read by the family's loss and the monitor
        self.tokens_per_expert: torch.Tensor | None = None  # (E,) token choices per expert, before dropping
        self.dropped_tokens: torch.Tensor | None = None  # token choices beyond an expert's capacity
        self.balance_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        n_expert, k = self.router.weight.shape[0], self.top_k
        probabilities = F.linear(x.float(), self.router.weight.float()).softmax(dim=-1)  # (B, T, E)
        weights, choices = probabilities.topk(k, dim=-1)  # (B, T, k) each, best first
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        choices = choices.view(B, T * k)  # each sequence's token choices, token by token
        routed = torch.zeros(B, n_expert, dtype=torch.long, device=x.device).scatter_add_(
            1, choices, torch.ones_like(choices))  # (B, E) choices per expert per sequence
        kept = self.within_capacity(choices, n_expert, T)
        self.tokens_per_expert = routed.sum(0).detach()
        self.dropped_tokens = (~kept).sum().detach() if kept is not None else x.new_zeros((), dtype=torch.long)
        # Switch Transformer's loss, per sequence: E x sum_e (share of the choices to e) x (mean probability of e);
        # 1 when the router is even, larger the more it favours the experts it picks
        shares = routed.float() / (T * k)
        self.balance_loss = n_expert * (shares * probabilities.mean(dim=1)).sum(dim=-1).mean()

        # group the kept choices by expert (dropped ones last, in an extra bucket), run the experts, add each
        # choice's weighted output back to its token
        flat = choices.flatten() if kept is None else torch.where(kept, choices, n_expert).flatten()
        order = flat.argsort(stable=True)
        tokens_per_expert = torch.zeros(n_expert + 1, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))[:n_expert]
        token_of_choice = order // k  # rows of x.view(B * T, C)
        outputs = self.experts(x.reshape(B * T, C)[token_of_choice], tokens_per_expert)
        outputs = outputs * weights.flatten()[order].unsqueeze(-1).to(outputs.dtype)
        y = torch.zeros(B * T, C, dtype=outputs.dtype, device=x.device).index_add_(0, token_of_choice, outputs)
        y = y.view(B, T, C).to(x.dtype)
        return y if self.shared_expert is None else y + self.shared_expert(x)

    def within_capacity(self, choices: torch.Tensor, n_expert: int, sequence_length: int) -> torch.Tensor | None:
        """(B, T x k) whether each choice is within its expert's capacity in its sequence (earlier tokens first);
        None with no capacity."""
        if self.capacity_factor is None:
            return None
        capacity = expert_capacity(self.capacity_factor, sequence_length, self.top_k, n_expert)
        one_hot = F.one_hot(choices, n_expert)  # (B, T x k, E)
        place = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1  # 0 for an expert's first choice in the sequence
        return place < capacity


def expert_capacity(capacity_factor: float, sequence_length: int, top_k: int, n_expert: int) -> int:
    """Token choices an expert takes of each sequence: ``capacity_factor`` times an even share of its choices."""
    return math.ceil(capacity_factor * sequence_length * top_k / n_expert)


def moe_layers(network: nn.Module) -> list[MoEFeedForward]:
    """The network's routed-expert layers, in order, however it is wrapped (FSDP2, activation checkpointing)."""
    return [module for module in network.modules() if isinstance(module, MoEFeedForward)]
