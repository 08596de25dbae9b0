"""Per-rank monitoring on 2 gloo processes, the FLOP arithmetic, and the comm command."""

from __future__ import annotations

import csv
import itertools
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.hparams import metadata as hparams_metadata

from app.observability.fields import FIELDS
from app.observability.flops import measured_peak_tflops, peak_tflops_per_device
from app.observability.monitor import RankMonitor
from app.observability.verdicts import median_of_others
from core.precision import PRECISIONS, precision_named
from core.run_plan import RunPlan
from models.gpt.family import GPTLanguageModel
from models.gpt.network import GPT_CONFIGS, training_flops_per_token
from tests.helpers import (DDP_2, QUIET, REPO_ROOT, batch_sizes, fit_in_process, free_port, last_checkpoint_contents,
                           run_cohort, scalars)


def monitored_fit(tmp_path: Path, args: list[str], *extra: str,
                  compute_seconds: tuple[float, float] = (10.0, 10.0)) -> subprocess.CompletedProcess:
    """8 steps on 2 processes in windows of 2, a straggler after 2 slow windows; each micro-batch of rank R computes
    ``compute_seconds[R]`` on the monitor's clock (tests.helpers.ScriptedStepTimes), 2 micro-batches a step."""
    return run_cohort(["fit", *args, *QUIET, *DDP_2, "--trainer.max_steps", "8", "--monitor.every_n_steps", "2",
                       "--monitor.straggler_windows", "2", *batch_sizes(8, 2),
                       "--trainer.callbacks+=tests.helpers.ScriptedStepTimes",
                       f"--trainer.callbacks.compute_seconds=[{compute_seconds[0]}, {compute_seconds[1]}]", *extra],
                      cwd=tmp_path)


@pytest.mark.slow
def test_balanced_run_logs_every_rank_and_raises_no_alarm(tmp_path: Path, debug_run_args: list[str]) -> None:
    """Both ranks compute 10 s per micro-batch: 20 s per step, no sync wait, no straggler. The real data wait, some
    milliseconds a step, is all that the machine adds."""
    result = monitored_fit(tmp_path, debug_run_args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "straggler:" not in result.stderr + result.stdout
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for field in ("data_wait_s", "compute_s", "sync_wait_s", "step_s", "loss", "host_rss_gib"):
        assert {f"monitor/{field}/{s}" for s in ("min", "median", "max", "rank0", "rank1")} <= tags, field
    assert {"throughput/tokens_per_second", "throughput/tflops", "monitor/straggler_events",
            "monitor/straggler_cost_share"} <= tags
    assert not any("cuda" in tag or "pipeline" in tag for tag in tags)  # no series of zeros on a CPU DDP run
    for rank in (0, 1):  # 8 steps in windows of 2
        assert scalars(tmp_path, f"monitor/compute_s/rank{rank}") == pytest.approx([20.0] * 4)
        assert scalars(tmp_path, f"monitor/step_s/rank{rank}") == pytest.approx([20.0] * 4)
        assert scalars(tmp_path, f"monitor/sync_wait_s/rank{rank}") == [0.0] * 4
    assert scalars(tmp_path, "monitor/straggler_events") == [0] * 4
    assert scalars(tmp_path, "monitor/slowest_rank_ratio") == [1.0] * 4
    assert max(scalars(tmp_path, "monitor/straggler_cost_share")) < 0.01  # the data waits' difference alone
    console = result.stderr + result.stdout
    assert "run summary" in console and "(matmul probe at start)" in console  # an MFU on CPUs too
    assert "throughput/mfu" in tags
    assert "CUDA" not in console and "Tip" not in console  # nothing meaningless on this device, no advertisement


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory: pytest.TempPathFactory, debug_run_args: list[str]) -> tuple[Path, str]:
    """One 2-process run in which rank 1 computes 20 s per micro-batch and rank 0 10 s, so rank 0 waits 20 s of each
    40 s step in the all-reduce: a straggler after 2 slow windows, validation at steps 4 and 8. Its folder and its
    console output."""
    run_dir = tmp_path_factory.mktemp("slowed")
    result = monitored_fit(run_dir, debug_run_args, "--val_every_n_steps", "4", compute_seconds=(10.0, 20.0))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stderr + result.stdout


