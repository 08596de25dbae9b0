"""The branches only a CUDA GPU takes, run on this CPU with what the GPU would answer faked: ``torch.cuda``'s
queries return an 8-GPU H100 machine's answers, and the calls that would act on a device (set_device, synchronize,
events, NCCL's process groups) are recorded instead. Each test asserts what the branch produces. The real-GPU tests
are tests/test_gpu.py; what only a device can run, and why, is listed in docs/uncovered.md.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import CUDAAccelerator
from torch.distributed.checkpoint.staging import StagingOptions

from app.cli.launch import Launch, join_process_group, launch_device
from app.cli.lightning_cli import CohortCLI
from app.cli.preflight import Preflight, resolve_precision
from app.cli.run_plan_resolution import configured_strategy, devices_per_node
from app.observability.flight_recorder import NcclFlightRecorder
from app.safety import async_checkpoints
from app.safety.async_checkpoints import BackgroundWriter
from app.safety.bad_steps import BadStepGuard
from app.safety.determinism import PerRankSeed
from app.safety.launch_environment import REPLICA_GROUP_ENV
from app.strategies.fault_tolerance import job
from app.strategies.fault_tolerance.job import ReplicaGroupsLauncher
from app.strategies.fault_tolerance.strategy import FaultTolerantStrategy
from app.tools import comm
from app.tools.doctor import DoctorCLI, check_memory, instantiate_family
from app.tools.memory import visible_device_memory
from core.errors import UserError
from core.seeding import derive_seed
from models.module import unscale_gradients
from models.optimizer import OptimizerSettings
from models.parallel.pipeline import TimedStage
from tests.helpers import CONFIG_DIR, one_line_error

GPUS = 8
GPU_MEMORY = 80 * 2**30
TRAINER = CONFIG_DIR / "trainer"
QUICKSTART = CONFIG_DIR / "quickstart.yaml"


@pytest.fixture
def device_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """An 8-GPU machine as torch.cuda describes it; what would act on a GPU is recorded in the list returned."""
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: GPUS)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=GPU_MEMORY))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    return calls


# ----- the GPU presets, resolved as far as the pre-flight checks go -----
# preset: (world size, pipeline stages, data parallel, tensor parallel, accumulation) of a global batch of 64
# samples in micro-batches of 4
GPU_PRESETS = {
    "gpu_bf16": (1, 1, 1, 1, 16),
    "ddp_gpu_bf16": (GPUS, 1, GPUS, 1, 2),  # devices -1: every visible GPU
    "fsdp_gpu_bf16": (GPUS, 1, GPUS, 1, 2),  # FSDP (version 1), which CPUs refuse
    "model_parallel_gpu_bf16": (GPUS, 1, GPUS, 1, 2),
    "pipeline_gpu_bf16": (GPUS, 2, 4, 1, 4),
    "multinode_gpu_bf16": (2 * GPUS, 1, 2 * GPUS, 1, 1),  # under torchrun: see the environment below
    "async_ps_gpu_bf16": (GPUS, 1, 1, 1, 16),  # one server and 7 workers, each update a whole global batch
    "fault_tolerant_gpu_bf16": (1, 1, 1, 1, 8),  # a process per replica group; of 2 groups, each reads half
}


@pytest.mark.parametrize(("preset", "sizes"), GPU_PRESETS.items(), ids=list(GPU_PRESETS))
def test_each_gpu_preset_resolves_through_the_preflight_checks_on_gpus(
        preset: str, sizes: tuple[int, ...], device_calls: list, byte_corpus: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every check fit runs before it builds anything (sizes, precision on this device, batch plan, folders), on
    8 visible GPUs; the 2-node preset as torchrun's rank 0 of 16. The precision stays bf16-mixed, as a GPU runs it."""
    monkeypatch.chdir(tmp_path)
    if preset.startswith("multinode"):
        for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0",
                            "LOCAL_WORLD_SIZE": str(GPUS), "WORLD_SIZE": str(2 * GPUS),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
            monkeypatch.setenv(name, value)
    cli = DoctorCLI(["-c", str(QUICKSTART), "-c", str(TRAINER / f"{preset}.yaml"),
                     "--data.data_dir", str(byte_corpus), "--data.global_batch_size", "64",
                     "--data.micro_batch_size", "4"])
    plan = Preflight(cli.config, "fit").run()
    assert (plan.world_size, plan.pipeline_parallel_size, plan.data_parallel_size, plan.tensor_parallel_size,
            plan.accumulation) == sizes
    assert plan.precision.name == cli.config.trainer.precision == "bf16-mixed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_a_gpu_preset_without_a_gpu_is_refused_in_the_preflight(byte_corpus: Path) -> None:
    """The twin of the test above on this CPU: the branch the GPUs took is the one that differs."""
    cli = DoctorCLI(["-c", str(QUICKSTART), "-c", str(TRAINER / "ddp_gpu_bf16.yaml"), "--model.model_name", "debug",
                     "--data.data_dir", str(byte_corpus)])
    with pytest.raises(UserError, match="trainer.accelerator=gpu but no CUDA GPU is visible"):
        Preflight(cli.config, "fit").run()


