"""A decoder-only GPT with exactly the GPT-2 architecture, as plain ``nn.Module`` code.

Learned absolute position embeddings, pre-LayerNorm blocks, a GELU MLP of width 4 x n_embd, the output head
tied to the token embedding, and GPT-2's initialisation (``initial_std``: normal(0, 0.02), with the residual
projections scaled by 1 / sqrt(2 * n_layer)). Attention goes through ``F.scaled_dot_product_attention`` so that
the fastest kernel for the device is picked. Nothing here knows about processes, devices or precision: the model
is built (usually on the meta device), then ``models/parallel/parallelize.py`` shards and initialises it.

Shapes are read from the tensors, not the config, wherever tensor parallelism shards them: a rank then holds
n_head / tp heads and 4 * n_embd / tp MLP columns. ``forward`` is ``embed``, the blocks, then ``head``: a pipeline
stage (models/parallel/pipeline.py) is this same model with the parts other stages hold removed, running the parts
it holds, so a stage's parameter names are the unsplit model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.tokens import BYTE_VOCAB_SIZE
from models.named_configs import named_config
from models.sampling import sample


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int = 1024  # longest sequence; the size of the position-embedding table
    vocab_size: int = 50257
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in every Linear and LayerNorm

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


# Named sizes. "debug" is for tests, "small" learns the embedded byte-level corpus in minutes on 2 CPU cores,
# the gpt2* entries are OpenAI's released shapes, "gpt-7b" is a multi-billion size meant for sharded training.
GPT_CONFIGS: dict[str, GPTConfig] = {
    "debug": GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=BYTE_VOCAB_SIZE),
    "small": GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=BYTE_VOCAB_SIZE),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    "gpt-2.7b": GPTConfig(n_layer=32, n_head=32, n_embd=2560, block_size=2048),
    "gpt-6.7b": GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048),
}


def gpt_config(name: str, **overrides: int | float | bool | None) -> GPTConfig:
    """The named config with the given fields replaced (fields set to None are left as they are)."""
    return named_config(GPT_CONFIGS, name, overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.dropout
        # one fused projection whose output is laid out head by head, (q, k, v) within each head, so that a
        # column shard (tensor parallelism) holds whole heads with their q, k and v
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, -1, 3, self.head_size)  # (B, T, nh, 3, hs); nh is this rank's heads
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 used the tanh approximation
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        # a dict keyed "0", "1", ... rather than a list: the names are the same ("blocks.3.attn...") and a pipeline
        # stage can drop the blocks other stages hold without renumbering its own
        self.blocks = nn.ModuleDict({str(index): Block(config) for index in range(config.n_layer)})
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix, counted once

    def initial_std(self, name: str) -> float | None:
        """GPT-2's initialisation of parameter ``name``: the std of its zero-mean normal draw, or None for the
        norms' weights (1) and every bias (0). Residual projections are scaled so that the residual stream's
        variance does not grow with depth. Applied by ``models.parallel.parallelize.init_weights``."""
        if name.endswith("bias") or name.startswith("ln_f") or ".ln_" in name:
            return None
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            return 0.02 / math.sqrt(2 * self.config.n_layer)
        return 0.02

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) to next-token logits (B, T, vocab_size)."""
        x = self.embed(idx)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) to the first block's input (B, T, C): what a pipeline's first stage runs before its
        blocks."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's block_size {self.config.block_size}")
        return self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output (B, T, C) to logits (B, T, vocab_size): what a pipeline's last stage runs after
        its blocks."""
        return self.lm_head(self.ln_f(x))

    def num_parameters(self) -> int:
        """Parameters counted once each (the tied head shares the token embedding)."""
        return sum(p.numel() for p in self.parameters())

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend the (B, T) prompt by sampling ``max_new_tokens`` tokens, cropping the context to block_size."""
        return sample(self, idx, max_new_tokens, self.config.block_size, temperature, top_k, generator)


def training_flops_per_token(config: GPTConfig, sequence_length: int) -> float:
    """Training (forward + backward) FLOPs per token: 6N for the weights, 12·L·H·Q·T for attention scores
    (PaLM, appendix B: N parameters excluding the position table, L layers, H heads, Q head size, T sequence length)."""
    params = config.n_layer * (12 * config.n_embd**2 + 13 * config.n_embd) + 2 * config.n_embd
    params += config.vocab_size * config.n_embd  # the tied head is a real matmul; the position table is not
    head_size = config.n_embd // config.n_head
    return 6 * params + 12 * config.n_layer * config.n_head * head_size * sequence_length
