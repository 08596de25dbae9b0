"""A decoder-only Transformer in the Llama architecture, as plain ``nn.Module`` code.

Rotary position embeddings (RoPE, base ``rope_base``) on queries and keys, pre-RMSNorm blocks, a SwiGLU MLP,
grouped-query attention (``n_kv_head`` key/value heads shared by groups of the ``n_head`` query heads) through
``F.scaled_dot_product_attention``, no biases, and an output head that is its own matrix unless
``tie_word_embeddings``. The parameter names are Hugging Face's ``LlamaForCausalLM``'s without its ``model.``
prefix (``layers.0.self_attn.q_proj.weight``), and RoPE rotates the two halves of each head (Hugging Face's
layout, not the interleaved pairs of Meta's original code), so a Hugging Face folder's tensors load as they are.

Shapes are read from the tensors wherever tensor parallelism shards them: a rank holds n_head / tp query heads,
n_kv_head / tp key/value heads and intermediate_size / tp MLP columns. ``forward`` is ``embed``, the blocks, then
``head``, so a pipeline stage (models/parallel/pipeline.py) is this model with the other stages' parts removed.
Nothing here knows about processes, devices or precision (models/parallel/parallelize.py builds, shards and
initialises it).
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
class LlamaConfig:
    n_layer: int
    n_head: int  # query heads
    n_kv_head: int  # key/value heads, each shared by n_head / n_kv_head query heads
    n_embd: int
    intermediate_size: int  # the SwiGLU MLP's width
    block_size: int = 2048  # longest sequence
    vocab_size: int = 32000
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # Llama 3's long-context RoPE scaling: (factor, low_freq_factor, high_freq_factor, the context it was trained at);
    # None: plain RoPE
    rope_scaling: tuple[float, float, float, int] | None = None

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0 or (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of an even size")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


# Named sizes: "debug" for tests, "small" learns the embedded byte-level corpus on 2 CPU cores, "1b" and "8b" those of
# Llama 3.2 1B and Llama 3.1 8B (RoPE base 500,000 with Llama 3's scaling to a 131,072-token context).
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, block_size=64,
                         vocab_size=BYTE_VOCAB_SIZE),
    "small": LlamaConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352, block_size=128,
                         vocab_size=BYTE_VOCAB_SIZE),
    "1b": LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192, block_size=131072,
                      vocab_size=128256, rope_base=500000.0, tie_word_embeddings=True,
                      rope_scaling=(32.0, 1.0, 4.0, 8192)),
    "8b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336, block_size=131072,
                      vocab_size=128256, rope_base=500000.0, rope_scaling=(8.0, 1.0, 4.0, 8192)),
}


def llama_config(name: str, **overrides: int | float | bool | None) -> LlamaConfig:
    """The named config with the given fields replaced (fields set to None are left as they are)."""
    return named_config(LLAMA_CONFIGS, name, overrides)


def rotary_tables(sequence_length: int, head_size: int, base: float, device: torch.device,
                  scaling: tuple[float, float, float, int] | None = None) -> tuple[torch.Tensor, ...]:
    """cos and sin (T, hs) of each position's angles: frequency i turns by base^(-2i/hs) per position (Llama 3's
    ``scaling`` slows the low ones), and the two halves of a head share the frequencies. Computed per forward
    (T x hs/2 products, nothing beside the matmuls), so the network holds no buffer that sharding or initialisation
    would have to remember."""
    frequencies = base ** (-torch.arange(0, head_size, 2, device=device, dtype=torch.float32) / head_size)
    if scaling is not None:
        frequencies = llama3_scaled(frequencies, *scaling)
    angles = torch.outer(torch.arange(sequence_length, device=device, dtype=torch.float32), frequencies)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def llama3_scaled(frequencies: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                  trained_context: int) -> torch.Tensor:
    """Llama 3's RoPE frequencies for a context beyond the one it was trained at: those whose wavelength is shorter
    than trained_context / high_freq_factor stay, those longer than trained_context / low_freq_factor are divided by
    ``factor``, and those between are blended smoothly."""
    wavelengths = 2 * math.pi / frequencies
    blend = ((trained_context / wavelengths - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0, 1)
    return (1 - blend) * frequencies / factor + blend * frequencies


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, nh, T, hs): each pair (x_i, x_{i + hs/2}) turned by its position's angle, in float32."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = x.float() * cos + torch.cat((-second, first), dim=-1) * sin
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_size = config.head_size
        self.rope_base = config.rope_base
        self.rope_scaling = config.rope_scaling
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_size, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_size, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_size, bias=False)
        self.o_proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nh, T, hs); nh: this rank's
        k = self.k_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_size).transpose(1, 2)
        cos, sin = rotary_tables(T, self.head_size, self.rope_base, x.device, self.rope_scaling)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    block_class: type[nn.Module] = Block  # a decoder of Llama's shape with other blocks (models/moe/) sets its own

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        # keyed "0", "1", ...: a pipeline stage drops the other stages' blocks without renumbering its own
        self.layers = nn.ModuleDict({str(index): self.block_class(config) for index in range(config.n_layer)})
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def initial_std(self, name: str) -> float | None:
        """The std of parameter ``name``'s zero-mean normal draw (Hugging Face's initializer_range, 0.02), or None
        for the norms' weights (1). The output projections of each sub-layer are scaled by 1 / sqrt(2 n_layer), as
        GPT-2's, so the residual stream's variance does not grow with depth."""
        if name.endswith("norm.weight"):
            return None
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return 0.02 / (2 * self.config.n_layer) ** 0.5
        return 0.02

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) to next-token logits (B, T, vocab_size)."""
        x = self.embed(idx)
        for block in self.layers.values():
            x = block(x)
        return self.head(x)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) to the first block's input (B, T, C): a pipeline's first stage runs this."""
        if idx.size(1) > self.config.block_size:
            raise ValueError(f"sequence length {idx.size(1)} exceeds the model's block_size {self.config.block_size}")
        return self.embed_tokens(idx)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's output (B, T, C) to logits (B, T, vocab_size): a pipeline's last stage runs this."""
        return self.lm_head(self.norm(x))

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Extend the (B, T) prompt by sampling ``max_new_tokens`` tokens, cropping the context to block_size."""
        return sample(self, idx, max_new_tokens, self.config.block_size, temperature, top_k, generator)


def llama_training_flops_per_token(config: LlamaConfig, sequence_length: int) -> float:
    """Training FLOPs per token: 6N over the matmul weights (the embedding lookup is none; the head is one whether
    tied or not) and 12·L·H·Q·T for the attention scores, as models/gpt/network.py counts GPT's."""
    attention = config.n_embd * config.head_size * (2 * config.n_head + 2 * config.n_kv_head)
    block = attention + 3 * config.n_embd * config.intermediate_size
    weights = config.n_layer * block + config.vocab_size * config.n_embd
    return 6 * weights + 12 * config.n_layer * config.n_head * config.head_size * sequence_length
