"""The optimizer every family trains with, configured in one group (``model.optimizer``): AdamW, decaying only the
weight matrices, with linear warmup and cosine decay stepped per optimizer step, and the linear scaling rule for
the learning rate when a reference batch size is given. A family sets its own defaults (BERT's are the paper's)
by giving a different default ``OptimizerSettings``; a config overrides any field and keeps the family's others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_info

from core.errors import check_ranges


@dataclass(frozen=True)
class OptimizerSettings:
    """
    Args:
        learning_rate: peak learning rate (before batch-size scaling).
        min_learning_rate_ratio: the cosine decay ends at learning_rate times this.
        weight_decay: AdamW decay on weight matrices and convolution kernels; never biases, norms or embeddings.
        betas: AdamW betas.
        warmup_steps: optimizer steps of linear warmup from 0.
        lr_decay_steps: optimizer steps until the decay ends; None means the whole run.
        reference_batch_size: if set, learning_rate is scaled by the global batch size / this (the linear rule).
    """

    learning_rate: float = 6e-4
    min_learning_rate_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 100
    lr_decay_steps: int | None = None
    reference_batch_size: int | None = None

    def __post_init__(self) -> None:
        check_ranges("model.optimizer", {
            "learning_rate": (self.learning_rate > 0, "> 0"),
            "min_learning_rate_ratio": (0 <= self.min_learning_rate_ratio <= 1, "in [0, 1]"),
            "weight_decay": (self.weight_decay >= 0, ">= 0"),
            "betas": (len(self.betas) == 2 and all(0 <= beta < 1 for beta in self.betas), "two numbers in [0, 1)"),
            "warmup_steps": (self.warmup_steps >= 0, ">= 0"),
            "lr_decay_steps": (self.lr_decay_steps is None or self.lr_decay_steps > 0, "> 0, or null for the whole run"),
            "reference_batch_size": (self.reference_batch_size is None or self.reference_batch_size > 0,
                                     "> 0, or null"),
        }, vars(self))

    def peak_learning_rate(self, global_batch_size: int) -> float:
        """The peak learning rate after the linear scaling rule, if a reference batch size is configured."""
        if self.reference_batch_size is None:
            return self.learning_rate
        return self.learning_rate * global_batch_size / self.reference_batch_size

    def configure(self, network: nn.Module, device: torch.device, global_batch_size: int,
                  total_steps: int) -> dict[str, Any]:
        """Lightning's ``configure_optimizers`` answer for ``network``: AdamW and its per-step schedule."""
        lr = self.peak_learning_rate(global_batch_size)
        if self.reference_batch_size is not None:
            rank_zero_info(f"learning rate {lr:.3g} = {self.learning_rate:.3g} x global batch {global_batch_size} / "
                           f"reference batch {self.reference_batch_size}")
        optimizer = torch.optim.AdamW(
            weight_decay_groups(network, self.weight_decay), lr=lr, betas=self.betas,
            # one kernel for all parameters where torch has it; under fp16's grad scaler too, since
            # CohortModule.configure_gradient_clipping unscales the gradients a fused optimizer would unscale itself
            fused=device.type in ("cuda", "cpu"),
        )
        schedule = warmup_cosine_schedule(self.warmup_steps, int(self.lr_decay_steps or total_steps),
                                          self.min_learning_rate_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay only the weight matrices and convolution kernels: never biases, norms or embeddings (a tied head
    included), as the GPT-2 and BERT recipes do."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in embeddings]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine_schedule(warmup_steps: int, decay_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier for step s: linear warmup to 1, cosine down to ``min_ratio`` at ``decay_steps``, then flat."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if step >= decay_steps:
            return min_ratio
        progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
        return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))

    return multiplier