@pytest.mark.slow
def test_a_rank_slowed_twofold_is_named_with_what_it_costs(slowed_run: tuple[Path, str]) -> None:
    run_dir, output = slowed_run
    alerts = [line for line in output.splitlines() if "straggler:" in line]
    assert len(alerts) == 1, alerts
    assert f"straggler: rank 1 on {os.uname().nodename} computes 40.000 s/step" in alerts[0], alerts[0]
    assert "(2.0x)" in alerts[0], alerts[0]
    assert re.search(r"the others wait \d+\.\d{3} s/step for it \(\d+% of the step\)", alerts[0]), alerts[0]
    assert scalars(run_dir, "monitor/straggler_events") == [0, 1, 1, 1]  # at the 2nd slow window in a row, once
    assert scalars(run_dir, "monitor/slowest_rank_ratio") == pytest.approx([2.0] * 4)
    assert scalars(run_dir, "monitor/sync_wait_s/rank0") == pytest.approx([20.0] * 4)  # waiting for rank 1
    assert scalars(run_dir, "monitor/sync_wait_s/rank1") == [0.0] * 4
    # rank 0 waits 20 s of the 40 s step for rank 1; the real data waits move that by their milliseconds
    assert scalars(run_dir, "monitor/straggler_cost_share") == pytest.approx([0.5] * 4, abs=0.01)
    assert re.search(r"waiting for the slowest rank +\d+\.\d% of the step", output)


@pytest.mark.slow
def test_tensorboard_layout_charts_every_rank_and_hparams_carry_the_final_val_loss(
        slowed_run: tuple[Path, str]) -> None:
    run_dir, _ = slowed_run
    events = EventAccumulator(str(run_dir / "lightning_logs" / "version_0"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = [chart for category in layout.category for chart in category.chart]
    # the tags each multi-line chart draws, matched as TensorBoard matches them (re.match)
    drawn = [{tag for tag in tags if any(re.match(pattern, tag) for pattern in chart.multiline.tag)}
             for chart in charts if chart.HasField("multiline")]
    bands = [(s.value, s.lower, s.upper) for chart in charts if chart.HasField("margin") for s in chart.margin.series]
    for field in ("loss", "step_s", "data_wait_s", "compute_s", "sync_wait_s", "host_rss_gib"):
        assert {f"monitor/{field}/rank0", f"monitor/{field}/rank1"} in drawn, field
        assert (f"monitor/{field}/median", f"monitor/{field}/min", f"monitor/{field}/max") in bands, field
    assert set().union(*bands) <= tags
    assert not any("cuda" in tag for chart in drawn for tag in chart)  # no empty CUDA charts on CPU

    hparams = events.PluginTagToContent("hparams")
    experiment = hparams_metadata.parse_experiment_plugin_data(hparams["_hparams_/experiment"])
    assert [metric.name.tag for metric in experiment.metric_infos] == ["hp_metric"]
    session = hparams_metadata.parse_session_start_info_plugin_data(hparams["_hparams_/session_start_info"])
    assert session.hparams["model_name"].string_value == "debug"
    val_loss = scalars(run_dir, "val/loss")
    assert len(val_loss) == 2 and scalars(run_dir, "hp_metric")[-1] == pytest.approx(val_loss[-1])


class FakeCudaEvent:
    """torch.cuda.Event on a CPU: each one recorded is 10 ms after the one before."""

    recorded = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.milliseconds = 0.0

    def record(self) -> None:
        FakeCudaEvent.recorded += 1
        self.milliseconds = 10.0 * FakeCudaEvent.recorded

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: FakeCudaEvent) -> float:
        return later.milliseconds - self.milliseconds


@pytest.fixture
def monitor_on_a_fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor of a run on this CPU believes it runs on an H100 holding 3 GiB at peak (4 GiB reserved): while
    it starts, the strategy's root_device reads cuda:0, and the CUDA calls it makes answer as a GPU would. The rest of
    the run sees the CPU it trains on."""
    on_train_start = RankMonitor.on_train_start

    def on_train_start_on_a_gpu(monitor: RankMonitor, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        cpu_strategy_class = type(strategy)
        strategy.__class__ = type("OnAGpu", (cpu_strategy_class,),
                                  {"root_device": property(lambda _: torch.device("cuda", 0))})
        try:
            on_train_start(monitor, trainer, pl_module)
        finally:
            strategy.__class__ = cpu_strategy_class

    monkeypatch.setattr(RankMonitor, "on_train_start", on_train_start_on_a_gpu)
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * 2**30)


@pytest.mark.usefixtures("monitor_on_a_fake_gpu")
def test_a_gpu_run_logs_its_cuda_memory_and_ends_with_its_summary_and_final_checkpoint(
        tmp_path: Path, debug_run_args: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """The monitor's GPU path, on a CPU: 4 steps in windows of 2, no checkpoint but the final one."""
    with caplog.at_level(logging.INFO):
        fit_in_process(tmp_path, debug_run_args, "--trainer.max_steps", "4", "--monitor.every_n_steps", "2",
                       "--checkpoint.every_n_train_steps", "1000", "--trainer.limit_val_batches", "0",
                       *batch_sizes(8, 4))
    for field, gib in (("cuda_peak_allocated_gib", 3.0), ("cuda_peak_reserved_gib", 4.0)):
        for statistic in ("rank0", "min", "median", "max"):
            assert scalars(tmp_path, f"monitor/{field}/{statistic}") == [gib, gib], (field, statistic)
    assert scalars(tmp_path, "monitor/compute_s/rank0") == pytest.approx([0.02, 0.02])  # 2 micro-batches of 10 ms
    assert "(data sheet)" in caplog.text
    assert re.search(r"CUDA peak allocated, largest rank +3\.00 GiB", caplog.text), caplog.text
    assert re.search(r"CUDA peak reserved, largest rank +4\.00 GiB", caplog.text), caplog.text
    assert last_checkpoint_contents(tmp_path)["global_step"] == 4
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    layout = layout_pb2.Layout.FromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    titles = [chart.title for category in layout.category for chart in category.chart]
    assert "CUDA memory, peak allocated (GiB) — every rank" in titles
    assert "CUDA memory, peak reserved (GiB) — min, median, max" in titles


def reporting_monitor(world_size: int, **options: float) -> tuple[RankMonitor, SimpleNamespace, dict[str, float]]:
    """A monitor whose _report runs without a run: global batch 32 x 128 tokens, 1 GFLOP per token, a 100 TFLOP/s
    peak; the dict holds what it logged last."""
    monitor = RankMonitor(peak_tflops=100.0, **options)
    monitor._plan = RunPlan(devices_per_node=world_size, num_nodes=1, data_parallel_size=world_size,
                            tensor_parallel_size=1, global_batch_size=32, micro_batch_size=4, sequence_length=128,
                            precision=PRECISIONS["32-true"], seed=0)
    monitor.flops_per_token, monitor.peak, monitor.hosts = 1e9, 100.0, [f"host{r}" for r in range(world_size)]
    logged: dict[str, float] = {}
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.update(metrics))
    trainer = SimpleNamespace(world_size=world_size, is_global_zero=True,
                              loggers=[logger], global_step=10, train_dataloader=SimpleNamespace(num_workers=0))
    return monitor, trainer, logged


