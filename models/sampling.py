"""Sampling a continuation from any next-token network, one token at a time (the families' ``predict`` and the
sample at the end of ``fit``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.no_grad()
def sample(network: nn.Module, idx: torch.Tensor, max_new_tokens: int, context_length: int, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend the (B, T) prompt ``idx`` by ``max_new_tokens`` tokens drawn from ``network``'s logits (B, T, vocab) at
    ``temperature``, among the ``top_k`` most likely (None: all), the context cropped to ``context_length``."""
    for _ in range(max_new_tokens):
        logits = network(idx[:, -context_length:])[:, -1, :] / max(temperature, 1e-5)
        if top_k is not None:
            kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat((idx, next_token), dim=1)
    return idx
