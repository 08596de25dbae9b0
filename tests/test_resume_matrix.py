"""Resume onto any layout (#23): a checkpoint written by one process, DDP-2, FSDP2-2, tensor parallel (TP-2) or the
pipeline (PP-2) resumes under the others with its weights, Adam state, learning-rate schedule and sample stream, and
the run goes on as the uninterrupted one-process run does.

The matrix is one chain of runs along ROUTE, the layout of each optimizer step: the run of step s resumes the
checkpoint that the run of step s - 1 wrote, takes that one step in its own layout and writes the checkpoint the
next one resumes. Each run is a resume and a source, so 12 runs test 12 (source, target) pairs, where resuming
each of 5 sources into each of 5 targets would take 30 runs (on 2 CPU cores a run of 2 processes costs 7 s or
more, most of it the second process's start). The route is an Eulerian circuit over the four kinds of checkpoint,
each with its own readers: a file (written by one process or DDP; read whole by either, from rank 0 by FSDP2 and
TP, by every rank under the pipeline), FSDP2 shards, TP shards and pipeline stages (read whole by one process and
DDP, resharded by torch.distributed.checkpoint under the others). So each kind resumes into each other kind once,
and every layout both writes and resumes. A layout resuming its own kind is tested elsewhere, bitwise after SIGKILL
(test_training, test_sharding, test_pipeline), but for TP shards.

After the circuit, hybrid sharding (HSDP-2x2: 2 replicas x 2 shards on 4 processes) resumes the last file, one run
more: its checkpoint (shards written once, not once per replica) is read back whole for the weights' check.

Every layout runs COMPARABLE_RUN's global batch of 8 in micro-batches of 4 (two after each other on one
data-parallel rank: one process, TP-2, PP-2; one on each of two: DDP-2, FSDP2-2), HSDP-2x2 in micro-batches of 2
(one on each of its 4 data-parallel ranks), so the sample stream, a function of the global step
(datamodules/samplers.py), goes on from the checkpoint's step whatever the layout.

Each run of the chain is checked three ways:
- what it restored, written before its step (tests.helpers.SaveRestoredCheckpoint), is bitwise the checkpoint it
  resumed: weights, Adam's moments and step, the schedule (loading reshards, it does not compute);
- its step's gradient norm (the restored weights on that step's samples) and the validation loss after the step
  (the update: Adam's moments and step count, the learning rate) are the uninterrupted run's within 1e-4, as in
  assert_comparable_runs_agree (float32 rounding of sums taken in another order: under 1e-6 seen; zeroing Adam's
  first moments on resume moves the loss by 5e-3);
- the weights it wrote are the uninterrupted run's at that step within adam_weight_drift (tests/helpers.py: what
  Adam's arithmetic allows when only the order of sums differs; 0.007 at step 6, 0.016 at step 13).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest

from tests.helpers import (
    DDP_2,
    HYBRID_SHARDED,
    MODEL_PARALLEL,
    PIPELINE,
    TENSOR_PARALLEL,
    assert_checkpoint_weights_agree,
    assert_restored_exactly,
    batch_sizes,
    checkpoint_contents,
    fit,
    fit_in_process,
    last_checkpoint,
    last_checkpoint_contents,
    scalars,
)

pytestmark = pytest.mark.slow

# one process is comparable_run_args as they are (one CPU device)
LAYOUTS = {"1 process": [], "DDP-2": DDP_2, "FSDP2-2": MODEL_PARALLEL, "TP-2": TENSOR_PARALLEL, "PP-2": PIPELINE,
           "HSDP-2x2": [*HYBRID_SHARDED, *batch_sizes(8, 2)]}
CHECKPOINT_KIND = {"1 process": "file", "DDP-2": "file", "FSDP2-2": "FSDP2 shards", "TP-2": "TP shards",
                   "PP-2": "pipeline stages", "HSDP-2x2": "HSDP shards"}
# the layout of each optimizer step, from step 1 (the uninterrupted run's); each later one resumes the one before
CIRCUIT = ["1 process", "FSDP2-2", "TP-2", "PP-2", "DDP-2", "TP-2", "FSDP2-2", "PP-2", "TP-2", "1 process", "PP-2",
           "FSDP2-2", "1 process"]
ROUTE = [*CIRCUIT, "HSDP-2x2"]
STEPS = len(ROUTE)
RESUMED_STEPS = range(2, STEPS + 1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> Path:
    """The one-process run of all STEPS steps, with the checkpoint of every step kept."""
    return fit_in_process(tmp_path_factory.mktemp("uninterrupted"), comparable_run_args, *LAYOUTS["1 process"],
                          "--trainer.max_steps", str(STEPS), "--checkpoint.every_n_train_steps", "1",
                          "--checkpoint.save_top_k", "-1")


def checkpoint_of_step(run_dir: Path, step: int) -> Path:
    return last_checkpoint(run_dir).with_name(f"step={step:06d}.ckpt")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str],
            uninterrupted: Path) -> Callable[[int], tuple[Path, Path]]:
    """step -> (the checkpoint of the step before, the folder of the run in ROUTE's layout for ``step`` that resumed
    it, took that one step and wrote what it restored as restored.ckpt), the runs of the steps before first."""
    runs: dict[int, tuple[Path, Path]] = {}

    def resume(step: int) -> tuple[Path, Path]:
        if step not in runs:
            source = checkpoint_of_step(uninterrupted, 1) if step == 2 else last_checkpoint(resume(step - 1)[1])
            layout = ROUTE[step - 1]
            run_dir = tmp_path_factory.mktemp(f"step{step}")
            runner = fit_in_process if layout == "1 process" else fit
            runs[step] = source, runner(run_dir, comparable_run_args, *LAYOUTS[layout], "--trainer.max_steps",
                                        str(step), "--ckpt_path", str(source),
                                        "--trainer.callbacks+=tests.helpers.SaveRestoredCheckpoint",
                                        f"--trainer.callbacks.path={run_dir / 'restored.ckpt'}")
        return runs[step]

    return resume


def test_the_route_resumes_each_kind_of_checkpoint_into_each_other_kind() -> None:
    pairs = [(CHECKPOINT_KIND[source], CHECKPOINT_KIND[target]) for source, target in pairwise(CIRCUIT)]
    kinds = {CHECKPOINT_KIND[layout] for layout in CIRCUIT}
    assert len(set(pairs)) == len(pairs)  # each pair once
    assert set(pairs) == {(source, target) for source in kinds for target in kinds if source != target}
    assert set(CIRCUIT[:-1]) == set(CIRCUIT[1:]) == set(LAYOUTS) - {"HSDP-2x2"}  # each writes and resumes one
    assert ROUTE[-2:] == ["1 process", "HSDP-2x2"]  # then HSDP resumes a file


@pytest.mark.parametrize("step", RESUMED_STEPS, ids=[f"step{step}-{ROUTE[step - 2]}-to-{ROUTE[step - 1]}".replace(
    " ", "-") for step in RESUMED_STEPS])
def test_a_checkpoint_resumes_in_another_layout(step: int, resumed: Callable[[int], tuple[Path, Path]],
                                                uninterrupted: Path) -> None:
    source, run = resumed(step)
    assert_restored_exactly(checkpoint_contents(source), checkpoint_contents(run / "restored.ckpt"))
    one_process = {tag: scalars(uninterrupted, tag)[step - 1] for tag in ("train/grad_norm", "val/loss")}
    assert {tag: scalars(run, tag) for tag in one_process} == {
        tag: pytest.approx([value], rel=1e-4) for tag, value in one_process.items()}
    assert_checkpoint_weights_agree(checkpoint_contents(checkpoint_of_step(uninterrupted, step)),
                                    last_checkpoint_contents(run))