def test_devices_and_strategies_on_gpus(device_calls: list) -> None:
    auto = SimpleNamespace(devices="auto", accelerator="auto")
    assert devices_per_node(auto) == GPUS
    with pytest.raises(UserError, match="trainer.devices=-1 picks GPUs, but this run is on the CPU"):
        devices_per_node(SimpleNamespace(devices=-1, accelerator="cpu"))  # Lightning's would be a TypeError
    configured_strategy("fsdp", "auto")  # FSDP (version 1) on the visible GPUs
    with pytest.raises(UserError, match="fsdp needs CUDA GPUs"):
        configured_strategy("fsdp", "cpu")


def test_16_mixed_keeps_its_grad_scaler_on_gpus_and_bf16_needs_a_gpu_that_has_it(
        device_calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_precision("16-mixed", "gpu") == "16-mixed"  # on a CPU: bf16-mixed
    assert resolve_precision("16", "auto") == "16-mixed"
    assert resolve_precision("16-true", "cuda") == "16-true"  # refused on CPUs
    assert resolve_precision("bf16", "gpu") == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)  # e.g. a V100
    with pytest.raises(UserError, match="trainer.precision=bf16-mixed: this GPU has no bfloat16 support"):
        resolve_precision("bf16-mixed", "auto")


def test_print_config_checks_16_mixed_as_a_gpu_runs_it(device_calls: list,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a GPU visible, --print_config leaves 16-mixed as it is (a CPU run would make it bf16-mixed), so the
    pipeline, whose own backward fp16's loss scaler cannot scale, refuses it; test_configs.py has the CPU twin."""
    args = ["fit", "-c", str(QUICKSTART), "-c", str(TRAINER / "pipeline_cpu.yaml"), "--trainer.accelerator", "auto",
            "--trainer.precision", "16-mixed", "--print_config"]
    assert "trainer.precision=16-mixed: the pipeline runs its own backward" in one_line_error(args, monkeypatch)


# ----- joining the job: the rank's GPU and NCCL (cohort comm, cohort doctor) -----
def test_a_rank_takes_the_gpu_of_its_local_rank(device_calls: list) -> None:
    launch = Launch("torchrun", rank=11, local_rank=3, world_size=16)
    assert launch_device(launch) == torch.device("cuda", 3)
    assert device_calls == [("set_device", torch.device("cuda", 3))]
    assert launch_device(launch, use_gpu=False) == torch.device("cpu")  # doctor under accelerator cpu


def test_gpus_join_over_nccl_bound_to_their_device(monkeypatch: pytest.MonkeyPatch) -> None:
    joined: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: joined.append((args, kwargs)))
    launch, timeout = Launch("slurm", rank=5, local_rank=1, world_size=8), timedelta(seconds=42)
    join_process_group(launch, torch.device("cuda", 1), timeout)
    join_process_group(launch, torch.device("cpu"), timeout)
    assert joined == [
        (("nccl",), {"rank": 5, "world_size": 8, "timeout": timeout, "device_id": torch.device("cuda", 1)}),
        (("gloo",), {"rank": 5, "world_size": 8, "timeout": timeout})]


def test_comm_waits_for_the_gpu_before_reading_the_clock(device_calls: list) -> None:
    comm.synchronize(torch.device("cpu"))
    comm.synchronize(torch.device("cuda", 2))
    assert device_calls == [("synchronize", torch.device("cuda", 2))]


