"""Per-rank monitoring on 2 gloo processes, the FLOP arithmetic, and the comm command."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.flops import formula_flops_per_token, measured_flops_per_token, peak_tflops_per_device
from app.monitoring import RankMonitor
from models.gpt import GPT_CONFIGS
from tests.helpers import DDP_2, QUIET, REPO_ROOT, batch_sizes, free_port, run_cohort



def monitored_fit(tmp_path: Path, args: list[str], *extra: str) -> subprocess.CompletedProcess:
    return run_cohort(["fit", *args, *QUIET, *DDP_2, "--trainer.max_steps", "8", "--monitor.every_n_steps", "2",
                       "--monitor.straggler_windows", "2", *batch_sizes(8, 2), *extra], cwd=tmp_path)


@pytest.mark.slow
def test_balanced_run_logs_every_rank_and_raises_no_alarm(tmp_path: Path, debug_run_args: list[str]) -> None:
    result = monitored_fit(tmp_path, debug_run_args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "straggler:" not in result.stderr + result.stdout
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for field in ("data_wait_s", "compute_s", "sync_wait_s", "step_s", "loss", "host_rss_gib"):
        assert {f"monitor/{field}/{s}" for s in ("min", "median", "max", "rank0", "rank1")} <= tags, field
    assert {"throughput/tokens_per_second", "throughput/tflops", "monitor/straggler_events"} <= tags
    assert len(events.Scalars("monitor/compute_s/rank1")) == 4  # 8 steps in windows of 2
    steps = [e.value for e in events.Scalars("monitor/step_s/median")]
    parts = [sum(events.Scalars(f"monitor/{f}/median")[i].value for f in ("data_wait_s", "compute_s", "sync_wait_s"))
             for i in range(4)]
    assert all(0 < part <= step * 1.05 for part, step in zip(parts, steps))  # the split fits inside the step
    assert "run summary" in result.stderr + result.stdout


@pytest.mark.slow
def test_slow_rank_is_named_as_the_straggler(tmp_path: Path, debug_run_args: list[str]) -> None:
    result = monitored_fit(tmp_path, debug_run_args, "--trainer.callbacks+=tests.helpers.SlowRank",
                           "--trainer.callbacks.rank=1", "--trainer.callbacks.seconds=0.1")
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stderr + result.stdout
    assert f"straggler: rank 1 on {os.uname().nodename}" in output
    assert "straggler: rank 0" not in output


@pytest.mark.slow
def test_replica_check_names_the_rank_whose_weights_differ(tmp_path: Path, debug_run_args: list[str]) -> None:
    result = monitored_fit(tmp_path, debug_run_args, "--monitor.replica_check_every_n_steps", "2",
                           "--trainer.callbacks+=tests.helpers.PerturbWeights",
                           "--trainer.callbacks.rank=1", "--trainer.callbacks.step=3")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("cohort: error: replica check at step 4: rank(s) [1] hold different weights")


def test_flop_count_matches_a_hand_computed_case() -> None:
    # debug: L=2, H=2, C=32, Q=16, V=256, T=64. Weights per layer 12C^2 + 13C = 12,704; final norm 2C = 64;
    # tied head VC = 8,192; N = 2 x 12,704 + 64 + 8,192 = 33,664. 6N = 201,984; 12LHQT = 12x2x2x16x64 = 49,152.
    assert formula_flops_per_token(GPT_CONFIGS["debug"], 64) == 251_136
    # torch counts matmuls only, not the biases and norms in 6N: 6 x (2 x 12C^2 + VC) + 12LHQT = 245,760
    assert measured_flops_per_token(GPT_CONFIGS["debug"], 64) == 245_760
    gpt2 = GPT_CONFIGS["gpt2"]
    formula = formula_flops_per_token(gpt2, 1024)
    assert measured_flops_per_token(gpt2, 1024) == pytest.approx(formula, rel=0.002)


@pytest.mark.parametrize("world_size", [1, 2])
def test_tokens_per_second_and_mfu_do_not_depend_on_world_size(world_size: int) -> None:
    """Global batch 32 x 128 tokens per optimizer step, 0.5 s per step: the same numbers however it is split (the
    report works from whole optimizer steps, so accumulation never enters it)."""
    monitor = RankMonitor(peak_tflops=100.0)
    monitor.tokens_per_step, monitor.samples_per_step = 32 * 128, 32
    monitor.flops_per_token, monitor.peak, monitor.hosts = 1e9, 100.0, ["h"] * world_size
    logged: dict[str, float] = {}
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.update(metrics))
    trainer = SimpleNamespace(world_size=world_size, is_global_zero=True,
                              loggers=[logger], global_step=10, datamodule=SimpleNamespace(num_workers=0))
    per_rank = {name: [0.1] * world_size for name in ("data_wait_s", "compute_s", "sync_wait_s", "loss", "loss_std",
                                                      "host_rss_gib", "cuda_peak_allocated_gib",
                                                      "cuda_peak_reserved_gib")}
    monitor._report(trainer, {**per_rank, "step_s": [0.5] * world_size, "losses_per_rank": 4})
    assert logged["throughput/tokens_per_second"] == pytest.approx(32 * 128 / 0.5)
    assert logged["throughput/tflops"] == pytest.approx(1e9 * 32 * 128 / 0.5 / 1e12)
    assert logged["throughput/mfu"] == pytest.approx(logged["throughput/tflops"] / (100.0 * world_size))


def test_peak_table_covers_a100_h100_h200_and_not_cpus() -> None:
    assert peak_tflops_per_device("NVIDIA A100-SXM4-80GB", "bf16-mixed") == 312.0
    assert peak_tflops_per_device("NVIDIA H100 80GB HBM3", "bf16-mixed") == 989.0
    assert peak_tflops_per_device("NVIDIA H200", "16-mixed") == 989.0
    assert peak_tflops_per_device("CPU", "32-true") is None


@pytest.mark.slow
def test_comm_reports_consistent_bandwidths_on_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "comm.csv"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m", "app",
         "comm", "--max-size", "1M", "--iterations", "3", "--warmup", "1", "--csv", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "collectives over 2 ranks (gloo)" in result.stdout
    rows = list(csv.DictReader(out.open()))
    assert {row["operation"] for row in rows} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert sorted({int(row["bytes"]) for row in rows}) == [1024, 4096, 16384, 65536, 262144, 1048576]
    for row in rows:
        algorithm, bus = float(row["algorithm_gbps"]), float(row["bus_gbps"])
        assert algorithm > 0 and float(row["seconds"]) > 0
        factor = 2 * (2 - 1) / 2 if row["operation"] == "all_reduce" else (2 - 1) / 2
        assert bus == pytest.approx(algorithm * factor)