def window(compute: list[float]) -> dict[str, object]:
    """A window's gathered table: the given compute per rank; 0.02 s data wait, a 0.5 s step and 0.1 in every other
    field on every rank."""
    per_rank = {field.name: [0.1] * len(compute) for field in FIELDS}
    return {**per_rank, "compute_s": compute, "data_wait_s": [0.02] * len(compute), "step_s": [0.5] * len(compute),
            "losses_per_rank": 4}


@pytest.mark.parametrize("world_size", [1, 2])
def test_tokens_per_second_and_mfu_do_not_depend_on_world_size(world_size: int) -> None:
    """Global batch 32 x 128 tokens per optimizer step, 0.5 s per step: the same numbers however it is split (the
    report works from whole optimizer steps, so accumulation never enters it)."""
    monitor, trainer, logged = reporting_monitor(world_size)
    monitor._report(trainer, window([0.1] * world_size))
    assert logged["throughput/tokens_per_second"] == pytest.approx(32 * 128 / 0.5)
    assert logged["throughput/tflops"] == pytest.approx(1e9 * 32 * 128 / 0.5 / 1e12)
    assert logged["throughput/mfu"] == pytest.approx(logged["throughput/tflops"] / (100.0 * world_size))


@pytest.mark.parametrize(("compute", "straggler"), [
    ([0.2, 0.4], 1),  # 2 ranks, rank 1 2x slower: rank 0 idles 0.2 s of its 0.5 s step waiting for it
    ([0.2] * 7 + [0.4], 7),  # 8 ranks, one 2x slower
    ([0.3, 0.3], None),
    ([0.3] * 8, None),
])
def test_a_straggler_is_named_after_straggler_windows_slow_windows(
        compute: list[float], straggler: int | None, caplog: pytest.LogCaptureFixture) -> None:
    monitor, trainer, logged = reporting_monitor(len(compute), straggler_windows=3)
    monitor._sync_measured = True
    events = []
    with caplog.at_level(logging.WARNING, logger="app.observability.verdicts"):
        for _ in range(4):
            monitor._report(trainer, window(compute))
            events.append(logged["monitor/straggler_events"])
    alerts = [record.getMessage() for record in caplog.records if "straggler:" in record.getMessage()]
    if straggler is None:
        assert events == [0, 0, 0, 0] and not alerts
        assert logged["monitor/slowest_rank_ratio"] == 1.0 and logged["monitor/straggler_cost_share"] == 0.0
    else:
        assert events == [0, 0, 1, 1]  # once, at the third window in a row
        assert len(alerts) == 1 and alerts[0].startswith(f"straggler: rank {straggler} on host{straggler} ")
        assert "(2.0x)" in alerts[0] and "wait 0.200 s/step for it (40% of the step)" in alerts[0]
        assert logged["monitor/slowest_rank_ratio"] == pytest.approx(2.0)
        assert logged["monitor/straggler_cost_share"] == pytest.approx(0.4)