# ----- NCCL's flight recorder -----
FLIGHT_RECORDER_SETTINGS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
                            "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def test_the_flight_recorder_is_set_before_nccl_starts_and_dumps_into_the_run(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FLIGHT_RECORDER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "500")  # the user's own setting wins
    recorder = NcclFlightRecorder(tmp_path / "version_3")
    assert {name: os.environ[name] for name in FLIGHT_RECORDER_SETTINGS} == {
        "TORCH_FR_BUFFER_SIZE": "500", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "version_3" / "flight_recorder" / "rank_"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert not recorder.folder.exists()  # made at setup, once the run's version is settled on every rank
    recorder.setup(None, None, "fit")
    assert recorder.folder.is_dir()


@pytest.mark.parametrize("accelerator", ["cuda", "cpu"])
def test_fit_adds_the_flight_recorder_on_gpus_only(accelerator: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.accelerators import CPUAccelerator

    for name in FLIGHT_RECORDER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    trainer = SimpleNamespace(accelerator=CUDAAccelerator() if accelerator == "cuda" else CPUAccelerator(),
                              callbacks=[], log_dir=str(tmp_path / "version_0"))
    cli = SimpleNamespace(trainer=trainer, model=SimpleNamespace(describe=lambda: "a model"),
                          run_plan=SimpleNamespace(describe=lambda: "a plan"))
    CohortCLI.before_fit(cli)
    recorders = [callback for callback in trainer.callbacks if isinstance(callback, NcclFlightRecorder)]
    assert [recorder.folder for recorder in recorders] == (
        [tmp_path / "version_0" / "flight_recorder"] if accelerator == "cuda" else [])


# ----- fp16's grad scaler (16-mixed on GPUs) -----
def test_16_mixeds_gradients_are_unscaled_once_before_clipping_and_the_fused_step_does_not_again() -> None:
    """Lightning's MixedPrecision on a GPU holds a GradScaler; torch's CPU one behaves alike. The gradients clipping
    reads are the true ones, and the fused AdamW step (which would unscale itself) moves the weights as plain
    float32 does."""
    torch.manual_seed(0)
    scaled, plain = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    plain.load_state_dict(scaled.state_dict())
    batch = torch.randn(8, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def step(network: torch.nn.Module, scaler: torch.amp.GradScaler | None) -> list[torch.Tensor]:
        optimizer = torch.optim.AdamW(network.parameters(), lr=0.1, fused=True)
        loss = network(batch).square().mean()
        if scaler is None:
            loss.backward()
            optimizer.step()
            return [param.grad for param in network.parameters()]
        scaler.scale(loss).backward()
        unscale_gradients(SimpleNamespace(scaler=scaler), optimizer)
        gradients = [param.grad.clone() for param in network.parameters()]  # what clipping reads
        scaler.step(optimizer)
        scaler.update()
        return gradients

    for got, expected in zip(step(scaled, scaler), step(plain, None)):
        torch.testing.assert_close(got, expected)
    for got, expected in zip(scaled.parameters(), plain.parameters()):
        torch.testing.assert_close(got, expected)
    assert scaler.get_scale() == 2.0**16  # no inf: the step was taken and the scale kept


def test_the_loss_spike_guard_is_refused_under_the_grad_scaler() -> None:
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=torch.amp.GradScaler("cpu")))
    with pytest.raises(UserError, match="spike_zscore does not work with precision 16-mixed"):
        BadStepGuard(spike_zscore=6.0).setup(trainer, None, "fit")
    BadStepGuard().setup(trainer, None, "fit")  # NaN and inf alone: the scaler's skips and the guard's agree


@pytest.mark.parametrize("loss", [2.5, float("nan")])
def test_under_the_grad_scaler_the_guard_leaves_the_skip_to_the_scaler(loss: float) -> None:
    """The scaler sets the fused step's found_inf from the gradients it unscales; the guard only reports (a NaN loss
    leaves NaN gradients, which the scaler skips), and reads no gradient norms (scaled ones would overflow)."""
    network = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(network.parameters(), fused=True)
    module = SimpleNamespace(run_plan=SimpleNamespace(asynchronous=False), device=torch.device("cpu"))
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=torch.amp.GradScaler("cpu")), world_size=1,
                              global_rank=0, global_step=4, lightning_module=module)
    guard = BadStepGuard(action="skip")
    guard.on_train_start(trainer, module)
    guard.on_before_backward(trainer, module, torch.tensor(loss))
    guard.on_before_optimizer_step(trainer, module, optimizer)  # no gradients at all: the guard must not ask
    assert not hasattr(optimizer, "found_inf")
    [(step, verdict, copied)] = guard._unread
    assert (step, verdict.tolist(), copied) == (5, [loss != loss, loss != loss], None)


