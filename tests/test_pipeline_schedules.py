"""Fast checks of the pipeline schedules against torch's own: each schedule's theoretical bubble is what torch's
order of its actions leaves idle when every chunk takes its unit time, the run plan places the stages where torch's
schedule expects them (a loop, or a V), and a V's rank 0 holds the tied embedding and head as one parameter under
the unsplit network's names. torch builds every rank's order in one process, here over a fake process group."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _Action,
    _ComputationType,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from core.errors import UserError
from app.strategies.pipeline import PipelineParallelStrategy
from core.pipeline_schedules import PIPELINE_SCHEDULES
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from models.gpt.family import GPT_PIPELINE_SPLIT, build_gpt
from models.gpt.network import GPT_CONFIGS
from models.parallel.pipeline import (
    TORCH_SCHEDULE_CLASSES,
    merge_stages,
    share_tied_weights,
    split_layers,
    theoretical_bubble,
)
from tests.helpers import CONFIG_DIR, REPO_ROOT

# a backward is twice a forward, split evenly into the inputs' and the weights' gradients (a schedule's idle_units)
UNIT_COST = {_ComputationType.FORWARD: 1, _ComputationType.BACKWARD_INPUT: 1, _ComputationType.BACKWARD_WEIGHT: 1,
             _ComputationType.FULL_BACKWARD: 2}


def plan_of(schedule: str, ranks: int, microbatches: int) -> RunPlan:
    return RunPlan(devices_per_node=ranks, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1,
                   global_batch_size=8 * microbatches, micro_batch_size=8 * microbatches, sequence_length=16,
                   precision=PRECISIONS["32-true"], seed=1, pipeline_parallel_size=ranks, pipeline_schedule=schedule,
                   pipeline_microbatches=microbatches)


@pytest.fixture
def fake_group() -> Iterator[None]:
    yield
    dist.destroy_process_group()


def torch_schedule(plan: RunPlan) -> PipelineScheduleMulti:
    """The plan's torch schedule as pipeline rank 0 builds it, over a fake process group of the plan's ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.pipeline_parallel_size)
    stages = [PipelineStage(nn.Linear(2, 2), stage, len(plan.pipeline_stage_ranks), torch.device("cpu"))
              for stage, rank in enumerate(plan.pipeline_stage_ranks) if rank == 0]
    return TORCH_SCHEDULE_CLASSES[plan.pipeline_schedule](stages, plan.pipeline_microbatches, loss_fn=lambda out, target: out.sum(),
                                             scale_grads=False)


def idle_shares(order: dict[int, list[_Action | None]], num_stages: int) -> list[float]:
    """Each rank's share of the step in which it does not compute, when it runs its actions in ``order`` as soon as
    their inputs are there (a forward after the previous stage's, a backward after the next stage's, the last
    stage's after its own forward) and each takes its UNIT_COST."""
    def computations(actions: list[_Action | None]) -> list[_Action]:
        flat = [sub for action in actions if action is not None for sub in (action.sub_actions or (action,))]
        return [action for action in flat if action.computation_type in UNIT_COST]

    pending = {rank: computations(actions) for rank, actions in order.items()}
    clock, busy = dict.fromkeys(order, 0), dict.fromkeys(order, 0)
    finished: dict[tuple[str, int, int], int] = {}
    while any(pending.values()):
        progressed = False
        for rank, actions in pending.items():
            while actions:
                action = actions[0]
                stage, kind, microbatch = action.stage_index, action.computation_type, action.microbatch_index
                if kind == _ComputationType.FORWARD:
                    needs = ("forward", stage - 1, microbatch) if stage > 0 else None
                elif kind == _ComputationType.BACKWARD_WEIGHT:
                    needs = None  # after its own input gradient, which this rank ran before
                else:
                    needs = (("forward", stage, microbatch) if stage == num_stages - 1
                             else ("backward", stage + 1, microbatch))
                if needs is not None and needs not in finished:
                    break
                clock[rank] = max(clock[rank], finished.get(needs, 0)) + UNIT_COST[kind]
                busy[rank] += UNIT_COST[kind]
                done = "forward" if kind == _ComputationType.FORWARD else "backward"
                if kind != _ComputationType.BACKWARD_WEIGHT:
                    finished[done, stage, microbatch] = clock[rank]
                actions.pop(0)
                progressed = True
        assert progressed, f"the order deadlocks: {pending}"
    step = max(clock.values())
    return [1 - busy[rank] / step for rank in sorted(order)]


def accepted(schedule: str, ranks: int, microbatches: int) -> bool:
    try:
        plan_of(schedule, ranks, microbatches)
    except UserError:
        return False
    return True


# The schedules that torch runs by their pipeline_order (GPipe's and 1F1B's is a drawing only), at every number of
# micro-batches from the ranks to three times them that the plan accepts
MULTI_STAGE = [name for name in PIPELINE_SCHEDULES
               if issubclass(TORCH_SCHEDULE_CLASSES[name], PipelineScheduleMulti)]
CASES = [(schedule, ranks, microbatches) for schedule in MULTI_STAGE for ranks in (2, 3, 4)
         for microbatches in range(ranks, 3 * ranks + 1) if accepted(schedule, ranks, microbatches)]


