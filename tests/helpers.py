"""Test-only callbacks (loaded by the CLI in subprocesses as ``tests.helpers.X``) and what the tests share: run
arguments, runs, and readers and checks of their results.

No ``from __future__ import annotations`` here: DDP checks the comm hook's annotations as real types.
"""


import errno
import hashlib
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.tensor import DTensor

from app.__main__ import main
from app.observability.monitor import RankMonitor
from app.safety import checkpoint_writing
from app.safety.checkpoint_reading import consolidate
from app.safety.launch_environment import torchrun_restart
from app.safety.preemption import preemption_callback
from app.strategies.fault_tolerance.job import JOB_FINISHED, job_store
from tests.processes import REPO_ROOT, run_cohort

CONFIG_DIR = REPO_ROOT / "configs"
QUICKSTART = ["-c", str(CONFIG_DIR / "quickstart.yaml")]
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
ONE_STEP = ["--trainer.max_steps", "1"]  # should a check let a run start, it ends at once
DDP_2 = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
MODEL_PARALLEL = ["-c", str(CONFIG_DIR / "trainer/model_parallel_cpu.yaml")]  # FSDP2 (dp=2, tp=1) on 2 processes
TENSOR_PARALLEL = [*MODEL_PARALLEL, "--trainer.strategy.init_args.data_parallel_size", "1",
                   "--trainer.strategy.init_args.tensor_parallel_size", "2"]  # every layer split over 2 processes
HYBRID_SHARDED = ["-c", str(CONFIG_DIR / "trainer/hsdp_cpu.yaml")]  # HSDP: 2 replicas x 2 shards on 4 processes
PIPELINE = ["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml")]  # 2 stages (1F1B) on 2 processes
GPU_LAYOUTS = {  # the shipped GPU presets on 1 or 2 GPUs
    "1 gpu": ["-c", str(CONFIG_DIR / "trainer/gpu_bf16.yaml")],
    "fsdp-1": ["-c", str(CONFIG_DIR / "trainer/fsdp_gpu_bf16.yaml"), "--trainer.devices", "1"],
    "model_parallel-1": ["-c", str(CONFIG_DIR / "trainer/model_parallel_gpu_bf16.yaml"), "--trainer.devices", "1",
                         "--trainer.strategy.init_args.data_parallel_size", "1"],
    "ddp-2": ["-c", str(CONFIG_DIR / "trainer/ddp_gpu_bf16.yaml"), "--trainer.devices", "2"],
    "fsdp-2": ["-c", str(CONFIG_DIR / "trainer/fsdp_gpu_bf16.yaml"), "--trainer.devices", "2"],
    "model_parallel-2": ["-c", str(CONFIG_DIR / "trainer/model_parallel_gpu_bf16.yaml"), "--trainer.devices", "2",
                         "--trainer.strategy.init_args.data_parallel_size", "2"],
    "pipeline-2": ["-c", str(CONFIG_DIR / "trainer/pipeline_gpu_bf16.yaml"), "--trainer.devices", "2",
                   "--trainer.strategy.init_args.data_parallel_size", "1"],
}
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
CLIPPED_STEPS = 6
CLIP = 0.1  # below the debug model's gradient norm in the first CLIPPED_STEPS steps, so clipping bites at every step


def batch_sizes(global_batch_size: int, micro_batch_size: int) -> list[str]:
    """The flags for a global batch of ``global_batch_size`` samples in micro-batches of ``micro_batch_size``."""
    return ["--data.global_batch_size", str(global_batch_size), "--data.micro_batch_size", str(micro_batch_size)]


# Added to debug_run_args: 4 optimizer steps, validated after each on the same 16 windows at any world size, with
# gradient clipping that bites; the schedule does not depend on max_steps, so a run resumed to more steps continues
# the same schedule. Runs of it are compared across strategies, devices, world sizes and resumes.
COMPARABLE_RUN = ["--model.optimizer.lr_decay_steps", "8", *batch_sizes(8, 4), "--data.val_samples", "16",
                  "--trainer.limit_val_batches", "1.0", "--val_every_n_steps", "1", "--trainer.max_steps", "4",
                  "--trainer.gradient_clip_val", str(CLIP)]

# How far apart (relative) the val/loss of one checkpoint may be in two layouts that validate the same samples with the
# same masks: float32 (unit roundoff u = 2**-24, 6e-8) rounds each token's loss and every sum on the way to val/loss,
# and another layout adds the same terms in other micro-batches and across ranks, in another order. The tests' sums of
# a few thousand positive terms, torch's cascade (pairwise) sum within a micro-batch (error under log2(n) u, some
# 12u), then one by one over at most ten micro-batches and a few ranks, are each off by under about 30u = 2e-6, so two
# runs differ by under 4e-6; logits computed in micro-batches of another composition may round differently too. 1e-5
# covers both, and lies far below the 1 % that validating other samples, or with other masks, makes.
SAME_VALIDATION_LOSS = 1e-5


