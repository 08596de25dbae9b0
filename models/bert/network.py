"""A BERT encoder with a masked-language-model head, exactly the original BERT architecture, as plain ``nn.Module``
code.

Token, learned absolute position and token-type embeddings summed, then LayerNorm and dropout; post-LayerNorm
blocks (``x = LN(x + attn(x))``, ``x = LN(x + ffn(x))``) with a GELU feed-forward layer; the MLM head is a dense
layer, GELU and LayerNorm, then a decoder tied to the token embedding with its own output bias. Biases everywhere,
as BERT has. Attention is bidirectional and goes through ``F.scaled_dot_product_attention``; padded keys are masked
out with ``attention_mask``. Initialisation (``initial_std``) is BERT's: normal(0, 0.02) for every weight matrix
and embedding, zeros for biases, ones for the norms' weights. Nothing here knows about processes, devices or
precision: ``models/parallel/parallelize.py`` builds the model on the meta device, shards and initialises it
(``models.parallel.parallelize.build_network``).

As in ``models/gpt/network.py``, shapes are read from the tensors rather than the config wherever tensor parallelism
shards them: a rank then holds n_head / tp heads and intermediate_size / tp feed-forward columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from core.tokens import BYTE_BERT_VOCAB_SIZE
from models.named_configs import named_config


@dataclass(frozen=True)
class BertConfig:
    n_layer: int
    n_head: int
    n_embd: int
    intermediate_size: int  # the feed-forward layer's width; 4 x n_embd in every released BERT
    max_position_embeddings: int = 512  # longest sequence; the size of the position-embedding table
    vocab_size: int = 30522  # the uncased WordPiece vocabulary of the released BERTs
    type_vocab_size: int = 2  # sentence A and sentence B
    dropout: float = 0.1  # BERT's, on embeddings, attention probabilities and both residual branches
    layer_norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


# Named sizes. "bert-tiny" is for tests, "bert-small" learns the embedded byte-level corpus (bytes plus the four
# special tokens of core.tokens.BYTE_SPECIAL_TOKENS) in minutes on 2 CPU cores, "bert-base" and "bert-large" are
# Google's released shapes.
BERT_CONFIGS: dict[str, BertConfig] = {
    "bert-tiny": BertConfig(n_layer=2, n_head=2, n_embd=32, intermediate_size=128, max_position_embeddings=64,
                            vocab_size=BYTE_BERT_VOCAB_SIZE),
    "bert-small": BertConfig(n_layer=4, n_head=4, n_embd=128, intermediate_size=512, max_position_embeddings=128,
                             vocab_size=BYTE_BERT_VOCAB_SIZE),
    "bert-base": BertConfig(n_layer=12, n_head=12, n_embd=768, intermediate_size=3072),
    "bert-large": BertConfig(n_layer=24, n_head=16, n_embd=1024, intermediate_size=4096),
}


def bert_config(name: str, **overrides: int | float | None) -> BertConfig:
    """The named config with the given fields replaced (fields set to None are left as they are)."""
    return named_config(BERT_CONFIGS, name, overrides)


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.head_size = config.n_embd // config.n_head
        self.dropout = config.dropout
        # three projections, as BERT has them: a column shard of each (tensor parallelism) holds whole heads
        self.query = nn.Linear(config.n_embd, config.n_embd)
        self.key = nn.Linear(config.n_embd, config.n_embd)
        self.value = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, nh, T, hs) each; nh is this rank's heads
        q, k, v = (projection(x).view(B, T, -1, self.head_size).transpose(1, 2)
                   for projection in (self.query, self.key, self.value))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh * hs)
        return self.resid_dropout(self.proj(y))


class FeedForward(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size)
        self.gelu = nn.GELU()  # BERT's exact (erf) GELU, not GPT-2's tanh approximation
        self.proj = nn.Linear(config.intermediate_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(config)
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = FeedForward(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        # post-LayerNorm, as the original BERT: the norm is applied to the sum, after the residual
        x = self.ln_1(x + self.attn(x, attn_mask))
        return self.ln_2(x + self.mlp(x))


class MaskedLMHead(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.n_embd, config.n_embd)
        self.gelu = nn.GELU()
        self.ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.n_embd, config.vocab_size)  # its weight is tied by BERT, its bias is its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(self.gelu(self.dense(x))))


class BERT(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.n_embd)
        self.token_type_embedding = nn.Embedding(config.type_vocab_size, config.n_embd)
        self.ln_embedding = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.dropout)
        # keyed "0", "1", ... as GPT.blocks, so that the parallelize functions treat both models alike
        self.blocks = nn.ModuleDict({str(index): Block(config) for index in range(config.n_layer)})
        self.head = MaskedLMHead(config)
        self.head.decoder.weight = self.token_embedding.weight  # tied: one matrix, counted once

    def initial_std(self, name: str) -> float | None:
        """BERT's initialisation of parameter ``name``: the std of its zero-mean normal draw (0.02 for every weight
        matrix and embedding), or None for the norms' weights (1) and every bias (0). Applied by
        ``models.parallel.parallelize.init_weights``."""
        module = name.rsplit(".", 2)[-2]
        if name.endswith("bias") or module.startswith("ln"):
            return None
        return 0.02

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (B, T) to logits over the vocabulary at every position (B, T, vocab_size). ``attention_mask``
        (B, T) holds 1 for real tokens and 0 for padding: no position attends to a padded one (a padded position's
        own output is meaningless; leave it out of the loss). ``token_type_ids`` (B, T) says which sentence each
        token belongs to (0 or 1; all 0 if not given)."""
        x = self.embed(input_ids, token_type_ids)
        # True where attention is allowed, broadcast over heads and query positions: (B, 1, 1, T)
        attn_mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for block in self.blocks.values():
            x = block(x, attn_mask)
        return self.head(x)  # (B, T, vocab_size)

    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) to the first block's input (B, T, C): what a pipeline's first stage runs before its
        blocks (which then attend to every position: pipelined batches hold no padding within a sequence)."""
        T = input_ids.size(1)
        if T > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {T} exceeds the model's max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(T, device=input_ids.device)
        x = (self.token_embedding(input_ids) + self.position_embedding(positions)
             + self.token_type_embedding(token_type_ids))  # (B, T, C)
        return self.drop(self.ln_embedding(x))

    def num_parameters(self) -> int:
        """Parameters counted once each (the tied decoder shares the token embedding)."""
        return sum(p.numel() for p in self.parameters())
