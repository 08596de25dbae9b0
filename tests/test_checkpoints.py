"""Checkpoints are data: a pickle that asks for code is refused by fit, validate, predict, consolidate and
``GPTLanguageModel.load_from_checkpoint`` before any of it runs, and a torch file that is not a Lightning checkpoint
is named for what it is (in-process: the one-line plumbing itself is proven by tests/test_cli_errors.py). And no
checkpoint is written with NaN in it, and a plain optimizer's state is stored by parameter name.

Checkpoints written in the background (checkpoint.async_save) hold the state of the step they save, although
tests.helpers.HoldCheckpointWrites keeps each write waiting until training has moved past that step; a failed one
stops the run with the line a failed synchronous write gives, and a SIGTERM while one is pending still ends with
both it and the stop's checkpoint in place."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.safety.checkpoint_reading import load_checkpoint
from app.safety.checkpoint_writing import check_writes_in_background, non_finite_tensors
from app.safety.optimizer_state_keys import (
    name_optimizer_states, optimizer_state_by_name, optimizer_state_by_position, parameter_names,
)
from core.errors import UserError
from models.gpt.family import GPTLanguageModel, build_gpt
from models.gpt.network import gpt_config
from models.optimizer import weight_decay_groups
from tests.helpers import (
    DDP_2,
    MODEL_PARALLEL,
    QUIET,
    assert_weights_equal,
    batch_sizes,
    fit,
    fit_in_process,
    last_checkpoint,
    one_line_error,
    run_cohort,
)

ASYNC = ["--checkpoint.async_save", "true"]
CHECKPOINTS = Path("lightning_logs/version_0/checkpoints")  # a new run's checkpoint.dirpath, from its folder


class CreatesAFile:
    """What a hostile checkpoint holds: an object whose unpickling calls something, here ``open(path, "w")``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return open, (str(self.path), "w")


@pytest.fixture
def hostile_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A Lightning-looking checkpoint file whose loading would create ``marker``."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "hostile.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.0", "state_dict": {}, "payload": CreatesAFile(marker)}, path)
    return path, marker


