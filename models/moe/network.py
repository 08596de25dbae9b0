"""A mixture-of-experts decoder, as plain ``nn.Module`` code: Llama's (models/llama/network.py) with each block's
MLP replaced by routed experts, the architecture of Mixtral and Qwen3-MoE.

Each token's router picks ``top_k`` of ``n_expert`` SwiGLU experts by the softmax of its logits (in float32), and the
block adds their outputs weighted by those probabilities (renormalised over the chosen ones where
``normalize_top_k``), plus an always-on shared expert's where ``shared_expert_size``. With a ``capacity_factor`` an
expert takes at most ceil(capacity_factor x T x top_k / n_expert) tokens of each sequence, first come first served;
the choices beyond are dropped (the token keeps its residual and its other choices). Capacity and the load-balancing
loss are per sequence (DeepSeek-V3's sequence-wise balance), so neither depends on how a batch is split over ranks:
one process and any data-parallel layout route and drop the same tokens.

The experts hold their weights stacked, ``gate_proj``/``up_proj`` (n_expert, width, n_embd) and ``down_proj``
(n_expert, n_embd, width), and ``Experts.forward`` takes the routed tokens grouped by expert with each expert's
count, so expert parallelism (models/parallel/) shards the first dimension over ranks and exchanges the groups with
all-to-all around it, and nothing here changes. Parameter names follow Llama's (Hugging Face's without ``model.``);
models/moe/huggingface.py maps the experts to Mixtral's and Qwen3-MoE's.

Each MoE layer keeps what its last forward routed, for the loss and the monitor: ``tokens_per_expert`` (n_expert,),
``dropped_tokens`` and ``balance_loss``. Nothing here knows about processes, devices or precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.tokens import BYTE_VOCAB_SIZE
from models.llama.network import Attention, Llama, rotary_tables, rotate
from models.named_configs import named_config


@dataclass(frozen=True)
class MoEConfig:
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads, each shared by n_head / n_kv_head query heads
    n_embd: int
    n_expert: int  # routed experts per layer
    top_k: int  # experts each token is routed to
    expert_size: int  # each routed expert's SwiGLU width
    shared_expert_size: int = 0  # an always-on SwiGLU expert's width; 0: none
    normalize_top_k: bool = True  # renormalise the chosen experts' probabilities to sum to 1 (Mixtral, Qwen3-MoE)
    capacity_factor: float | None = None  # tokens an expert takes per sequence, as a multiple of an even share; None: all
    load_balance_coefficient: float = 0.01  # weight of the balance loss in the training loss (Switch Transformer's)
    head_dim: int | None = None  # None: n_embd / n_head (Qwen3 sets it apart)
    qk_norm: bool = False  # RMSNorm on each query and key head before RoPE (Qwen3)
    block_size: int = 2048
    vocab_size: int = 32000
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    rope_scaling: tuple[float, float, float, int] | None = None  # Llama 3's; Attention reads it

    def __post_init__(self) -> None:
        if self.head_dim is None and self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads")
        if self.head_size % 2 != 0:
            raise ValueError(f"the head size {self.head_size} must be even for RoPE")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be between 1 and n_expert={self.n_expert}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be positive, or null to drop no token")

    @property
    def head_size(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    def capacity(self, sequence_length: int) -> int | None:
        """Token choices an expert takes per sequence; None: all."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * sequence_length * self.top_k / self.n_expert)


