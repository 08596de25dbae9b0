"""A mixture-of-experts decoder, as plain ``nn.Module`` code: Llama's (models/llama/network.py) with each block's
MLP replaced by routed experts, the architecture of Mixtral and Qwen3-MoE.

Each block's MLP is models/routed_experts.py's layer: a router picking ``top_k`` of ``n_expert`` SwiGLU experts per
token, an optional shared expert, a per-sequence capacity and balance loss. Parameter names follow Llama's (Hugging
Face's without ``model.``); models/moe/huggingface.py maps the experts to Mixtral's and Qwen3-MoE's. Nothing here
knows about processes, devices or precision.
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
from models.routed_experts import MoEFeedForward


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


class Block(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = MoEAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MoEFeedForward(config.n_embd, config.n_expert, config.top_k, config.expert_size,
                                  config.shared_expert_size, config.normalize_top_k, config.capacity_factor)

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
