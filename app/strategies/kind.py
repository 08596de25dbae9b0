"""What kind of strategy a run trains with, as the pre-flight checks and the features' own checks tell strategies
apart: resolved once from the class the config names (app/cli/configured_strategy.py), read by every check."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class StrategyKind(Enum):
    DDP = "ddp"  # Lightning's DDPStrategy, by name or class; "auto" too, which is DDP on more than one device
    FSDP = "fsdp"  # FSDP version 1: Lightning's FSDPStrategy (FSDP2 runs under ModelParallelStrategy)
    MODEL_PARALLEL = "model_parallel"  # FSDP2 and tensor parallelism: Lightning's ModelParallelStrategy
    PIPELINE = "pipeline"  # app/strategies/pipeline.py
    PARAMETER_SERVER = "parameter_server"  # app/strategies/parameter_server/
    FAULT_TOLERANT = "fault_tolerant"  # app/strategies/fault_tolerance/
    OTHER = "other"  # single device, DeepSpeed, a strategy of one's own

    @property
    def shards_layers(self) -> bool:
        """Whether Cohort builds and shards the network itself (models/parallel/), as the family's plan says: FSDP2
        and tensor parallelism, pipeline stages, and fault-tolerant groups (FSDP2 over each group's processes)."""
        return self in (StrategyKind.MODEL_PARALLEL, StrategyKind.PIPELINE, StrategyKind.FAULT_TOLERANT)


@dataclass(frozen=True)
class ConfiguredStrategy:
    kind: StrategyKind
    name: str  # as the config gives it, for messages: a registry name ("ddp", "fsdp") or a class path