@pytest.mark.parametrize("command", ["fit", "validate", "predict"])
def test_a_checkpoint_whose_pickle_runs_code_is_refused(command: str, hostile_checkpoint: tuple[Path, Path],
                                                        debug_run_args: list[str], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path, marker = hostile_checkpoint
    monkeypatch.chdir(tmp_path)
    message = one_line_error([command, *debug_run_args, "--trainer.max_steps", "1", "--ckpt_path", str(path)], monkeypatch)
    assert f"checkpoint {path} asks to run code (" in message and ".open')" in message  # io.open or builtins.open
    assert not marker.exists() and not (tmp_path / "lightning_logs").exists()


def test_consolidate_refuses_a_sharded_folder_whose_meta_runs_code(hostile_checkpoint: tuple[Path, Path],
                                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, marker = hostile_checkpoint
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    path.rename(folder / "meta.pt")
    message = one_line_error(["consolidate", str(folder)], monkeypatch)
    assert "meta.pt asks to run code (" in message and ".open')" in message
    assert not marker.exists() and not (tmp_path / "last.consolidated.ckpt").exists()


def test_load_from_checkpoint_refuses_a_checkpoint_whose_pickle_runs_code(hostile_checkpoint: tuple[Path, Path],
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning passes weights_only=None, so torch's default (weights_only since torch 2.6) decides."""
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    path, marker = hostile_checkpoint
    with pytest.raises(pickle.UnpicklingError, match=r"GLOBAL \w+\.open"):
        GPTLanguageModel.load_from_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("content, described", [
    ({"wte.weight": torch.zeros(2, 2), "ln.bias": torch.zeros(2)}, "is a bare state dict of 2 tensors (weights only, no training state)"),
    ({"epoch": 3, "model": [1, 2]}, "is a dict with keys ['epoch', 'model']"),
    ([torch.zeros(1)], "is a list"),
], ids=["state-dict", "dict", "list"])
def test_a_torch_file_that_is_not_a_lightning_checkpoint_is_named(content: object, described: str, tmp_path: Path,
                                                                  debug_run_args: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "weights.pt"
    torch.save(content, path)
    monkeypatch.chdir(tmp_path)
    message = one_line_error(["validate", *debug_run_args, "--ckpt_path", str(path)], monkeypatch)
    assert f"{path} {described}, not a Lightning checkpoint" in message


def test_a_zip_archive_that_is_not_a_torch_checkpoint_is_named(tmp_path: Path, debug_run_args: list[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "archive.ckpt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "not weights")
    monkeypatch.chdir(tmp_path)
    message = one_line_error(["validate", *debug_run_args, "--ckpt_path", str(path)], monkeypatch)
    assert f"checkpoint {path} is a zip archive but not a torch checkpoint" in message


@pytest.mark.slow
def test_no_checkpoint_is_written_with_nan_on_any_rank(tmp_path: Path, debug_run_args: list[str]) -> None:
    """DDP-2: rank 1's weights turn NaN just before the step-4 checkpoint, which rank 0 (clean) would write. Both
    ranks refuse; the step-2 checkpoint stays the newest, whole and finite."""
    result = run_cohort(["fit", *debug_run_args, *QUIET, *DDP_2, "--trainer.max_steps", "6",
                         "--checkpoint.every_n_train_steps", "2", "--data.global_batch_size", "4",
                         "--data.micro_batch_size", "2", "--trainer.callbacks+=tests.helpers.PoisonWeightsBeforeCheckpoint",
                         "--trainer.callbacks.rank=1", "--trainer.callbacks.step=4"], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("cohort: error: ")]
    assert {line.split(" (", 1)[0] for line in errors} == {
        "cohort: error: step 4: the weights or optimizer state hold NaN or inf"}, result.stderr[-3000:]
    assert "(rank 1: model.wte.weight)" in result.stderr  # each rank says what it found
    assert "(on another rank), so no checkpoint was written and lightning_logs/version_0/checkpoints/last.ckpt is " \
           "kept" in result.stderr
    checkpoint = torch.load(tmp_path / "lightning_logs/version_0/checkpoints/last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2
    assert all(torch.isfinite(tensor).all() for tensor in checkpoint["state_dict"].values())
    assert not list((tmp_path / "lightning_logs/version_0/checkpoints").glob("*.partial"))


@pytest.mark.slow
def test_the_newest_step_checkpoints_are_kept_and_last_links_to_the_newest(tmp_path: Path,
                                                                            debug_run_args: list[str]) -> None:
    """Every 2 steps, keep 2 (the default), and the final step 7 saved too; the oldest go only after a new one. Each
    save logs how long it held the loop."""
    fit_in_process(tmp_path, debug_run_args, "--trainer.max_steps", "7", "--checkpoint.every_n_train_steps", "2",
                   "--data.global_batch_size", "4", "--data.micro_batch_size", "4")
    folder = tmp_path / "lightning_logs/version_0/checkpoints"
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt", "step=000006.ckpt", "step=000007.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step=000007.ckpt"
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 7
    assert logged_steps(tmp_path, "checkpoint/blocking_seconds") == [2, 4, 6, 7]


def test_non_finite_weights_and_moments_are_named_and_an_overflowing_sum_is_not() -> None:
    """The check sums each tensor: a NaN or inf shows in the sum, and a finite tensor whose float32 sum overflows
    (two values of 3e38) is cleared by the exact check."""
    module = torch.nn.Module()
    module.big = torch.nn.Parameter(torch.full((2,), 3e38))
    module.poisoned = torch.nn.Parameter(torch.tensor([1.0, float("nan")]))
    optimizer = torch.optim.SGD(module.parameters(), momentum=0.9)
    optimizer.state[module.big]["momentum_buffer"] = torch.tensor([float("-inf")])
    trainer = SimpleNamespace(lightning_module=module, optimizers=[optimizer])
    assert non_finite_tensors(trainer) == ["poisoned", "optimizer 0 momentum_buffer of big"]


def test_optimizer_state_goes_by_parameter_name_into_another_parameter_order() -> None:
    """Stored by name, without activation checkpointing's wrapper; loaded into an optimizer that lists each
    group's parameters the other way round, every parameter gets its own moments back."""
    wrapped = build_gpt(gpt_config("debug"), torch.device("cpu"), seed=0, activation_checkpointing=True)
    optimizer = torch.optim.AdamW(weight_decay_groups(wrapped, 0.1))
    wrapped(torch.randint(0, 256, (2, 8))).sum().backward()
    optimizer.step()
    names = parameter_names(wrapped)
    by_name = optimizer_state_by_name(optimizer.state_dict(), [names[id(param)] for group in optimizer.param_groups
                                                                for param in group["params"]])
    plain = build_gpt(gpt_config("debug"), torch.device("cpu"), seed=0)
    assert set(by_name["state"]) == {name for name, _ in plain.named_parameters()}
    reversed_groups = [{**group, "params": group["params"][::-1]} for group in weight_decay_groups(plain, 0.1)]
    other = torch.optim.AdamW(reversed_groups)
    other.load_state_dict(optimizer_state_by_position(by_name, other, parameter_names(plain)))
    moments = {names[id(param)]: state["exp_avg"] for param, state in optimizer.state.items()}
    for name, param in plain.named_parameters():
        assert torch.equal(other.state[param]["exp_avg"], moments[name]), name


def test_model_parallel_one_file_optimizer_state_is_named_in_the_networks_order() -> None:
    """ModelParallelStrategy's one file (save_distributed_checkpoint false) numbers the parameters in the network's
    order (FSDP.rekey_optim_state_dict), not the optimizer's, whose weight-decay groups put them in another: each
    name gets its own parameter's moments."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    network = build_gpt(gpt_config("debug"), torch.device("cpu"), seed=0)
    optimizer = torch.optim.AdamW(weight_decay_groups(network, 0.1))
    network(torch.randint(0, 256, (2, 8))).sum().backward()
    optimizer.step()
    grouped = [id(param) for group in optimizer.param_groups for param in group["params"]]
    assert grouped != [id(param) for param in network.parameters()]  # else the test could not tell them apart
    numbered = FullyShardedDataParallel.rekey_optim_state_dict(get_optimizer_state_dict(network, optimizer),
                                                               OptimStateKeyType.PARAM_ID, network)
    trainer = SimpleNamespace(strategy=ModelParallelStrategy(), lightning_module=network, optimizers=[optimizer])
    checkpoint = {"optimizer_states": [numbered]}
    name_optimizer_states(trainer, checkpoint)
    named = checkpoint["optimizer_states"][0]["state"]
    for name, param in network.named_parameters():
        assert torch.equal(named[name]["exp_avg"], optimizer.state[param]["exp_avg"]), name


def hold_writes(steps: int) -> list[str]:
    """The flags that add HoldCheckpointWrites: each background write waits until training is ``steps`` further."""
    return ["--trainer.callbacks+=tests.helpers.HoldCheckpointWrites", f"--trainer.callbacks.steps={steps}"]


def assert_same_training_state(one: dict[str, Any], other: dict[str, Any]) -> None:
    """Two checkpoints hold the same step, and bitwise the same weights and optimizer state."""
    assert one["global_step"] == other["global_step"]
    assert_weights_equal(one["state_dict"], other["state_dict"])
    for mine, theirs in zip(one["optimizer_states"], other["optimizer_states"], strict=True):
        assert mine["state"].keys() == theirs["state"].keys()
        for name, state in mine["state"].items():
            assert all(torch.equal(torch.as_tensor(value), torch.as_tensor(theirs["state"][name][key]))
                       for key, value in state.items()), name


def logged_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps at which a run logged ``tag`` to TensorBoard."""
    events = EventAccumulator(str(run_dir / "lightning_logs/version_0"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


@pytest.mark.slow
def test_an_async_checkpoint_holds_its_step_and_resumes_exactly(tmp_path: Path, comparable_run_args: list[str],
                                                                 one_process_comparable_run: Path,
                                                                 one_process_comparable_run_resumed: Path) -> None:
    """1 process, a checkpoint every 2 steps written in the background, each write held until the next step has
    changed the weights: the step-4 checkpoint is bitwise the synchronous run's of step 4, and a run resumed from
    it to step 6 ends bitwise where the synchronous resume from step 4 ends."""
    written = fit_in_process(tmp_path / "async", comparable_run_args, *ASYNC, *hold_writes(1), "--trainer.max_steps",
                             "6", "--checkpoint.every_n_train_steps", "2")
    step_4 = written / CHECKPOINTS / "step=000004.ckpt"
    assert_same_training_state(load_checkpoint(step_4), load_checkpoint(last_checkpoint(one_process_comparable_run)))
    assert logged_steps(written, "checkpoint/blocking_seconds") == [2, 4, 6]
    assert logged_steps(written, "checkpoint/write_seconds") == [2, 4, 6]

    resumed = fit_in_process(tmp_path / "resumed", comparable_run_args, *ASYNC, "--trainer.max_steps", "6",
                             "--ckpt_path", str(step_4))
    assert_same_training_state(load_checkpoint(last_checkpoint(resumed)),
                               load_checkpoint(last_checkpoint(one_process_comparable_run_resumed)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [DDP_2, MODEL_PARALLEL], ids=["ddp", "fsdp2-sharded"])
def test_async_checkpoints_on_two_processes_hold_their_steps(layout: list[str], tmp_path: Path,
                                                            debug_run_args: list[str]) -> None:
    """DDP (rank 0 writes one file) and FSDP2 (both ranks write shards, their collectives in the writing threads):
    checkpoints of steps 2 and 4 written while training went on, and the final one of step 5, hold bitwise what a
    synchronous run writes; the oldest went, and last.ckpt links to the newest."""
    run = [*debug_run_args, *layout, "--trainer.max_steps", "5", "--checkpoint.every_n_train_steps", "2",
           *batch_sizes(4, 2)]
    synchronous = fit(tmp_path / "sync", run)
    written = fit(tmp_path / "async", run, *ASYNC, *hold_writes(1))
    folder = written / CHECKPOINTS
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt", "step=000004.ckpt", "step=000005.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step=000005.ckpt"
    for name in ("step=000004.ckpt", "step=000005.ckpt"):
        assert_same_training_state(load_checkpoint(folder / name), load_checkpoint(synchronous / CHECKPOINTS / name))
    assert logged_steps(written, "checkpoint/blocking_seconds") == [2, 4, 5]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ASYNC + hold_writes(1)], ids=["sync", "async"])
def test_a_failed_write_stops_the_run_in_one_line_and_keeps_the_previous_checkpoint(
        mode: list[str], tmp_path: Path, debug_run_args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 4's checkpoint fails to write (its writer raises EROFS); in the background that is found a step or
    more later, and said the same way: the step it saved, and step 2's checkpoint kept as the newest."""
    monkeypatch.chdir(tmp_path)
    message = one_line_error(["fit", *debug_run_args, *QUIET, "--trainer.max_steps", "8",
                              "--checkpoint.every_n_train_steps", "2", *batch_sizes(4, 4), *mode,
                              "--trainer.callbacks+=tests.helpers.FailCheckpointWrite", "--trainer.callbacks.step=4"],
                             monkeypatch)
    assert message == (
        f"cohort: error: step 4: writing a checkpoint in {CHECKPOINTS} failed (Read-only file system), so no "
        f"checkpoint was written and {CHECKPOINTS}/last.ckpt is kept: fix the folder or point checkpoint.dirpath "
        "elsewhere, then resume with --ckpt_path last (COHORT_TRACEBACK=1 shows where)")
    assert sorted(path.name for path in (tmp_path / CHECKPOINTS).iterdir()) == ["last.ckpt", "step=000002.ckpt"]
    assert os.readlink(tmp_path / CHECKPOINTS / "last.ckpt") == "step=000002.ckpt"


@pytest.mark.slow
def test_sigterm_while_a_write_is_pending_leaves_it_and_the_stop_checkpoint_in_place(
        tmp_path: Path, debug_run_args: list[str]) -> None:
    """Step 3's checkpoint is still being written (held until training ends) when SIGTERM arrives in step 5: the
    stop waits for it, puts it in place, then writes step 5's, and says how to resume."""
    result = run_cohort(["fit", *debug_run_args, *QUIET, "--trainer.max_steps", "8",
                         "--checkpoint.every_n_train_steps", "3", *batch_sizes(8, 2), *ASYNC,
                         "--trainer.callbacks+=tests.helpers.SignalAtStep", "--trainer.callbacks.signal_name=SIGTERM",
                         "--trainer.callbacks.step=4", "--trainer.callbacks.micro_batch=1", *hold_writes(100)],
                        cwd=tmp_path)
    assert result.returncode == 143, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"cohort: stopped by SIGTERM after step 5; {CHECKPOINTS}/last.ckpt holds that step: resume with the same "
        "command and --ckpt_path last")
    folder = tmp_path / CHECKPOINTS
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt", "step=000003.ckpt", "step=000005.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step=000005.ckpt"
    steps = [load_checkpoint(folder / name)["global_step"] for name in ("step=000003.ckpt", "step=000005.ckpt")]
    assert steps == [3, 5]


class OwnWriterStrategy(DDPStrategy):
    """A strategy that writes its checkpoints its own way, as DeepSpeed's does."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        raise AssertionError("never called: the refusal comes first")


@pytest.mark.parametrize("strategy, refusal", [
    (FSDPStrategy(state_dict_type="sharded"), "checkpoint.async_save cannot copy FSDPStrategy's sharded checkpoints"),
    (OwnWriterStrategy(), "checkpoint.async_save does not know how OwnWriterStrategy writes its checkpoints"),
], ids=["fsdp-sharded", "own-writer"])
def test_async_save_refuses_a_strategy_whose_checkpoints_it_cannot_write(strategy: Any, refusal: str) -> None:
    with pytest.raises(UserError, match=refusal):
        check_writes_in_background(strategy)
    check_writes_in_background(FSDPStrategy(state_dict_type="full"))  # one file, gathered on rank 0: written