# ----- CUDA events and streams -----
class RecordedEvent:
    """torch.cuda.Event as the host sees it: each record 250 ms after the previous one."""
    clock_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.recorded_at: float | None = None
        self.synchronized = False

    def record(self) -> None:
        RecordedEvent.clock_ms += 250.0
        self.recorded_at = RecordedEvent.clock_ms

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end: RecordedEvent) -> float:
        assert end.synchronized, "read before the end event has completed"
        return end.recorded_at - self.recorded_at


def test_a_pipeline_stage_on_a_gpu_times_its_chunks_with_events_read_later(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", RecordedEvent)
    stage = TimedStage.__new__(TimedStage)  # the timing alone: a PipelineStage needs a process group
    stage.device, stage._busy, stage._pending = torch.device("cuda", 0), 1.0, []
    assert stage._timed(lambda: "chunk output") == "chunk output"
    assert stage._timed(lambda: None) is None
    assert len(stage._pending) == 2 and stage._busy == 1.0  # nothing read yet: the stream runs on
    assert stage.busy_seconds == pytest.approx(1.5)  # 1 s before, then two chunks of 250 ms
    assert stage._pending == [] and stage.busy_seconds == pytest.approx(1.5)
    stage._timed(lambda: None)
    stage.busy_seconds = 0.0  # the monitor's reset drops what was pending too
    assert stage.busy_seconds == 0.0


def test_the_bad_step_verdict_is_read_once_its_copy_has_arrived() -> None:
    guard, arrived = BadStepGuard(), RecordedEvent()
    trainer = SimpleNamespace(world_size=2, checkpoint_callback=None)
    guard._unread = [(7, torch.tensor([0.0, 0.0, 0.0]), arrived), (8, torch.tensor([0.0, 0.0, 0.0]), RecordedEvent())]
    guard._act(trainer, keep_newest=True)
    assert arrived.synchronized and [step for step, _, _ in guard._unread] == [8]
    guard._unread = [(9, torch.tensor([0.0, 1.0, 1.0]), RecordedEvent())]
    with pytest.raises(UserError, match="step 9: the loss or gradients were NaN or inf on rank 1 of 2"):
        guard._act(trainer, keep_newest=False)


def test_the_gpu_generator_is_reseeded_with_the_cpus_seed_once_cuda_is_up(monkeypatch: pytest.MonkeyPatch) -> None:
    seeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "manual_seed", seeded.append)
    module = SimpleNamespace(run_plan=SimpleNamespace(seed=7, data_parallel_rank=lambda rank: rank // 2))
    state = torch.get_rng_state()
    try:
        PerRankSeed().on_train_batch_start(SimpleNamespace(global_rank=3, global_step=5), module, None, 2)
        assert seeded == [derive_seed(7, 1, 5, 2)] == [torch.initial_seed()]
    finally:
        torch.set_rng_state(state)


def test_checkpoints_of_a_gpu_run_are_staged_through_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    staged: list[StagingOptions] = []
    monkeypatch.setattr(async_checkpoints, "DefaultStager",
                        lambda options: staged.append(options) or SimpleNamespace(close=lambda: None))
    for device in (torch.device("cuda", 0), torch.device("cpu")):
        writer = BackgroundWriter()
        writer._meet(SimpleNamespace(strategy=SimpleNamespace(root_device=device), world_size=1))
        writer.close()
    assert [(options.use_pinned_memory, options.use_non_blocking_copy) for options in staged] == [(True, True),
                                                                                                (False, False)]


def test_adamw_is_fused_on_gpus() -> None:
    network = torch.nn.Linear(4, 4)  # on the CPU: the choice depends on the device named, not where weights are
    for device, fused in ((torch.device("cuda", 0), True), (torch.device("cpu"), True), (torch.device("meta"), False)):
        optimizer = OptimizerSettings().configure(network, device, global_batch_size=32, total_steps=10)["optimizer"]
        assert optimizer.defaults["fused"] is fused


def test_the_doctor_checks_the_memory_estimate_against_the_visible_gpu(
        device_calls: list, byte_corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the estimate adds the CUDA context (1 GiB) and is checked against the GPU's own size."""
    monkeypatch.chdir(tmp_path)
    cli = DoctorCLI(["-c", str(QUICKSTART), "-c", str(TRAINER / "gpu_bf16.yaml"), "--data.data_dir", str(byte_corpus)])
    preflight = Preflight(cli.config, None)
    plan = preflight.run()
    _, model, problems = instantiate_family(cli.config)
    assert problems == [] and visible_device_memory() == GPU_MEMORY
    check = check_memory(cli.config, model, plan, preflight.strategy.kind)
    assert check.status == "pass" and "CUDA context 1.0" in check.detail and "of 80.0 GiB: fits" in check.detail
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**30))
    check = check_memory(cli.config, model, plan, preflight.strategy.kind)
    assert check.status == "fail" and "of 1.0 GiB: does not fit" in check.detail


# ----- fault-tolerant replica groups on GPUs -----
def test_a_replica_group_runs_on_the_gpus_its_torchrun_was_given(tmp_path: Path, device_calls: list,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Group G of one process on GPU G, of two processes on GPUs 2G and 2G + 1 (its ranks' cuda:0 and cuda:1); more
    groups than GPUs share them."""
    started: list[dict[str, str]] = []
    monkeypatch.setattr(job.subprocess, "Popen", lambda command, env, **options: started.append(env))
    launcher = ReplicaGroupsLauncher(SimpleNamespace(replica_groups=10, max_restarts=2))
    for group in range(10):
        launcher._start_group(group, {}, [], tmp_path / "version_0")
    assert [env["CUDA_VISIBLE_DEVICES"] for env in started] == ["0", "1", "2", "3", "4", "5", "6", "7", "0", "1"]
    started.clear()
    for group in range(5):
        launcher._start_group(group, {}, [], tmp_path / "version_0", processes=2)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in started] == ["0,1", "2,3", "4,5", "6,7", "0,1"]
    started.clear()  # a job given GPUs 8-15 of a 16-GPU machine: its groups name them as the machine does
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    for group in range(2):
        launcher._start_group(group, {}, [], tmp_path / "version_0", processes=2)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in started] == ["8,9", "10,11"]


def test_replica_groups_on_gpus_average_over_nccl_within_the_strategys_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's setup on its GPU: torchft's NCCL process group (which needs torch built with NCCL, so recorded
    here), its non-blocking waits bounded by the same timeout, handed to the manager."""
    import torchft.manager
    import torchft.process_group
    from lightning.pytorch.strategies import ModelParallelStrategy

    from app.strategies.fault_tolerance import strategy as strategy_module

    made: dict[str, Any] = {}

    class RecordedNcclGroup:
        def __init__(self, timeout: timedelta) -> None:
            made["timeout"] = timeout

    class RecordedManager:
        def __init__(self, **options: Any) -> None:
            made["manager"] = options

        def load_state_dict(self, state: dict[str, int]) -> None:
            made["restored"] = state

    monkeypatch.setattr(torchft.process_group, "ProcessGroupNCCL", RecordedNcclGroup)
    monkeypatch.setattr(torchft.manager, "Manager", RecordedManager)
    monkeypatch.setattr(ModelParallelStrategy, "setup", lambda self, trainer: None)
    monkeypatch.setattr(FaultTolerantStrategy, "broadcast", lambda self, obj, src=0: obj)  # a group of one
    monkeypatch.setattr(strategy_module, "check_lighthouse_answers", lambda address, wait: None)
    monkeypatch.setattr(strategy_module, "weights_only_http_transport", lambda timeout: "transport")
    monkeypatch.setattr(strategy_module, "job_store", lambda timeout: None)
    monkeypatch.setenv(REPLICA_GROUP_ENV, "1")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    strategy = FaultTolerantStrategy(timeout=timedelta(seconds=45))
    strategy.accelerator = CUDAAccelerator()
    strategy.parallel_devices = [torch.device("cuda", 0)]
    strategy.committed_steps = SimpleNamespace(restored={"committed_steps": 3})
    strategy.setup(None)
    assert made["timeout"] == timedelta(seconds=45)
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "45.0"
    assert isinstance(made["manager"]["pg"], RecordedNcclGroup)
    assert made["manager"]["replica_id"] == "replica_group_1" and made["restored"] == {"committed_steps": 3}