# Named sizes: "debug" for tests, of Mixtral's shape, and "debug-qwen3" of Qwen3-MoE's (queries and keys normalised,
# heads wider than n_embd / n_head, the chosen experts' probabilities not renormalised); "small" learns the embedded
# byte-level corpus on 2 CPU cores with as many active
# parameters as Llama's "small" (two experts of half its MLP width per token); "mixtral-8x7b" and "qwen3-30b-a3b"
# are those models' shapes (46.7B and 30.5B parameters, 12.9B and 3.3B active).
MOE_CONFIGS: dict[str, MoEConfig] = {
    "debug": MoEConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_expert=4, top_k=2, expert_size=32,
                       block_size=64, vocab_size=BYTE_VOCAB_SIZE),
    "debug-qwen3": MoEConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_expert=4, top_k=2, expert_size=16,
                             normalize_top_k=False, load_balance_coefficient=0.001, head_dim=16, qk_norm=True,
                             block_size=64, vocab_size=BYTE_VOCAB_SIZE, norm_eps=1e-6),
    "small": MoEConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, n_expert=8, top_k=2, expert_size=176,
                       block_size=128, vocab_size=BYTE_VOCAB_SIZE),
    "mixtral-8x7b": MoEConfig(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, n_expert=8, top_k=2, expert_size=14336,
                              load_balance_coefficient=0.02, block_size=32768, rope_base=1e6),
    "qwen3-30b-a3b": MoEConfig(n_layer=48, n_head=32, n_kv_head=4, n_embd=2048, n_expert=128, top_k=8,
                               expert_size=768, load_balance_coefficient=0.001, head_dim=128, qk_norm=True,
                               block_size=40960, vocab_size=151936, rope_base=1e6, norm_eps=1e-6),
}


def moe_config(name: str, **overrides: int | float | bool | None) -> MoEConfig:
    """The named config with the given fields replaced (fields set to None are left as they are)."""
    return named_config(MOE_CONFIGS, name, overrides)


class MoEAttention(Attention):
    """Llama's grouped-query attention, with Qwen3's per-head RMSNorm of queries and keys where ``qk_norm``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config)  # type: ignore[arg-type]  # reads the fields MoEConfig shares with LlamaConfig
        self.q_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_norm is None:
            return super().forward(x)
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.head_size)).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_norm(self.k_proj(x).view(B, T, -1, self.head_size)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)
        cos, sin = rotary_tables(T, self.head_size, self.rope_base, x.device, self.rope_scaling)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
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

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.normalize_top_k = config.normalize_top_k
        self.config = config
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = Experts(config.n_expert, config.n_embd, config.expert_size)
        self.shared_expert = SwiGLU(config.n_embd, config.shared_expert_size) if config.shared_expert_size else None
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
        capacity = self.config.capacity(sequence_length)
        if capacity is None:
            return None
        one_hot = F.one_hot(choices, n_expert)  # (B, T x k, E)
        place = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1  # 0 for an expert's first choice in the sequence
        return place < capacity


class Block(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = MoEAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MoEFeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MoE(Llama):
    """Llama's decoder (embedding, blocks, norm, head, generation) with MoE blocks."""

    block_class = Block

    def initial_std(self, name: str) -> float | None:
        """Llama's, the stacked experts' output projections (``down_proj``, no ``.weight``) scaled as the others."""
        return super().initial_std(name + ".weight" if name.endswith("experts.down_proj") else name)


def moe_parameter_counts(config: MoEConfig) -> tuple[int, int]:
    """(all parameters, those one token's forward uses): the routed experts count top_k times, not n_expert."""
    attention = config.n_embd * config.head_size * (2 * config.n_head + 2 * config.n_kv_head)
    norms = 2 * config.n_embd + (2 * config.head_size if config.qk_norm else 0)
    expert = 3 * config.n_embd * config.expert_size
    dense = attention + norms + config.n_expert * config.n_embd + 3 * config.n_embd * config.shared_expert_size
    embeddings = config.vocab_size * config.n_embd * (1 if config.tie_word_embeddings else 2) + config.n_embd
    total = config.n_layer * (dense + config.n_expert * expert) + embeddings
    active = config.n_layer * (dense + config.top_k * expert) + embeddings
    return total, active


def moe_training_flops_per_token(config: MoEConfig, sequence_length: int) -> float:
    """Training FLOPs per token: 6 x the matmul weights one token meets (the router, its top_k experts, the shared
    expert, attention, the head) and 12·L·H·Q·T for the attention scores, as models/llama/network.py counts."""
    attention = config.n_embd * config.head_size * (2 * config.n_head + 2 * config.n_kv_head)
    mlp = config.n_embd * (config.n_expert + 3 * config.top_k * config.expert_size + 3 * config.shared_expert_size)
    weights = config.n_layer * (attention + mlp) + config.vocab_size * config.n_embd
    return 6 * weights + 12 * config.n_layer * config.n_head * config.head_size * sequence_length
