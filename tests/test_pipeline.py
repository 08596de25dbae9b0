"""``cohort fit`` with PipelineParallelStrategy on CPU processes (gloo): GPipe, 1F1B, interleaved 1F1B, the
zero-bubble schedules (InterleavedZeroBubble, and ZBVZeroBubble and DualPipeV on V-placed stages), 1F1B and
ZBVZeroBubble x FSDP2, and 1F1B x tensor parallel train as one process does on the same global batch, with clipping
that bites; a pipelined run resumes exactly after SIGKILL, also on a V; its checkpoint validates alike on one
process and resumes under FSDP2, a V's under 1F1B; the monitor measures the bubble beside each schedule's theory;
pipeline mistakes get one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from core.errors import UserError
from core.precision import PRECISIONS
from core.run_plan import RunPlan
from models.gpt.family import build_gpt
from models.gpt.network import GPT_CONFIGS
from models.parallel.pipeline import split_layers
from tests.helpers import (
    CLIP, MODEL_PARALLEL, PIPELINE, QUIET, SAME_VALIDATION_LOSS, assert_one_line_error,
    assert_sharded_resume_after_sigkill_is_bitwise_exact, assert_weights_agree, fit, fit_in_process, last_checkpoint,
    one_line_error, run_cohort, scalars, validate,
)

pytestmark = pytest.mark.slow


def microbatches(count: int) -> list[str]:
    return ["--trainer.strategy.init_args.pipeline_microbatches", str(count)]


def schedule(name: str, count: int) -> list[str]:
    return [*PIPELINE, "--trainer.strategy.init_args.pipeline_schedule", name, *microbatches(count)]


PIPELINE_X_FSDP2 = ["--trainer.devices", "4", "--trainer.strategy.init_args.data_parallel_size", "2"]
PIPELINE_X_TENSOR_PARALLEL = ["--trainer.devices", "4", "--trainer.strategy.init_args.tensor_parallel_size", "2"]
SMALL = ["--model.model_name", "small"]  # 4 blocks (4 heads): enough for 2 stages on each of 2 ranks


@pytest.fixture(scope="module")
def pipelined_runs(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> dict[str, Path]:
    """The debug model's 2 blocks as 2 stages, its micro batch of 4 cut into 2 (GPipe) or 4 (1F1B) pieces; and
    1F1B on 4 processes: 2 stages x FSDP2 over 2 data-parallel ranks, and 2 stages x tensor parallel over 2."""
    return {"GPipe": fit(tmp_path_factory.mktemp("GPipe"), comparable_run_args, *schedule("GPipe", 2)),
            "1F1B": fit(tmp_path_factory.mktemp("1F1B"), comparable_run_args, *schedule("1F1B", 4)),
            "1F1B x FSDP2": fit(tmp_path_factory.mktemp("pp_dp"), comparable_run_args, *schedule("1F1B", 2),
                                *PIPELINE_X_FSDP2),
            "1F1B x TP": fit(tmp_path_factory.mktemp("pp_tp"), comparable_run_args, *schedule("1F1B", 2),
                             *PIPELINE_X_TENSOR_PARALLEL)}


def assert_trains_as_one_process_does(one_process: Path, run: Path, data_parallel: bool = False) -> None:
    """Every step's validation loss and gradient norm, the training loss where rank 0 reads the micro-batch one
    process logs (``data_parallel`` false), within 1e-5 (the same sums taken in another order: float32 rounding
    only), and the final weights within what AdamW allows for that (tests/helpers.py assert_weights_agree)."""
    assert last_checkpoint(run).is_dir()  # sharded: each stage writes its own weights
    for tag in ("val/loss", "train/grad_norm", *([] if data_parallel else ["train/loss"])):
        assert scalars(run, tag) == pytest.approx(scalars(one_process, tag), rel=1e-5), tag
    assert scalars(one_process, "train/grad_norm")[0] > 2 * CLIP  # clipping bit
    assert_weights_agree(one_process, run)


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "1F1B x FSDP2", "1F1B x TP"])
def test_pipeline_trains_as_one_process_does(one_process_comparable_run: Path, pipelined_runs: dict[str, Path],
                                             name: str) -> None:
    assert_trains_as_one_process_does(one_process_comparable_run, pipelined_runs[name],
                                      data_parallel=name == "1F1B x FSDP2")


def test_the_monitor_measures_each_ranks_bubble_beside_the_theory(pipelined_runs: dict[str, Path]) -> None:
    """1F1B with 4 pipeline micro-batches on 2 stages: theory (p - 1) / (m + p - 1) = 1 / 5. Each rank's measured
    bubble is the share of the pipeline's time (the longest any rank spent in the schedule, its compute plus its
    wait) in which it did not compute, from the compute and wait it logged for the same window. The last stage
    cannot start before the first stage's first forward, and the first cannot end before its own last backward,
    which follows the last stage's: the pipeline's time is at least the last stage's compute plus one micro-batch
    of the first's (1 / m of its compute). So with c the smaller compute it is at least c (m + p - 1) / m, and the
    most idle rank's bubble at least the theory, however uneven the stages. The custom-scalars layout draws both
    ranks with the theory."""
    run = pipelined_runs["1F1B"]
    assert scalars(run, "monitor/pipeline_bubble_theory") == pytest.approx([1 / 5] * 4)
    compute, wait, bubble = ([scalars(run, f"monitor/pipeline_{series}/rank{rank}") for rank in (0, 1)]
                             for series in ("compute_s", "wait_s", "bubble"))
    for window in range(4):
        span = max(compute[rank][window] + wait[rank][window] for rank in (0, 1))
        assert all(compute[rank][window] > 0 and wait[rank][window] > 0 for rank in (0, 1))  # each waits on the other
        measured = [bubble[rank][window] for rank in (0, 1)]
        assert measured == pytest.approx([1 - compute[rank][window] / span for rank in (0, 1)], abs=1e-6)
        assert max(measured) >= 1 / 5, measured
    events = EventAccumulator(str(run / "lightning_logs" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    assert charts["pipeline bubble — every rank and theory"] == [r"monitor/pipeline_bubble/rank\d+$",
                                                                r"monitor/pipeline_bubble_theory$"]


@pytest.fixture(scope="module")
def one_process_small_run(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> Path:
    return fit_in_process(tmp_path_factory.mktemp("one_process_small"), comparable_run_args, *SMALL)


def test_interleaved_pipeline_trains_as_one_process_does(tmp_path: Path, comparable_run_args: list[str],
                                                         one_process_small_run: Path) -> None:
    """Interleaved 1F1B: the small model's 4 blocks as 4 stages, 2 on each rank (0 and 2, 1 and 3)."""
    interleaved = fit(tmp_path / "interleaved", comparable_run_args, *SMALL, *schedule("Interleaved1F1B", 2))
    assert_trains_as_one_process_does(one_process_small_run, interleaved)


