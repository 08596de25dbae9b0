"""``cohort doctor`` judging the job it checks: a GPU job checked from a machine without a GPU, the memory line
whatever else fails, and every threshold stated in its line."""

from __future__ import annotations

import contextlib
import io
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from app.tools.doctor import DoctorCLI, check_disk_space
from app.tools.doctor import main as doctor
from tests.helpers import CONFIG_DIR, process_state_kept

GPU_BF16 = ["-c", str(CONFIG_DIR / "trainer/gpu_bf16.yaml")]


def doctor_lines(args: list[str]) -> tuple[dict[str, str], bool]:
    """The doctor's lines by check name (status and detail, advice after a newline), and whether it passed."""
    passed = True
    output = io.StringIO()
    with contextlib.redirect_stdout(output), process_state_kept():
        try:
            doctor(args)
        except SystemExit:
            passed = False
    lines: dict[str, str] = {}
    name = ""
    for line in output.getvalue().splitlines()[1:]:
        if line.startswith(" "):
            lines[name] += "\n" + line.strip()
        else:
            name = line[6:].split("  ")[0].strip()
            lines[name] = line
    return lines, passed


def test_a_gpu_job_checked_without_a_gpu_passes_when_it_fits(debug_run_args: list[str], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--device_memory on a CPU machine: the precision is the GPU's, the loader is timed without the CPU's compute
    (which says nothing of the GPU's), the memory fits; so the doctor passes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines, passed = doctor_lines([*debug_run_args, *GPU_BF16, "--device_memory", "16GiB"])
    assert lines["precision"].startswith("PASS") and "bf16-mixed, judged for the GPU" in lines["precision"]
    assert lines["data loader"].startswith("SKIP") and "compute is not timed" in lines["data loader"]
    assert lines["memory"].startswith("PASS") and "fits" in lines["memory"]
    assert passed, lines


def test_hybrid_sharding_shows_replicas_and_shards_and_the_memory_accumulation_costs(
        debug_run_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hsdp_cpu.yaml with 2 micro-batches per step: the run plan line shows both sizes; the memory is that of 2
    shards (not 4) and states the whole gradients accumulation holds; reducing every micro-batch drops that line."""
    monkeypatch.chdir(tmp_path)
    hsdp = [*debug_run_args, "-c", str(CONFIG_DIR / "trainer/hsdp_cpu.yaml"), "--data.global_batch_size", "16",
            "--data.micro_batch_size", "2"]
    lines, _ = doctor_lines(hsdp)
    assert "4 data-parallel ranks (2 replicas x 2 shards) x 2 accumulation steps" in lines["run plan"]
    assert "unsharded gradients under accumulation" in lines["memory"], lines["memory"]
    lines, _ = doctor_lines([*hsdp, "--trainer.strategy.init_args.reduce_gradients_every_micro_batch", "true"])
    assert "unsharded gradients" not in lines["memory"], lines["memory"]


def test_tensor_parallelism_alone_accumulates_no_second_copy_of_the_gradients(
        debug_run_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 over one data-parallel shard (tensor parallelism alone) holds its gradients whole already, so
    accumulating adds nothing (measured: benchmarks/RESULTS.md, the plan's memory)."""
    monkeypatch.chdir(tmp_path)
    lines, _ = doctor_lines([*debug_run_args, "-c", str(CONFIG_DIR / "trainer/model_parallel_cpu.yaml"),
                             "--trainer.strategy.init_args.data_parallel_size", "1",
                             "--trainer.strategy.init_args.tensor_parallel_size", "2",
                             "--data.global_batch_size", "16", "--data.micro_batch_size", "2"])
    assert "8 accumulation steps" in lines["run plan"], lines["run plan"]
    assert "FSDP gathered" in lines["memory"] and "unsharded gradients" not in lines["memory"], lines["memory"]


def test_fault_tolerant_groups_are_estimated_as_the_fsdp2_they_run(debug_run_args: list[str], tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group shards the network over its 2 processes (FSDP2): the estimate gathers units and holds the whole
    gradients while it accumulates 2 micro-batches, and has no DDP buckets."""
    monkeypatch.chdir(tmp_path)
    lines, _ = doctor_lines([*debug_run_args, "-c", str(CONFIG_DIR / "trainer/fault_tolerant_groups_cpu.yaml"),
                             "--data.global_batch_size", "16", "--data.micro_batch_size", "2"])
    memory = lines["memory"]
    assert "FSDP gathered" in memory and "unsharded gradients under accumulation" in memory, memory
    assert "DDP buckets" not in memory, memory


def test_the_memory_line_is_skipped_with_its_reason_when_the_sizes_are_unknown(
        debug_run_args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    lines, passed = doctor_lines([*debug_run_args, "--data.global_batch_size", "7", "--data.micro_batch_size", "2"])
    assert lines["run plan"].startswith("FAIL") and not passed
    assert lines["memory"].startswith("SKIP") and "run plan's sizes could not be resolved" in lines["memory"]


def test_the_loader_line_states_its_thresholds(debug_run_args: list[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever this machine's timing gives (not judged here), the line says where a warning and a failure start."""
    monkeypatch.chdir(tmp_path)
    lines, _ = doctor_lines(debug_run_args)
    assert "(warns from 10%, fails from 30%)" in lines["data loader"], lines["data loader"]


@pytest.mark.parametrize("free_checkpoints, status", [(6, "PASS"), (3, "WARN"), (1, "FAIL")])
def test_the_disk_line_states_its_rule(free_checkpoints: int, status: str, debug_run_args: list[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    parameters = 2**28  # 3 GiB of float32 weights and AdamW state
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(0, 0, free_checkpoints * 3 * 2**30))
    log_disk = check_disk_space(DoctorCLI(debug_run_args).config, parameters)[0]
    assert log_disk.status == status.lower()
    assert log_disk.detail.endswith(f"{free_checkpoints * 3:.1f} GiB free, a checkpoint (weights and AdamW state in "
                                    "float32) is 3.00 GiB: passes with room for 5 (15.00 GiB), fails below 2 (6.00 GiB)")


@pytest.mark.parametrize("data", ["IndexedFeatures", "NoArguments"])
def test_the_loader_of_a_datamodule_of_ones_own_is_timed(data: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain LightningDataModule: the loader fit would hand rank 0 is timed against the family's step; where the
    loader is slow, the advice names its own num_workers (whether it is slow here is this machine's timing)."""
    monkeypatch.chdir(tmp_path)
    lines, _ = doctor_lines(["--model", "tests.test_your_own_data.FeatureClassifier",
                             "--data", f"tests.test_your_own_data.{data}", "--trainer.accelerator", "cpu"])
    assert lines["run plan"].startswith("PASS") and "16 samples per optimizer step" in lines["run plan"]
    loader = lines["data loader"]
    assert "ms per micro-batch vs" in loader and "(warns from 10%, fails from 30%)" in loader, loader
    assert loader.startswith("PASS") or f"-> raise the num_workers of {data}'s train_dataloader (now 0)" in loader