def free_port() -> int:
    """A TCP port nothing on this machine listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_folders(cwd: Path) -> list[Path]:
    """What ``cohort`` run in ``cwd`` has written under its default log folder: lightning_logs and all below it."""
    logs = cwd / "lightning_logs"
    return [logs, *sorted(logs.rglob("*"))] if logs.exists() else []


def assert_one_line_error(args: list[str], cwd: Path, expected: str, timeout: float = 120) -> None:
    """``cohort ARGS`` run as a user would, in ``cwd``: it fails with ``expected`` in one ``cohort: error:`` line at
    the end of stderr, shows no traceback, and leaves the run folders as they were."""
    before = run_folders(cwd)
    result = run_cohort(args, cwd=cwd, timeout=timeout)
    assert result.returncode != 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("cohort: error: ") and expected in last_line, result.stderr[-3000:]
    assert run_folders(cwd) == before, "a failed start must not create or change a run"


@contextmanager
def process_state_kept() -> Iterator[None]:
    """Puts back what a ``cohort`` command run inside this process changes of it: environment variables (Lightning's
    seed_everything sets PL_GLOBAL_SEED and PL_SEED_WORKERS), signal handlers and the signal wakeup fd (a run that
    reaches training installs its preemption handlers), so that the tests after it find the process as it was."""
    environ = dict(os.environ)
    handlers = {signum: signal.getsignal(signum) for signum in signal.valid_signals()}
    wakeup_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup_fd)
    try:
        yield
    finally:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update({name: value for name, value in environ.items() if os.environ.get(name) != value})
        for signum, handler in handlers.items():
            if handler is not None and signal.getsignal(signum) != handler:  # None: installed outside Python
                signal.signal(signum, handler)
        signal.set_wakeup_fd(wakeup_fd)


def run_in_process(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``cohort ARGS`` in this process (faster than a subprocess by the interpreter's and torch's start-up)."""
    monkeypatch.setattr(sys, "argv", ["cohort"])  # ARGS are the whole command line
    with process_state_kept():
        main(args)