@dataclass(frozen=True)
class ZeroBubbleRun:
    """The small model's 4 blocks as 4 stages on 2 pipeline ranks, its micro batch of 4 cut into ``microbatches``;
    ``theory`` is the schedule's bubble there (its idle_units, core/pipeline_schedules.py: idle / (3 units x 2 stages
    x m + idle))."""

    schedule: str
    microbatches: int
    theory: float
    layout: tuple[str, ...] = ()


# InterleavedZeroBubble places the stages in a loop (0 and 2, 1 and 3), the others in a V (0 and 3, 1 and 2);
# ZBVZeroBubble at m = 2 < 2p - 1 runs torch's V with a micro-batch left out; under FSDP2 each stage is sharded
# over 2 data-parallel ranks, the V's rank 0 holding the tied embedding and head as one sharded parameter
ZERO_BUBBLE = {
    "InterleavedZeroBubble": ZeroBubbleRun("InterleavedZeroBubble", 2, theory=1 / 13),
    "ZBVZeroBubble": ZeroBubbleRun("ZBVZeroBubble", 2, theory=2 / 14),
    "DualPipeV": ZeroBubbleRun("DualPipeV", 4, theory=1 / 25),
    "ZBVZeroBubble x FSDP2": ZeroBubbleRun("ZBVZeroBubble", 2, theory=2 / 14, layout=tuple(PIPELINE_X_FSDP2)),
}