@pytest.mark.parametrize(("schedule", "ranks", "microbatches"), CASES)
def test_the_theoretical_bubble_is_what_torchs_order_leaves_idle(fake_group: None, schedule: str, ranks: int,
                                                                 microbatches: int) -> None:
    """Every rank idles the theory's share (within 1e-12: sums of whole units, one division)."""
    plan = plan_of(schedule, ranks, microbatches)
    order = torch_schedule(plan).pipeline_order
    shares = idle_shares(order, len(plan.pipeline_stage_ranks))
    assert shares == pytest.approx([theoretical_bubble(plan)] * ranks, abs=1e-12)


@pytest.mark.parametrize("schedule", MULTI_STAGE)
def test_stages_sit_where_torchs_schedule_sends_to_them(fake_group: None, schedule: str) -> None:
    plan = plan_of(schedule, 4, 8)
    torch_placement = torch_schedule(plan).stage_index_to_group_rank
    assert torch_placement == dict(enumerate(plan.pipeline_stage_ranks))
    expected = [0, 1, 2, 3, 3, 2, 1, 0] if schedule in ("ZBVZeroBubble", "DualPipeV") else [0, 1, 2, 3, 0, 1, 2, 3]
    assert plan.pipeline_stage_ranks == expected


def test_zero_bubble_bubbles_are_below_1f1bs() -> None:
    """At p = 2 and m = 4 (the benchmark's middle row): 1F1B 1/5, Interleaved1F1B 1/9, the zero-bubble ones 1/25."""
    bubbles = {schedule: theoretical_bubble(plan_of(schedule, 2, 4)) for schedule in PIPELINE_SCHEDULES}
    assert bubbles == pytest.approx({"GPipe": 1 / 5, "1F1B": 1 / 5, "Interleaved1F1B": 1 / 9,
                                     "InterleavedZeroBubble": 1 / 25, "ZBVZeroBubble": 1 / 25, "DualPipeV": 1 / 25})


def test_the_plan_refuses_micro_batches_a_schedule_cannot_run() -> None:
    with pytest.raises(UserError, match="pipeline_microbatches=3: DualPipeV needs at least one per stage, 4"):
        plan_of("DualPipeV", 2, 3)
    with pytest.raises(UserError, match="pipeline_microbatches=5: InterleavedZeroBubble runs them in 2 rounds"):
        plan_of("InterleavedZeroBubble", 2, 5)


def test_a_v_holds_the_tied_weight_once_under_the_unsplit_names() -> None:
    """Rank 0 of a V over 2 ranks runs stages 0 and 3 of the small GPT: the embedding and the head tied to it are one
    parameter there, and the module that the checkpoint and the optimizer read holds the whole network's names and
    values for the parts it has, the tied weight under both of its names."""
    config = GPT_CONFIGS["small"]
    whole = build_gpt(config, torch.device("cpu"), seed=3)
    spans = [span for span, rank in zip(split_layers(config.n_layer, 4), [0, 1, 1, 0]) if rank == 0]
    stages = [build_gpt(config, torch.device("cpu"), seed=3, stage=span) for span in spans]
    share_tied_weights(stages, spans, ["wte.weight"])
    assert stages[1].lm_head.weight is stages[1].wte.weight is stages[0].wte.weight
    paths = [f"blocks.{index}" for index in range(config.n_layer)]
    merged = merge_stages(lambda: type(whole)(config), GPT_PIPELINE_SPLIT, paths, stages, spans)
    held = merged.state_dict()
    assert set(held) == {name for name in whole.state_dict() if not name.startswith(("blocks.1.", "blocks.2."))}
    for name, tensor in held.items():
        assert torch.equal(tensor, whole.state_dict()[name]), name
    assert sum(1 for _ in merged.parameters()) == len({id(param) for stage in stages for param in stage.parameters()})


def listed_after(text: str, start: str, end: str) -> set[str]:
    """The names a "str: A | B (why) | C" comment lists between ``start`` and ``end`` (a YAML field's comment lines)."""
    comment = re.sub(r"\s+", " ", text.split(start)[1].split(end)[0].replace("#", ""))
    return {name.strip() for name in re.sub(r"\([^)]*\)", "", comment.split("str:")[1]).split("|")}


def test_the_pipeline_and_the_docs_name_the_tables_schedules() -> None:
    """One table of schedules (core/pipeline_schedules.py): the pipeline has torch's class for each, and the README,
    the strategy's docstring (its --help) and the trainer presets name each of them and no other."""
    names = set(PIPELINE_SCHEDULES)
    assert set(TORCH_SCHEDULE_CLASSES) == names
    assert set(re.findall(r"`Schedule(\w+)`", (REPO_ROOT / "README.md").read_text())) == names
    docstring = inspect.getdoc(PipelineParallelStrategy.__init__)
    schedule_argument = docstring.split("pipeline_schedule:")[1].split("pipeline_microbatches:")[0]
    assert set(re.findall(r'"(\w+)"', schedule_argument)) == names
    for preset in ("pipeline_cpu.yaml", "pipeline_gpu_bf16.yaml"):
        text = (CONFIG_DIR / "trainer" / preset).read_text()
        assert listed_after(text, "pipeline_schedule:", "pipeline_microbatches:") == names, preset