def test_median_of_others_leaves_out_one_copy_of_each_value() -> None:
    assert median_of_others([1.0, 3.0]) == [3.0, 1.0]
    assert median_of_others([5.0, 1.0, 1.0, 2.0]) == [1.0, 2.0, 2.0, 1.0]
    assert median_of_others([4.0, 1.0, 2.0]) == [1.5, 3.0, 2.5]


@pytest.mark.slow
def test_replica_check_names_the_rank_whose_weights_differ(tmp_path: Path, debug_run_args: list[str]) -> None:
    result = monitored_fit(tmp_path, debug_run_args, "--replica_check.every_n_steps", "2",
                           "--trainer.callbacks+=tests.helpers.PerturbWeights",
                           "--trainer.callbacks.rank=1", "--trainer.callbacks.step=3")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("cohort: error: replica check at step 4: rank(s) [1] hold different weights")


def test_flop_count_matches_a_hand_computed_case() -> None:
    # debug: L=2, H=2, C=32, Q=16, V=256, T=64. Weights per layer 12C^2 + 13C = 12,704; final norm 2C = 64;
    # tied head VC = 8,192; N = 2 x 12,704 + 64 + 8,192 = 33,664. 6N = 201,984; 12LHQT = 12x2x2x16x64 = 49,152.
    assert training_flops_per_token(GPT_CONFIGS["debug"], 64) == 251_136
    # torch counts matmuls only, not the biases and norms in 6N: 6 x (2 x 12C^2 + VC) + 12LHQT = 245,760 per token
    assert GPTLanguageModel("debug").flops_per_sample(64) == 245_760 * 64
    formula = training_flops_per_token(GPT_CONFIGS["gpt2"], 1024)
    assert GPTLanguageModel("gpt2").flops_per_sample(1024) == pytest.approx(formula * 1024, rel=0.002)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_counts_its_matmuls_against_its_clock(dtype: torch.dtype) -> None:
    """A clock that moves 0.25 s at each reading: 4 timed matmuls of 512 x 512 fill the probe's second, each
    2 x 512^3 FLOPs."""
    readings = itertools.count(1)
    tflops = measured_peak_tflops(torch.device("cpu"), dtype, seconds=1.0, clock=lambda: next(readings) * 0.25)
    assert tflops == 4 * 2 * 512**3 / 1.0 / 1e12


def test_peak_table_covers_a100_h100_h200_and_not_cpus() -> None:
    bf16_mixed, fp16_mixed = precision_named("bf16-mixed"), precision_named("16-mixed")
    assert peak_tflops_per_device("NVIDIA A100-SXM4-80GB", bf16_mixed.compute_dtype) == 312.0
    assert peak_tflops_per_device("NVIDIA H100 80GB HBM3", bf16_mixed.compute_dtype) == 989.0
    assert peak_tflops_per_device("NVIDIA H200", fp16_mixed.compute_dtype) == 989.0
    assert peak_tflops_per_device("CPU", torch.float32) is None


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
