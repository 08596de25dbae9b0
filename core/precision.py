"""Precision: Lightning's name for it and the dtypes that name means, in one table. Pre-flight resolves the config's
precision once (app/cli/preflight.py: the device may change it, 16-mixed runs as bf16-mixed on CPUs) into the run
plan, and every reader takes its dtypes from there: FSDP2's policy, the memory estimate, the peak FLOP/s for MFU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import UserError


@dataclass(frozen=True)
class Precision:
    name: str  # Lightning's, e.g. "bf16-mixed"
    parameter_dtype: torch.dtype  # of the parameters, their gradients and the optimizer state
    autocast_dtype: torch.dtype | None  # what autocast runs matrix products in under "*-mixed"; None: no autocast

    @property
    def compute_dtype(self) -> torch.dtype:
        """What matrix products run in."""
        return self.autocast_dtype or self.parameter_dtype


PRECISIONS = {precision.name: precision for precision in (
    Precision("32-true", torch.float32, None),
    Precision("bf16-mixed", torch.float32, torch.bfloat16),
    Precision("16-mixed", torch.float32, torch.float16),
    Precision("bf16-true", torch.bfloat16, None),
    Precision("16-true", torch.float16, None),
)}
SHORT_NAMES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}  # Lightning's aliases


def precision_named(name: str | int | None) -> Precision:
    """The precision a config names (Lightning's full name or its alias; None: 32-true); a UserError for one Cohort
    does not train with."""
    full_name = "32-true" if name is None else SHORT_NAMES.get(str(name), str(name))
    if full_name not in PRECISIONS:
        raise UserError(f"trainer.precision={name!r} is not supported: use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[full_name]
