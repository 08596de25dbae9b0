"""The pipeline schedules a run may name, one record each: what the run plan checks and places stages by, what the
pipeline builds (models/parallel/pipeline.py maps each name to torch's schedule class) and what the theoretical
bubble is computed from. The README, the strategy's docstring and the trainer presets list these names; a test
holds them to this table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSchedule:
    """One schedule of ``torch.distributed.pipelining``, by the name a config gives it.

    ``idle_units(p, m)`` is a step's idle time on each rank, in units of one stage's forward of one pipeline
    micro-batch, when a backward takes two, one for the input's gradient and one for the weights' (the zero-bubble
    paper's T_F = T_B = T_W: Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241), for p ranks and
    m pipeline micro-batches. tests/test_pipeline_schedules.py checks it against torch's own order of the actions."""

    name: str
    stages_per_rank: int
    # rank r of p runs stages r and 2p - 1 - r (rank 0 the first and the last), not r, r + p, ... (a loop)
    v_shaped: bool
    # each backward split into the inputs' gradients and, later, the weights', run where the others idle
    zero_bubble: bool
    idle_units: Callable[[int, int], int]
    # at least one pipeline micro-batch per stage (not only per rank)
    needs_microbatch_per_stage: bool = False


def fill_and_drain(p: int, m: int) -> int:
    """p - 1 forwards and backwards, 3 units each, while the pipeline fills and drains (Narayanan et al. 2021)."""
    return 3 * (p - 1)


def weight_gradients_in_the_bubble(p: int, m: int) -> int:
    """The zero-bubble schedules run the weights' gradients in the fill and drain slots, leaving 1 unit of 3."""
    return p - 1


def zero_bubble_v(p: int, m: int) -> int:
    """ZB-V (the paper's section 6) fills the V only from m = 2p - 1 on: below, torch leaves each missing
    micro-batch's slots empty (2 units per micro-batch)."""
    return max(p - 1, 2 * (2 * p - 1 - m))


PIPELINE_SCHEDULES: dict[str, PipelineSchedule] = {schedule.name: schedule for schedule in (
    PipelineSchedule("GPipe", stages_per_rank=1, v_shaped=False, zero_bubble=False, idle_units=fill_and_drain),
    PipelineSchedule("1F1B", stages_per_rank=1, v_shaped=False, zero_bubble=False, idle_units=fill_and_drain),
    PipelineSchedule("Interleaved1F1B", stages_per_rank=2, v_shaped=False, zero_bubble=False,
                     idle_units=fill_and_drain),
    # the paper's ZB-H1, interleaved
    PipelineSchedule("InterleavedZeroBubble", stages_per_rank=2, v_shaped=False, zero_bubble=True,
                     idle_units=weight_gradients_in_the_bubble),
    PipelineSchedule("ZBVZeroBubble", stages_per_rank=2, v_shaped=True, zero_bubble=True, idle_units=zero_bubble_v),
    # DeepSeek-V3's DualPipe folded into a V (arXiv:2412.19437, github.com/deepseek-ai/DualPipe)
    PipelineSchedule("DualPipeV", stages_per_rank=2, v_shaped=True, zero_bubble=True,
                     idle_units=weight_gradients_in_the_bubble, needs_microbatch_per_stage=True),
)}


def pipeline_microbatches_or_default(microbatches: int | None, pipeline_parallel_size: int) -> int:
    """The pipeline micro-batches a config gives; null (None) means one per pipeline rank."""
    return pipeline_parallel_size if microbatches is None else int(microbatches)