def one_line_error(args: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """``cohort ARGS`` in this process, which must stop with one ``cohort: error:`` line; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(args, monkeypatch)
    message = str(exit_info.value.code)
    assert message.startswith("cohort: error: ") and "\n" not in message, message
    return message


def assert_one_line_error_in_process(args: list[str], cwd: Path, expected: str,
                                     monkeypatch: pytest.MonkeyPatch) -> str:
    """As assert_one_line_error, in this process: ``cohort ARGS`` run in ``cwd`` stops with one line naming
    ``expected`` and leaves the run folders as they were; returns the line."""
    monkeypatch.chdir(cwd)
    before = run_folders(cwd)
    message = one_line_error(args, monkeypatch)
    assert expected in message, message
    assert run_folders(cwd) == before, "a failed start must not create or change a run"
    return message


def fit(run_dir: Path, args: list[str], *extra: str) -> Path:
    """``cohort fit`` in ``run_dir`` (made if new); returns it (its lightning_logs holds the run)."""
    run_dir.mkdir(exist_ok=True)
    result = run_cohort(["fit", *args, *QUIET, *extra], cwd=run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return run_dir


def fit_in_process(run_dir: Path, args: list[str], *extra: str) -> Path:
    """``fit`` for a run of one process, in this process: the same command, without a new interpreter's and torch's
    start-up (most of a short run's time). Only where the run itself is what is compared or checked, not its
    process (signals, exit codes); several processes would start a process group here."""
    run_dir.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(run_dir)
        run_in_process(["fit", *args, *QUIET, *extra], monkeypatch)
    return run_dir


def cached_fits(tmp_path_factory: pytest.TempPathFactory, args_of: Callable[[str, str], list[str]],
                in_process: Callable[[str, str], bool] = lambda precision, layout: False) -> Callable[[str, str], Path]:
    """(precision, layout) -> the folder of a finished ``cohort fit`` with ``args_of(precision, layout)``, run the
    first time it is asked for (in this process where ``in_process`` says so), so that the tests of a module share
    their runs."""
    runs: dict[tuple[str, str], Path] = {}

    def get(precision: str, layout: str) -> Path:
        if (precision, layout) not in runs:
            run_dir = tmp_path_factory.mktemp(f"{precision}-{layout}".replace(" ", "_"))
            runner = fit_in_process if in_process(precision, layout) else fit
            runs[precision, layout] = runner(run_dir, args_of(precision, layout))
        return runs[precision, layout]

    return get


def fit_killed_mid_accumulation(run_dir: Path, args: list[str]) -> None:
    """``cohort fit`` in a new ``run_dir``, SIGKILLed (every rank) at micro-batch 1 of optimizer step 4."""
    run_dir.mkdir()
    killed = run_cohort(["fit", *args, *QUIET, "--trainer.callbacks+=tests.helpers.KillAtStep",
                         "--trainer.callbacks.step=4", "--trainer.callbacks.micro_batch=1"], cwd=run_dir)
    assert killed.returncode == -9, killed.stderr[-3000:]


def shrunk(byte_corpus: Path, steps: int) -> list[str]:
    """Any recipe made small: the debug model on the test corpus, logging every step, validated once at the end on 32
    samples."""
    return ["--model.model_name", "debug", "--data.sequence_length", "64", "--data.vocab_size", "256",
            "--data.data_dir", str(byte_corpus), "--data.num_workers", "0", "--model.optimizer.warmup_steps", "2",
            "--model.max_new_tokens", "5", "--trainer.max_steps", str(steps), "--val_every_n_steps", str(steps),
            "--data.val_samples", "32", "--trainer.log_every_n_steps", "1"]


def clipped_run(byte_corpus: Path, *preset: str) -> list[str]:
    """The quickstart recipe with a trainer preset after it, shrunk to CLIPPED_STEPS steps with clipping at CLIP."""
    return [*QUICKSTART, *preset, *shrunk(byte_corpus, CLIPPED_STEPS), "--trainer.gradient_clip_val", str(CLIP)]


def assert_sharded_resume_after_sigkill_is_bitwise_exact(tmp_path: Path, run: list[str]) -> None:
    """``run`` (6 steps, a sharded checkpoint every 3) straight, and SIGKILLed mid-step 4 then resumed with
    ``--ckpt_path last``: bitwise the same final weights."""
    straight = fit(tmp_path / "straight", run)
    interrupted = tmp_path / "interrupted"
    fit_killed_mid_accumulation(interrupted, run)
    assert torch.load(last_checkpoint(interrupted) / "meta.pt", weights_only=False)["global_step"] == 3
    fit(interrupted, run, "--ckpt_path", "last")
    assert_weights_equal(last_checkpoint_weights(straight), last_checkpoint_weights(interrupted))


def validate(run_dir: Path, args: list[str], *extra: str) -> float:
    """``cohort validate`` in ``run_dir``; returns the validation loss it printed."""
    result = run_cohort(["validate", *args, *QUIET, *extra], cwd=run_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    printed = re.search(r"val/loss\W+([0-9.]+)", result.stdout)
    assert printed, result.stdout[-3000:]
    return float(printed.group(1))


def scalars(run_dir: Path, tag: str, version: int = 0) -> list[float]:
    """The values a run logged to TensorBoard under ``tag``, in order."""
    events = EventAccumulator(str(run_dir / "lightning_logs" / f"version_{version}"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def last_checkpoint(run_dir: Path, version: int = 0) -> Path:
    return run_dir / "lightning_logs" / f"version_{version}" / "checkpoints" / "last.ckpt"


def last_checkpoint_contents(run_dir: Path, version: int = 0) -> dict[str, Any]:
    """A run's final checkpoint as one dict (weights, hyperparameters, global_step), also from a sharded checkpoint
    folder (consolidated first)."""
    return checkpoint_contents(last_checkpoint(run_dir, version))


def checkpoint_contents(path: Path) -> dict[str, Any]:
    """A checkpoint as one dict, also a sharded checkpoint folder (consolidated first into NAME.consolidated.ckpt
    beside it, which later calls read)."""
    if path.is_dir():
        consolidated = path.with_name(f"{path.stem}.consolidated.ckpt")
        if not consolidated.exists():
            consolidate(path, consolidated)
        path = consolidated
    return torch.load(path, map_location="cpu", weights_only=False)


def last_checkpoint_weights(run_dir: Path, version: int = 0) -> dict[str, torch.Tensor]:
    """The final weights of a run, also from a sharded checkpoint folder (consolidated first)."""
    return last_checkpoint_contents(run_dir, version)["state_dict"]


def adam_step_bound(betas: tuple[float, float], step: int) -> float:
    """The largest |m̂/√v̂| that AdamW's step ``step`` (1-based) can take, whatever the gradients were. With
    a_i = (1-β1)·β1^(t-i) and b_i = (1-β2)·β2^(t-i), Cauchy-Schwarz gives |m_t| = |Σ a_i g_i| <= sqrt(Σ a_i²/b_i) ·
    sqrt(Σ b_i g_i²) = sqrt(Σ a_i²/b_i) · √v_t; the bias corrections divide m by 1-β1^t and v by 1-β2^t."""
    beta1, beta2 = betas
    ratio = sum(((1 - beta1) * beta1**k) ** 2 / ((1 - beta2) * beta2**k) for k in range(step))
    return math.sqrt(ratio) * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def adam_weight_drift(checkpoint: dict[str, Any]) -> float:
    """The most one weight can differ between two runs that took the same AdamW steps on gradients that differ only
    by the order in which sums were taken (other world sizes, shardings, reductions). Most elements agree to float32
    rounding, but one whose true gradient is about zero gets rounding noise as its gradient, whose sign the order
    decides, and Adam normalises it into a full step: per step the two runs can move it by up to
    2 x lr x adam_step_bound in opposite directions, and weight decay only shrinks a difference. Bounded with the
    peak learning rate over every step the checkpoint has taken."""
    optimizer = checkpoint["hyper_parameters"]["optimizer"]
    peak = optimizer["learning_rate"]
    if optimizer["reference_batch_size"]:
        peak *= checkpoint["datamodule_hyper_parameters"]["global_batch_size"] / optimizer["reference_batch_size"]
    betas = tuple(optimizer["betas"])
    return sum(2 * peak * adam_step_bound(betas, step) for step in range(1, checkpoint["global_step"] + 1))


def assert_weights_agree(one: Path, other: Path) -> None:
    """Two runs' final weights hold the same names and agree within ``adam_weight_drift`` element by element: what
    the arithmetic allows when only the order of sums differs. (The runs' per-step losses and gradient norms are
    the tight checks: they add up every parameter, so a few flipped near-zero elements cannot move them.)"""
    assert_checkpoint_weights_agree(last_checkpoint_contents(one), last_checkpoint_contents(other))


def assert_checkpoint_weights_agree(a: dict[str, Any], b: dict[str, Any]) -> None:
    """assert_weights_agree for two checkpoints' contents."""
    assert a["global_step"] == b["global_step"]
    drift = adam_weight_drift(a)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, tensor in a["state_dict"].items():
        torch.testing.assert_close(tensor, b["state_dict"][name], rtol=0, atol=drift, msg=name)


def assert_restored_exactly(written: dict[str, Any], restored: dict[str, Any]) -> None:
    """A checkpoint a run wrote and one of the state another run restored from it (SaveRestoredCheckpoint): the same
    step and learning-rate schedule, bitwise the same weights and optimizer state of every parameter, by name, and
    the same parameters and hyperparameters in each of the optimizer's groups."""
    assert restored["global_step"] == written["global_step"]
    assert restored["lr_schedulers"] == written["lr_schedulers"]
    assert_weights_equal(written["state_dict"], restored["state_dict"])
    for saved, loaded in zip(written["optimizer_states"], restored["optimizer_states"], strict=True):
        assert saved["state"].keys() == loaded["state"].keys()
        for name, moments in saved["state"].items():
            assert_weights_equal(moments, loaded["state"][name])
        assert list(map(comparable_group, saved["param_groups"])) == list(map(comparable_group, loaded["param_groups"]))


def comparable_group(group: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's param group as checkpoints of any layout hold it alike: its parameters as a set (a pipeline lists
    them stage by stage) and its tuples (Adam's betas) as lists, as torch.distributed.checkpoint stores them."""
    return {key: set(value) if key == "params" else list(value) if isinstance(value, tuple) else value
            for key, value in group.items()}


def assert_weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"not bitwise equal: {different}"


def assert_trains_with_clipping_that_bites(run_dir: Path) -> tuple[list[float], list[float]]:
    """A clipped_run's run: a finite loss and gradient norm at every step, every norm above CLIP (so it was
    clipped), and a loss that fell; returns (losses, norms)."""
    losses, norms = scalars(run_dir, "train/loss"), scalars(run_dir, "train/grad_norm")
    assert len(losses) == len(norms) == CLIPPED_STEPS
    assert all(torch.isfinite(torch.tensor(losses + norms)))
    assert min(norms) > CLIP, norms
    assert losses[-1] < losses[0] - 0.3, losses
    return losses, norms


def assert_trains_as_one_does(one: Path, other: Path, precision: str) -> None:
    """Runs of the same global batch in another layout (more processes, or sharded) train as one process does: the
    global gradient norm of every step (which depends on every earlier update) agrees, so gradients are averaged
    over ranks and clipped by the global norm; in float32 the final weights agree too. (Validation is not compared:
    limit_val_batches counts batches per rank.)"""
    # seen on CPU: at most 3e-7 in float32; 5e-3 (one bfloat16 rounding step) under bf16
    tolerance = 1e-5 if precision == "32-true" else 2e-2
    assert scalars(other, "train/grad_norm") == pytest.approx(scalars(one, "train/grad_norm"), rel=tolerance)
    if precision == "32-true":
        assert_weights_agree(one, other)


def assert_comparable_runs_agree(one: Path, other: Path) -> None:
    """Two float32 runs of COMPARABLE_RUN in other layouts: the same validation loss after every step (it reads the
    same windows at any world size), the same gradient norm at every step (clipped: the norm is global) and the same
    final weights, up to the order in which sums were taken. The per-step values add up every parameter, so they
    agree to float32 rounding (1e-6 seen); 1e-4 leaves room for its growth over the steps."""
    assert scalars(other, "val/loss") == pytest.approx(scalars(one, "val/loss"), rel=1e-4)
    assert scalars(other, "train/grad_norm") == pytest.approx(scalars(one, "train/grad_norm"), rel=1e-4)
    assert_weights_agree(one, other)


def poison_gradient(rank: int, step: int) -> list[str]:
    """The flags that add PoisonGradientAtStep (a NaN in ``rank``'s gradients at ``step``, 1-based) to a run."""
    return ["--trainer.callbacks+=tests.helpers.PoisonGradientAtStep", f"--trainer.callbacks.rank={rank}",
            f"--trainer.callbacks.step={step}"]


def record_weight_digests(out_dir: Path) -> list[str]:
    """The flags that add RecordWeightDigests (writing into ``out_dir``) to a run."""
    return ["--trainer.callbacks+=tests.helpers.RecordWeightDigests", f"--trainer.callbacks.out_dir={out_dir}"]


def weight_digests_per_rank(run_dir: Path, world_size: int = 2) -> list[dict[int, str]]:
    """What RecordWeightDigests wrote in ``run_dir``: per rank, {step: digest of its weights after that step}."""
    return [{int(step): digest for step, digest in json.loads((run_dir / f"digests_rank{rank}.json").read_text()).items()}
            for rank in range(world_size)]


def weight_digests(run_dir: Path, world_size: int = 2) -> dict[int, str]:
    """Weight digests by step, the same on every rank (else the replicas diverged)."""
    per_rank = weight_digests_per_rank(run_dir, world_size)
    assert all(digests == per_rank[0] for digests in per_rank), "the ranks' weights differ"
    return per_rank[0]


def assert_only_step_skipped(digests: dict[int, str], skipped: int, steps: int) -> None:
    """Of optimizer steps 1 to ``steps`` (1-based), only ``skipped`` left the weights as they were."""
    assert digests[skipped] == digests[skipped - 1]  # that step changed nothing
    assert all(digests[step] != digests[step - 1] for step in range(1, steps + 1) if step != skipped)


class SignalAtStep(Callback):
    """Sends a signal to rank 0's own process at a micro-batch inside an accumulation window, as a scheduler would."""

    def __init__(self, signal_name: str, step: int, micro_batch: int) -> None:
        self.signum = signal.Signals[signal_name]
        self.step = step
        self.micro_batch = micro_batch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        at_micro_batch = batch_idx % trainer.accumulate_grad_batches == self.micro_batch
        if trainer.is_global_zero and trainer.global_step == self.step and at_micro_batch:
            self.send()

    def send(self) -> None:
        os.kill(os.getpid(), self.signum)


class KillAtStep(SignalAtStep):
    """SIGKILL the whole process group (every rank) at a micro-batch inside an accumulation window."""

    def __init__(self, step: int, micro_batch: int) -> None:
        super().__init__("SIGKILL", step, micro_batch)

    def send(self) -> None:
        os.killpg(os.getpgid(0), self.signum)


class CtrlCAtStep(SignalAtStep):
    """Ctrl-C at the terminal, ``times`` in a row: SIGINT to its foreground process group, where the run's processes
    are, or under torchrun (whose workers have sessions of their own) torchrun's agent. More than once only on one
    process: the sender takes each SIGINT before its kill returns, but another process that has not yet taken the
    first would take the two as one."""

    def __init__(self, step: int, micro_batch: int, times: int = 1) -> None:
        super().__init__("SIGINT", step, micro_batch)
        self.times = times

    def send(self) -> None:
        terminal = os.getpgid(os.getppid()) if "TORCHELASTIC_RUN_ID" in os.environ else os.getpgid(0)
        for _ in range(self.times):
            os.killpg(terminal, self.signum)


class GradientAllReduceCounter(Callback):
    """Records, per rank, the training micro-batches whose backward all-reduced gradients (Cohort's DDP comm hook)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.batch_idx = -1
        self.reducing_batches: set[int] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from app.strategies.gradient_compression import registered_compression

        def count(bucket: torch.distributed.GradBucket) -> None:
            self.reducing_batches.add(self.batch_idx)

        registered_compression(trainer).bucket_listeners.append(count)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        summary = {"accumulation": trainer.accumulate_grad_batches, "batches": self.batch_idx + 1,
                   "reducing_batches": sorted(self.reducing_batches)}
        (self.out_dir / f"allreduce_rank{trainer.global_rank}.json").write_text(json.dumps(summary))


class AllReduceLog(Callback):
    """Records, per rank, every ``torch.distributed.all_reduce`` during training as [batch index, elements]: the
    gradient buckets of Cohort's DDP comm hook, local updates' syncs (torch's model averaging), and the small ones
    (the bad-step verdict, checkpoint agreement)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.batch_idx = -1
        self.calls: list[list[int]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.all_reduce = torch.distributed.all_reduce

        def logged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append([self.batch_idx, tensor.numel()])
            return self.all_reduce(tensor, *args, **kwargs)

        torch.distributed.all_reduce = logged  # torch's hooks and averagers call it as dist.all_reduce

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.distributed.all_reduce = self.all_reduce
        (self.out_dir / f"allreduce_log_rank{trainer.global_rank}.json").write_text(json.dumps(self.calls))



class RecordRouterInputs(Callback):
    """Records, per rank, what each MoE layer's router saw in every training forward, in order: (layer, its input
    (B, T, C), the router's weight then), for the tests to count the routers' choices by hand."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.records: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from models.routed_experts import moe_layers

        for index, layer in enumerate(moe_layers(pl_module)):
            def record(module: torch.nn.Module, inputs: tuple[torch.Tensor], index: int = index) -> None:
                if module.training:  # not validation's
                    self.records.append((index, inputs[0].detach().clone(), module.router.weight.detach().clone()))

            layer.register_forward_pre_hook(record)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(self.records, self.out_dir / f"router_inputs_rank{trainer.global_rank}.pt")

def local_and_whole(tensors: list[torch.Tensor]) -> list[int]:
    """[bytes this rank holds of ``tensors`` (a DTensor's local shard), bytes of their whole]."""
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in tensors]
    return [sum(part.numel() * part.element_size() for part in local),
            sum(tensor.numel() * tensor.element_size() for tensor in tensors)]


class ShardingRecord(Callback):
    """Records, per rank, into ``out_dir``/sharding_rank{R}.json: each training micro-batch's gradient and weight
    collectives on the dimensions of FSDP2's mesh (app/tools/comm.py CollectiveCounter) as [batch index, operation,
    dimension, bytes], and the bytes of the parameters, gradients (at the last optimizer step) and optimizer state
    this rank holds (its local shards) and those of the whole of each (what DDP holds on every rank)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.counted: list[list[Any]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from app.tools.comm import CollectiveCounter

        mesh = next(pl_module.parameters()).device_mesh  # FSDP2's: (data_parallel) or under HSDP 2-D
        self.counter = CollectiveCounter({mesh.get_group(name): name for name in mesh.mesh_dim_names}).__enter__()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.counter.calls.clear()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.counted += [[batch_idx, call.operation, call.group, call.bytes] for call in self.counter.calls
                         if call.group != "other"]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.gradients = local_and_whole([param.grad for param in pl_module.parameters() if param.grad is not None])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.counter.__exit__()
        moments = [value for state in trainer.optimizers[0].state.values() for value in state.values()
                   if isinstance(value, torch.Tensor) and value.dim() > 0]  # Adam's moments, not its step counts
        summary = {"collectives": self.counted, "accumulation": trainer.accumulate_grad_batches,
                   "parameters": local_and_whole(list(pl_module.parameters())), "gradients": self.gradients,
                   "optimizer_state": local_and_whole(moments)}
        (self.out_dir / f"sharding_rank{trainer.global_rank}.json").write_text(json.dumps(summary))


class RoutingRecord(Callback):
    """Records what the MoE layers' routers chose, into ``out_dir``/routing.json (rank 0): each optimizer step's
    token choices per expert of each layer, summed over the step's micro-batches and the ranks (a choice routed
    elsewhere moves two counts), and the smallest gap seen in training, over every token of every layer, between a
    token's k-th and (k+1)-th router probability (how far the rounding of another layout would have to move them)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.smallest = math.inf
        self.counts: dict[int, torch.Tensor] = {}  # global step -> (layers, experts)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from models.routed_experts import moe_layers

        self.layers = moe_layers(pl_module.model)
        for layer in self.layers:
            layer.register_forward_hook(self.record)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.step = trainer.global_step

    @torch.no_grad()
    def record(self, layer: torch.nn.Module, args: tuple[torch.Tensor], _: torch.Tensor) -> None:
        if not layer.training:
            return
        weight = layer.router.weight
        weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
        probabilities = (args[0].float() @ weight.float().T).softmax(dim=-1).sort(dim=-1, descending=True).values
        gap = probabilities[..., layer.top_k - 1] - probabilities[..., layer.top_k]
        self.smallest = min(self.smallest, gap.min().item())
        counts = self.counts.setdefault(self.step, torch.zeros(len(self.layers), len(layer.tokens_per_expert),
                                                               dtype=torch.long))
        counts[self.layers.index(layer)] += layer.tokens_per_expert.cpu()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counts = torch.stack([self.counts[step] for step in sorted(self.counts)])
        counts = trainer.strategy.reduce(counts, reduce_op="sum")
        smallest = trainer.strategy.reduce(torch.tensor(self.smallest), reduce_op="min")
        if trainer.global_rank == 0:
            (self.out_dir / "routing.json").write_text(json.dumps({"counts": counts.tolist(),
                                                                   "smallest_gap": smallest.item()}))


class LagBehindWorker(Callback):
    """Parameter-server workers that count their pushes the server answered with weights (applied, or dropped as
    too stale), each into ``out_dir``/answered_rank{R}.json; worker ``rank`` also lags worker ``other`` by an exact
    number of updates, whatever the machine's speed: before each push it waits until ``other`` has had ``behind``
    more pushes answered than when its own step began (or has finished). ``other`` sends at most one push before its
    count moves on, so ``behind - 1`` of those were sent, and applied, after this worker's weights came: each of
    this worker's gradients arrives at least ``behind - 1`` updates stale."""

    def __init__(self, out_dir: str, rank: int, other: int, behind: int) -> None:
        self.out_dir = Path(out_dir)
        self.rank, self.other, self.behind = rank, other, behind
        self.answered = 0
        self.batch_idx = 0
        self.other_at_step_start = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer, finished=False)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch_idx = batch_idx
        if trainer.global_rank == self.rank and batch_idx % trainer.accumulate_grad_batches == 0:
            self.other_at_step_start = self.read_other()[0]

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        last_micro_batch = (self.batch_idx + 1) % trainer.accumulate_grad_batches == 0  # its push follows
        if trainer.global_rank != self.rank or not last_micro_batch:
            return
        deadline = time.monotonic() + 120  # a wait that never ends fails the run instead of hanging the suite
        while True:
            answered, finished = self.read_other()
            if finished or answered >= self.other_at_step_start + self.behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.other} made no progress while worker {self.rank} waited for it")
            time.sleep(0.005)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and not trainer.should_stop:  # stop: not answered
            self.answered += 1
            self.write(trainer, finished=False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer, finished=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.write(trainer, finished=True)

    def write(self, trainer: L.Trainer, finished: bool) -> None:
        if trainer.global_rank == 0:  # the server pushes nothing
            return
        path = self.out_dir / f"answered_rank{trainer.global_rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps({"answered": self.answered, "finished": finished}))
        path.with_suffix(".tmp").replace(path)  # whole or not at all: the other worker reads it meanwhile

    def read_other(self) -> tuple[int, bool]:
        path = self.out_dir / f"answered_rank{self.other}.json"
        if not path.exists():  # not started yet
            return 0, False
        seen = json.loads(path.read_text())
        return seen["answered"], seen["finished"]


def answered_pushes(run_dir: Path, worker: int) -> int:
    """How many of ``worker``'s pushes the server answered with weights, as LagBehindWorker counted them."""
    return json.loads((run_dir / f"answered_rank{worker}.json").read_text())["answered"]


class ScriptedStepTimes(Callback):
    """The monitor's clock (RankMonitor.clock) made a script, so that a test decides from timings it gives, which a
    busy machine cannot move: on rank R each micro-batch computes ``compute_seconds[R]``, and in the optimizer step's
    gradient all-reduce every rank waits until the slowest has computed all of its micro-batches, as under DDP. Time
    moves only here. The CLI puts the monitor after the configured callbacks, so these hooks run before the monitor's:
    the compute falls between the micro-batch's start and its end, the wait between the last gradient bucket and
    the end of backward, where the monitor times sync wait."""

    def __init__(self, compute_seconds: list[float]) -> None:
        self.compute_seconds = compute_seconds
        self.now = 0.0
        self.batch_idx = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for callback in trainer.callbacks:
            if isinstance(callback, RankMonitor):
                callback.clock = lambda: self.now

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.now += self.compute_seconds[trainer.global_rank]

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        accumulation = trainer.accumulate_grad_batches
        if (self.batch_idx + 1) % accumulation == 0:  # this backward all-reduced the gradients
            lag = max(self.compute_seconds) - self.compute_seconds[trainer.global_rank]
            self.now += lag * accumulation


class ScriptedExchangeTimes(ScriptedStepTimes):
    """ScriptedStepTimes under expert parallelism: besides its compute, each token exchange (all-to-all) of rank R's
    training forwards takes ``exchange_seconds[R]`` on the monitor's clock. The monitor hands the exchanges its
    time points (models/parallel/expert_parallel.py ExpertParallel.mark), start and end in turn; this wraps them, so
    that time moves at each end."""

    def __init__(self, compute_seconds: list[float], exchange_seconds: list[float]) -> None:
        super().__init__(compute_seconds)
        self.exchange_seconds = exchange_seconds
        self.marks = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        from models.parallel.expert_parallel import expert_parallel_of

        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.rank = trainer.global_rank
        state = expert_parallel_of(pl_module.model)
        if state.mark != self.scripted_mark:  # the monitor's own, set at train start and after each validation
            self.monitor_mark, state.mark = state.mark, self.scripted_mark

    def scripted_mark(self) -> Any:
        self.marks += 1
        if self.marks % 2 == 0:  # an exchange's end
            self.now += self.exchange_seconds[self.rank]
        return self.monitor_mark()


class SignalAllThenHang(Callback):
    """One rank sends a signal to every rank (its process group), as Kubernetes does, then hangs inside its step, as
    a rank stuck on a broken device would: the others wait for it in the step's gradient all-reduce."""

    def __init__(self, signal_name: str, rank: int, step: int) -> None:
        self.signum = signal.Signals[signal_name]
        self.rank = rank
        self.step = step

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.killpg(os.getpgid(0), self.signum)
            time.sleep(600)


class PerturbWeights(Callback):
    """Nudges one rank's weights once, as a bit flip or a bad update would, so replicas diverge."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank = rank
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            param = next(pl_module.parameters())
            with torch.no_grad():  # this rank's copy (its shard, if sharded), no collective
                (param.to_local() if isinstance(param, DTensor) else param).view(-1)[0] += 1e-3


class PoisonWeightsBeforeCheckpoint(Callback):
    """Puts a NaN into one rank's weights at the end of an optimizer step, before that step's checkpoint is written:
    a test-only stand-in for an update that diverged on one rank."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank = rank
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end_of_step = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if trainer.global_rank == self.rank and trainer.global_step == self.step and end_of_step:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


class KillRank(Callback):
    """SIGKILL one rank's own process at a step, as a crashed GPU or an OOM-killed process would die; only in the
    first attempt of a torchrun or SLURM job, so that the attempts restarted or requeued after it run through."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank = rank
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        first_attempt = all(os.environ.get(count, "0") == "0" for count in ("TORCHELASTIC_RESTART_COUNT",
                                                                            "SLURM_RESTART_COUNT"))
        if trainer.global_rank == self.rank and trainer.global_step == self.step and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


class StopRank(Callback):
    """SIGSTOP one rank's own process at a step, as a rank that hangs (a deadlock, a stuck GPU, a frozen node)."""

    def __init__(self, rank: int, step: int, collective_timeout: float | None = None) -> None:
        self.rank = rank
        self.step = step
        self.collective_timeout = collective_timeout

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """With ``collective_timeout`` (seconds), every rank's collectives from here on time out after it, while the
        start-up rendezvous, which a busy machine may take long for, had the strategy's longer timeout: a test waits
        for the hang to be noticed only that long."""
        if self.collective_timeout is not None and torch.distributed.is_initialized():
            torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=self.collective_timeout))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGSTOP)


class KillReplicaGroup(KillRank):
    """KillRank for one fault-tolerant replica group: its process ``rank`` dies at ``step`` in its first attempt."""

    def __init__(self, group: int, step: int, rank: int = 0) -> None:
        super().__init__(rank, step)
        self.group = group

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if os.environ.get("COHORT_REPLICA_GROUP") == str(self.group):
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


class RejoinMidRun(Callback):
    """Brings a killed replica group back mid-run whatever the machine's speed, where a sleep per step had to outlast
    a restart: its restarted processes wait until the other groups have trained a step without it, and they wait at
    ``step`` until the restarted group has asked the lighthouse for its first quorum, so that their next quorum holds
    it (a quorum the same groups as the last one ask for, the lighthouse gives at once, without the groups that are
    up but have not asked yet). The restarted group writes into a file in ``folder`` how many quorum requests of its
    group the job's lighthouse log held before it asked; the others wait for one more."""

    def __init__(self, folder: str, group: int, step: int) -> None:
        self.went_on = Path(folder) / f"went_on_without_group_{group}"
        self.restarted = Path(folder) / f"group_{group}_restarted"
        self.group = group
        self.step = step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if os.environ.get("COHORT_REPLICA_GROUP") == str(self.group) and torchrun_restart() > 0:
            wait_until(self.went_on.exists, f"{self.went_on.name} in {self.went_on.parent}")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if os.environ.get("COHORT_REPLICA_GROUP") == str(self.group) and torchrun_restart() > 0:
            requests = self.quorum_requests(trainer)
            if trainer.global_rank == 0:  # before the group's first quorum, which its rank 0 asks the lighthouse for
                self.restarted.write_text(str(requests))

    def quorum_requests(self, trainer: L.Trainer) -> int:
        """The quorum requests of this group's replica group in the job's lighthouse log (the job folder's)."""
        log = Path(trainer.logger.log_dir).parent / "lighthouse.log"  # trainer.log_dir would be a collective
        return log.read_text().count(f"Received quorum request for replica replica_group_{self.group}:")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if os.environ.get("COHORT_REPLICA_GROUP") == str(self.group):
            return
        if trainer.strategy.manager.num_participants() < trainer.strategy.settings.replica_groups:  # this step's quorum
            self.went_on.touch()
        if trainer.global_step == self.step:
            wait_until(lambda: self.restarted.exists() and self.restarted.read_text() != "", self.restarted.name)
            before = int(self.restarted.read_text())
            wait_until(lambda: self.quorum_requests(trainer) > before, f"replica group {self.group}'s quorum request")


class RestartAfterJobFinished(Callback):
    """Brings a killed replica group back only once another group has marked the job finished in the job store, so
    that it finds itself alone after the end whatever the machine's speed."""

    def __init__(self, group: int) -> None:
        self.group = group

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if os.environ.get("COHORT_REPLICA_GROUP") == str(self.group) and torchrun_restart() > 0:
            store = job_store(timedelta(seconds=30))
            wait_until(lambda: store.check([JOB_FINISHED]), f"{JOB_FINISHED} in the job store")


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Polls ``condition`` until it holds; after 120 s it fails the run instead of hanging the suite."""
    deadline = time.monotonic() + 120
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited 120 s for {what}")
        time.sleep(0.05)


class SignalJobAtStep(Callback):
    """SIGTERM to the ``cohort fit`` that started a fault-tolerant job, from replica group 0 at ``step``, as a
    scheduler stopping the job would: the group's process was started by torchrun's agent, which ``cohort`` started.
    Every group then holds at the next step until the signal has reached it, so that none trains on to the end
    whatever the machine's speed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if os.environ.get("COHORT_REPLICA_GROUP") == "0" and trainer.global_step == self.step:
            agent_status = Path(f"/proc/{os.getppid()}/stat").read_text()
            job = int(agent_status.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
            os.kill(job, signal.SIGTERM)
        if trainer.global_step == self.step + 1:
            preemption = preemption_callback(trainer)
            group = os.environ["COHORT_REPLICA_GROUP"]
            wait_until(lambda: preemption.stop_requested != 0, f"SIGTERM to reach replica group {group}")


class HoldForRequeueSignalAtStep(Callback):
    """Every rank of a SLURM job's first run holds at ``step`` until the requeue signal the test sends (scancel
    --signal) has reached it, so that the signal arrives mid-run whatever the machine's speed; a requeued run does
    not hold."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            preemption = preemption_callback(trainer)
            wait_until(lambda: preemption.requeue_requested != 0, "the requeue signal")


class KillLighthouseAtStep(Callback):
    """SIGKILL the job's torchft lighthouse (the one listening on TORCHFT_LIGHTHOUSE's port) from replica group 0 at
    ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if os.environ.get("COHORT_REPLICA_GROUP") != "0" or trainer.global_step != self.step:
            return
        port = os.environ["TORCHFT_LIGHTHOUSE"].rsplit(":", 1)[1]
        for status in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                words = status.read_bytes().split(b"\0")
            except OSError:  # a process that ended meanwhile
                continue
            if any(word.endswith(b"torchft_lighthouse") for word in words[:2]) and f"[::]:{port}".encode() in words:
                os.kill(int(status.parent.name), signal.SIGKILL)


class RecordWorldSize(Callback):
    """Writes what each rank sees of the job from inside the run: rank, world size, node rank, host."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seen = {"rank": trainer.global_rank, "world_size": trainer.world_size, "node_rank": trainer.node_rank,
                "process_group_size": torch.distributed.get_world_size(), "host": os.uname().nodename}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))


class PoisonGradientAtStep(Callback):
    """Puts a NaN into one rank's gradients after the last backward of an optimizer step (after DDP averaged them,
    so the other ranks' gradients stay finite): a test-only stand-in for a bad batch or a flipped bit."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank = rank
        self.step = step  # 1-based, as logs and messages count steps

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            grad = next(pl_module.parameters()).grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad  # this rank's shard, no collective
            local.view(-1)[0] = float("nan")


class SaveRestoredCheckpoint(Callback):
    """Writes, as training starts (before the first step), a checkpoint of what the run restored from its
    ``--ckpt_path`` to ``path``: in the run's own layout, a file or a sharded folder."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)


class RecordWeightDigests(Callback):
    """Writes, per rank, a digest of its weights (its shards, if sharded) after each optimizer step: {step: sha1 of
    every parameter's bytes}."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.digests: dict[int, str] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.record(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.record(trainer, pl_module)

    def record(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        digest = hashlib.sha1()
        for param in pl_module.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param  # this rank's shard
            digest.update(local.detach().cpu().clone().numpy().tobytes())  # a copy: FSDP2 resizes its storage
        self.digests[trainer.global_step] = digest.hexdigest()
        (self.out_dir / f"digests_rank{trainer.global_rank}.json").write_text(json.dumps(self.digests))


class HoldCheckpointWrites(Callback):
    """Holds each background checkpoint write (checkpoint.async_save) until training has gone ``steps`` optimizer
    steps past the step it saves, or has ended: the weights it was copied from change meanwhile, and a loop that
    waited for the write would never get that far (the run would hang)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.step = 0
        self.moved_on = threading.Condition()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.write_copy = checkpoint_writing.write_copy

        def held(strategy: Any, partial: Path, sharded: bool, checkpoint: dict[str, Any], group: Any) -> int:
            with self.moved_on:
                self.moved_on.wait_for(lambda: self.step >= checkpoint["global_step"] + self.steps)
            return self.write_copy(strategy, partial, sharded, checkpoint, group)

        checkpoint_writing.write_copy = held  # looked up at each save

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.move_to(trainer.global_step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.move_to(math.inf)  # before the checkpoint callback's own on_train_end, which Lightning calls last

    def move_to(self, step: float) -> None:
        with self.moved_on:
            self.step = step
            self.moved_on.notify_all()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        checkpoint_writing.write_copy = self.write_copy  # an in-process run leaves the module as it found it

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.move_to(math.inf)
        self.teardown(trainer, pl_module, "fit")


class FailCheckpointWrite(Callback):
    """The checkpoint of one step fails to write, as on a read-only disk: torch.save raises OSError(EROFS) for it,
    in the background (checkpoint.async_save) or not. Only for a run in this process, which it leaves as it found."""

    def __init__(self, step: int) -> None:
        self.step = step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.save = torch.save

        def failing(checkpoint: Any, path: Any, *args: Any, **kwargs: Any) -> None:
            if isinstance(checkpoint, dict) and checkpoint.get("global_step") == self.step:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            self.save(checkpoint, path, *args, **kwargs)

        torch.save = failing  # both writers call it as torch.save

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        torch.save = self.save

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")