@pytest.fixture(scope="module")
def zero_bubble_runs(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> dict[str, Path]:
    return {name: fit(tmp_path_factory.mktemp(name.replace(" ", "_")), comparable_run_args, *SMALL,
                      *schedule(run.schedule, run.microbatches), *run.layout)
            for name, run in ZERO_BUBBLE.items()}


@pytest.mark.parametrize("name", list(ZERO_BUBBLE))
def test_zero_bubble_pipeline_trains_as_one_process_does(one_process_small_run: Path,
                                                         zero_bubble_runs: dict[str, Path], name: str) -> None:
    """Every step's losses and gradient norm, and the final weights (consolidated from the stages' shards under the
    unsplit network's names, so a V's checkpoint is laid out as any other's), as one process's. Each rank's bubble
    is measured, its compute counting the weight-gradient halves, and logged beside the schedule's theory."""
    run = zero_bubble_runs[name]
    assert_trains_as_one_process_does(one_process_small_run, run, data_parallel=bool(ZERO_BUBBLE[name].layout))
    assert scalars(run, "monitor/pipeline_bubble_theory") == pytest.approx([ZERO_BUBBLE[name].theory] * 4)
    for rank in (0, 1):
        assert all(compute > 0 for compute in scalars(run, f"monitor/pipeline_compute_s/rank{rank}"))
        assert all(0 <= bubble < 1 for bubble in scalars(run, f"monitor/pipeline_bubble/rank{rank}"))


def test_a_v_shaped_checkpoint_resumes_under_1f1b(tmp_path: Path, comparable_run_args: list[str],
                                                  one_process_small_run: Path,
                                                  zero_bubble_runs: dict[str, Path]) -> None:
    """ZBVZeroBubble's checkpoint of step 4 (rank 0 wrote stages 0 and 3, rank 1 stages 1 and 2) read by 1F1B's
    stages (blocks 0-1 and 2-3): the next two steps match one process resumed from its own checkpoint of step 4."""
    six_steps = [*comparable_run_args, *SMALL, "--trainer.max_steps", "6"]
    one_process = fit_in_process(tmp_path / "one_process", six_steps, "--ckpt_path",
                                 str(last_checkpoint(one_process_small_run)))
    loop = fit(tmp_path / "1F1B", six_steps, *schedule("1F1B", 2), "--ckpt_path",
               str(last_checkpoint(zero_bubble_runs["ZBVZeroBubble"])))
    assert_weights_agree(one_process, loop)


def test_pipelined_checkpoint_resumes_under_fsdp2(tmp_path: Path, comparable_run_args: list[str],
                                                  one_process_comparable_run_resumed: Path,
                                                  pipelined_runs: dict[str, Path]) -> None:
    """Weights and Adam's moments go from the pipeline's stages into FSDP2 shards: the next two steps match the
    one-process run resumed from its own checkpoint of the same step."""
    fsdp2 = fit(tmp_path / "fsdp2", comparable_run_args, *MODEL_PARALLEL, "--trainer.max_steps", "6",
                "--ckpt_path", str(last_checkpoint(pipelined_runs["1F1B"])))
    assert_weights_agree(one_process_comparable_run_resumed, fsdp2)


@pytest.mark.parametrize("layout", ["1F1B", "1F1B x FSDP2"])
def test_pipelined_checkpoint_validates_alike_in_one_process(pipelined_runs: dict[str, Path],
                                                             comparable_run_args: list[str], layout: str) -> None:
    """On 9 validation samples: each data-parallel rank's share is padded to whole micro-batches of 4 (to 12 samples
    on one data-parallel rank; to 8 on each of 2, rank 1's second micro-batch then padding alone), which run through
    the stages and count for nothing."""
    run = pipelined_runs[layout]
    consolidated = run / "consolidated.ckpt"
    result = run_cohort(["consolidate", str(last_checkpoint(run)), str(consolidated)], cwd=run)
    assert result.returncode == 0, result.stderr[-3000:]
    nine_samples = [*comparable_run_args, "--data.val_samples", "9"]
    pipelined_loss = validate(run, nine_samples, *PIPELINE, *(PIPELINE_X_FSDP2 if "FSDP2" in layout else []),
                              "--ckpt_path", str(last_checkpoint(run)))
    assert validate(run, nine_samples, "--ckpt_path", str(consolidated)) == pytest.approx(pipelined_loss,
                                                                                         rel=SAME_VALIDATION_LOSS)


@pytest.mark.parametrize("layout", ["1F1B", "ZBVZeroBubble"])
def test_pipelined_resume_after_sigkill_is_bitwise_exact(tmp_path: Path, comparable_run_args: list[str],
                                                         layout: str) -> None:
    """1F1B on the debug model's 2 blocks, and a V on the small model's 4."""
    run = [*comparable_run_args, *PIPELINE, "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "3",
           "--model.dropout", "0.1", "--data.micro_batch_size", "2",  # 2 micro-batches per step
           *schedule(layout, 2), *(SMALL if layout == "ZBVZeroBubble" else [])]
    assert_sharded_resume_after_sigkill_is_bitwise_exact(tmp_path, run)


def test_pipeline_mistakes_get_one_line(tmp_path: Path, comparable_run_args: list[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each before any process starts: in this process (fast), and one as a user runs it, end to end."""
    monkeypatch.chdir(tmp_path)
    cases = [
        (["--trainer.strategy.init_args.data_parallel_size", "2"],
         "pipeline_parallel_size=2 x data_parallel_size=2 x tensor_parallel_size=1 must equal the world size 2"),
        (["--trainer.strategy.init_args.pipeline_parallel_size", "3", "--trainer.devices", "3"],
         "pipeline_parallel_size=3 (1F1B) makes 3 stages, more than model 'debug' has blocks (2)"),
        (["--trainer.strategy.init_args.pipeline_schedule", "Interleaved1F1B"],
         "pipeline_parallel_size=2 (Interleaved1F1B) makes 4 stages, more than model 'debug' has blocks (2)"),
        (["--trainer.strategy.init_args.pipeline_microbatches", "1"],
         "pipeline_microbatches=1 is fewer than the 2 pipeline stages"),
        (["--trainer.strategy.init_args.pipeline_microbatches", "3"],
         "pipeline_microbatches=3 does not divide data.micro_batch_size=4"),
        (["--trainer.strategy.init_args.pipeline_schedule", "ZeroBubble"],
         ("pipeline_schedule='ZeroBubble' is not a schedule: use one of GPipe, 1F1B, Interleaved1F1B, "
          "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV")),
        (["--trainer.strategy.init_args.pipeline_schedule", "DualPipeV", *microbatches(2)],
         "pipeline_microbatches=2: DualPipeV needs at least one per stage, 4"),
        (["--trainer.strategy.init_args.pipeline_schedule", "InterleavedZeroBubble", *SMALL, "--model.compile", "true"],
         ("model.compile=true with pipeline_schedule=InterleavedZeroBubble: a zero-bubble schedule runs each backward "
          "in two halves")),
        (["--trainer.strategy.init_args.save_distributed_checkpoint", "false"],
         "save_distributed_checkpoint=false would gather one stage's weights only"),
        (["--trainer.strategy.init_args.pipeline_layers", "[2]"],
         "pipeline_layers=[2] must give each of the 2 stages at least one block"),
        (["--trainer.strategy.init_args.pipeline_layers", "[1, 2]"],
         "pipeline_layers=[1, 2] adds up to 3 blocks, but model 'debug' has 2"),
    ]
    for extra, expected in cases:
        assert expected in one_line_error(["fit", *comparable_run_args, *QUIET, *PIPELINE, *extra], monkeypatch)
    assert_one_line_error(["predict", *comparable_run_args, *QUIET, *PIPELINE], tmp_path,
                          "predict on one process (configs/trainer/cpu.yaml) with the same --ckpt_path")


def test_16_mixed_is_refused_with_pipeline_stages() -> None:
    """On GPUs (on CPUs 16-mixed already runs as bf16-mixed, so the plan never sees it)."""
    with pytest.raises(UserError, match="16-mixed: the pipeline runs its own backward"):
        RunPlan(devices_per_node=2, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1, global_batch_size=8,
                micro_batch_size=4, sequence_length=64,
                precision=PRECISIONS["16-mixed"], seed=1, pipeline_parallel_size=2,
                pipeline_microbatches=2)


def test_stages_split_the_blocks_by_count_or_as_given() -> None:
    """The embeddings and the head count as one block each; an explicit split is taken as it is."""
    def blocks(*args: object) -> list[list[int]]:
        return [list(stage.layers) for stage in split_layers(*args)]
    assert blocks(4, 2) == [[0, 1], [2, 3]]
    assert blocks(4, 3) == [[0], [1, 2], [3]]  # the end stages carry the embeddings and the head
    assert blocks(12, 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert blocks(4, 2, (1, 3)) == [[0], [1, 2, 3]]
    with pytest.raises(ValueError, match="every stage needs at least one block"):
        split_layers(2, 3)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_stages_hold_the_whole_models_weights_under_its_names(num_stages: int) -> None:
    """Built on the meta device and initialised stage by stage: each weight bitwise the one-process model's, every
    name once across the stages but the tied embedding, which the last stage holds too."""
    config = GPT_CONFIGS["small"]
    whole = dict(build_gpt(config, torch.device("cpu"), seed=3).state_dict())
    seen: dict[str, int] = {}
    for span in split_layers(config.n_layer, num_stages):
        for name, tensor in build_gpt(config, torch.device("cpu"), seed=3, stage=span).state_dict().items():
            assert torch.equal(tensor, whole[name]), name
            seen[name] = seen.get(name, 0) + 1
    assert seen.keys() == whole.keys()
    assert {name for name, count in seen.items() if count > 1} == {"wte.weight"}
