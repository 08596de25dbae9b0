"""See every rank: step-time split, stragglers, per-rank loss, throughput, MFU and memory.

Each rank measures its own window of ``every_n_steps`` optimizer steps; at the window's end one all_gather of a
small float64 row per rank brings every number to every rank, so every rank reaches the same verdicts and rank 0
logs them. Lightning's loggers only see rank 0, which is why the numbers travel this way.

Step time is split into data wait (the loop blocked on the DataLoader), compute (forward, backward and optimizer,
without the time blocked in DDP's gradient all-reduce), sync wait (that blocked time: from the moment the last
gradient bucket was ready on this rank until backward returned; under local SGD and DiLoCo,
app/strategies/local_updates.py, the sync after the optimizer step every H steps) and other (the rest of the loop). On
GPUs the compute and sync markers are CUDA events, so they measure the device, not the launch queue.

What the monitor concludes from each window (stragglers, a departing loss, slow data): app/observability/verdicts.py.
A mixture of experts' load per expert and dropped tokens, per logged step: app/observability/routing.py.

Under a pipeline each rank also reports its stages' compute inside the schedule and the time it waited there on
the other stages; that wait is idle, not compute. The share of the pipeline's time in which a rank did not compute
is its measured bubble, logged per rank beside the schedule's theoretical one (models/parallel/pipeline.py theoretical_bubble:
(p - 1) / (m + p - 1) for 1F1B, less for the interleaved and zero-bubble schedules).

With experts split over ranks (models/parallel/expert_parallel.py) each rank also reports the time its training
forwards spent in the token exchanges (all-to-all: dispatch and combine, waiting for the other ranks included),
taken out of compute; the exchanges of backward stay in compute.
"""

from __future__ import annotations

import resource
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info

from app.observability.fields import (ALL_TO_ALL, COMPUTE, CUDA_PEAK_ALLOCATED, CUDA_PEAK_RESERVED, DATA_WAIT, FIELDS,
                                      HOST_RSS, LOSS, LOSS_STD, PIPELINE_COMPUTE, PIPELINE_WAIT, STEP, SYNC_WAIT,
                                      logged_fields)
from app.observability.flops import measured_peak_tflops, peak_tflops_per_device
from app.observability.routing import ExpertLoad
from app.observability.tensorboard_layout import log_final_val_loss, write_layout
from app.observability.verdicts import DataWaitWatch, StragglerWatch, loss_departures
from core.errors import check_ranges
from core.run_plan import run_plan_of
from core.sizes import GIB
from models.parallel.expert_parallel import expert_parallel_of
from models.parallel.pipeline import theoretical_bubble


def host_rss_bytes() -> float:
    """Resident memory of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@runtime_checkable
class AnnouncesGradientBuckets(Protocol):
    """A callback whose DDP comm hook calls each listener with every gradient bucket as it goes to all-reduce
    (app/strategies/gradient_compression.py); ``registered`` is False where the user's own hook came first."""

    registered: bool
    bucket_listeners: list[Callable[[dist.GradBucket], None]]


@runtime_checkable
class AnnouncesSyncs(Protocol):
    """A callback that syncs the ranks inside the optimizer step and calls each listener with True as a sync starts
    and False as it ends (local SGD, DiLoCo: app/strategies/local_updates.py)."""

    sync_listeners: list[Callable[[bool], None]]


class Marker:
    """A point in time: a CUDA event on GPUs (read later, without stalling the stream), else the monitor's clock."""

    def __init__(self, cuda: bool, clock: Callable[[], float]) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.time = 0.0 if cuda else clock()
        if self.event is not None:
            self.event.record()

    def seconds_until(self, later: Marker) -> float:
        if self.event is not None and later.event is not None:
            later.event.synchronize()
            return self.event.elapsed_time(later.event) / 1000
        return later.time - self.time


class RankMonitor(Callback):
    def __init__(
        self,
        every_n_steps: int | None = None,
        straggler_factor: float = 1.5,
        straggler_windows: int = 3,
        data_wait_warning_share: float = 0.1,
        loss_alert_sigmas: float = 6.0,
        peak_tflops: float | None = None,
        enabled: bool = True,
    ) -> None:
        """
        Args:
            every_n_steps: optimizer steps per window (one all_gather each); None: trainer.log_every_n_steps.
            straggler_factor: a rank whose compute exceeds the other ranks' median by this factor is slow in that
                window.
            straggler_windows: windows in a row a rank must be slow before it is reported as a straggler.
            data_wait_warning_share: warn when waiting for data exceeds this share of the step time.
            loss_alert_sigmas: warn when a rank's mean loss is this many standard errors from the others'.
            peak_tflops: peak TFLOP/s of one device, for MFU; None: the data sheet's for GPUs
                (app/observability/flops.py), else what a short matmul probe measures at the start (CPUs, other
                GPUs).
            enabled: False leaves the monitor out of the run (the CLI removes it before fit).
        """
        check_ranges("monitor", {
            "every_n_steps": (every_n_steps is None or every_n_steps >= 1, ">= 1, or null"),
            "straggler_factor": (straggler_factor >= 1, "at least 1"),
            "straggler_windows": (straggler_windows >= 1, ">= 1"),
            "data_wait_warning_share": (0 <= data_wait_warning_share <= 1, "between 0 and 1"),
            "loss_alert_sigmas": (loss_alert_sigmas > 0, "above 0"),
            "peak_tflops": (peak_tflops is None or peak_tflops > 0, "above 0, or null"),
        }, locals())
        self.enabled = enabled
        self.every_n_steps = every_n_steps
        self.loss_alert_sigmas = loss_alert_sigmas
        self.peak_tflops = peak_tflops
        self.stragglers = StragglerWatch(straggler_factor, straggler_windows)
        self.data_wait = DataWaitWatch(data_wait_warning_share)
        self.hosts: list[str] = []
        self.summary: list[dict[str, float]] = []  # one entry per window, on every rank
        self._sync_measured = False  # set at train start: sync wait is timed (DDP on 2 ranks or more)
        self._pipeline: Any = None  # set at train start: the module's Pipeline (models/parallel/pipeline.py), if any
        self._expert_parallel: Any = None  # set at train start: its split experts' state, if any
        self._cuda = False  # set at train start: the device is a GPU
        self._fields = logged_fields(self._cuda, pipeline=False)  # set at train start: those this run logs
        self._expert_load: ExpertLoad | None = None  # set at train start: a mixture of experts' routing, if any
        # seconds, for the step time and the markers off GPUs; tests give it timings of their own, which a busy
        # machine cannot move
        self.clock: Callable[[], float] = time.perf_counter

    # ----- setup -----
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        self._pipeline = getattr(pl_module, "pipeline", None)
        if self.every_n_steps is None:
            self.every_n_steps = trainer.log_every_n_steps
        self._cuda = trainer.strategy.root_device.type == "cuda"
        network = getattr(pl_module, "model", None)
        self._expert_parallel = expert_parallel_of(network) if network is not None else None
        if self._expert_parallel is not None:
            self._expert_parallel.mark = self._mark
        self._fields = logged_fields(self._cuda, pipeline=self._pipeline is not None,
                                     expert_parallel=self._expert_parallel is not None)
        self._plan = plan = run_plan_of(pl_module)
        # a "token" is a sample's unit of work: a token of text, or a whole image (sequence_length 1)
        self.flops_per_token = pl_module.flops_per_sample(plan.sequence_length) / plan.sequence_length
        device_name = torch.cuda.get_device_name(trainer.strategy.root_device) if self._cuda else "CPU"
        self.peak, self.peak_source = self.peak_tflops, "monitor.peak_tflops"
        if self.peak is None:
            self.peak = peak_tflops_per_device(device_name, plan.precision.compute_dtype)
            self.peak_source = "data sheet"
        if self.peak is None:  # ranks sharing a machine probe together, so each gets its share, as in training
            self.peak = measured_peak_tflops(trainer.strategy.root_device, plan.precision.compute_dtype)
            self.peak_source = "matmul probe at start"
        self.hosts = [socket.gethostname()] * trainer.world_size
        if dist.is_available() and dist.is_initialized():
            dist.all_gather_object(self.hosts, socket.gethostname())  # once per run
        self._sync_measured = self._register_sync_timer(trainer)
        self._expert_load = ExpertLoad.of(pl_module, plan)
        write_layout(trainer, self._fields, self._expert_load.charts() if self._expert_load else None)
        self._reset_window()

    def _register_sync_timer(self, trainer: L.Trainer) -> bool:
        """Time each backward's last gradient bucket: a listener on the DDP comm hook that
        app/strategies/gradient_compression.py registers, whichever method it runs (plain all-reduce, bf16, fp16 or
        PowerSGD, whose compression counts as sync wait too)."""
        if not isinstance(trainer.strategy, DDPStrategy) or trainer.world_size == 1:
            return False
        hooks = [callback for callback in trainer.callbacks
                 if isinstance(callback, AnnouncesGradientBuckets) and callback.registered]
        if not hooks:  # only one hook per model: the user's own came first
            rank_zero_info("monitor: another DDP comm hook is registered, so sync wait counts as compute")
            return False
        hooks[0].bucket_listeners.append(self._bucket_ready)
        for callback in trainer.callbacks:
            if isinstance(callback, AnnouncesSyncs):
                callback.sync_listeners.append(self._local_sync)
        return True

    def _mark(self) -> Marker:
        return Marker(self._cuda, self.clock)

    def _local_sync(self, starting: bool) -> None:
        if starting:
            self._sync_start = self._mark()
        else:
            self._local_syncs.append((self._sync_start, self._mark()))

    def _bucket_ready(self, bucket: dist.GradBucket) -> None:
        self._last_bucket_ready = self._mark()

    def _reset_window(self) -> None:
        self._compute = self._sync_wait = 0.0  # seconds in this window, summed over its micro-batches
        self._steps = 0
        self._window_start = self.clock()
        self._data_wait_at_start = self._loader_wait()
        self._paused = 0.0  # validation inside the window is not step time
        pipeline = self._pipeline
        self._pipeline_at_start = (pipeline.compute_seconds, pipeline.schedule_seconds) if pipeline else (0.0, 0.0)
        self._losses: list[torch.Tensor] = []
        self._micro_batches: list[tuple[Marker, Marker, Marker | None, Marker | None]] = []
        self._local_syncs: list[tuple[Marker, Marker]] = []  # local updates' syncs, inside the optimizer step
        if self._expert_parallel is not None:
            self._expert_parallel.exchanges.clear()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()

    def _loader_wait(self) -> float:
        """Seconds the loop has spent blocked on the train DataLoader (see ResumableDataLoader)."""
        return getattr(self._trainer.train_dataloader, "wait_seconds", 0.0)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pause_start = self.clock()
        if self._expert_parallel is not None:  # validation's exchanges are not step time
            self._expert_parallel.mark = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # trainer.training is False inside validation, even during fit: the window exists only once fit trains
        if not trainer.sanity_checking and hasattr(self, "_window_start"):
            self._paused += self.clock() - self._pause_start
        if self._expert_parallel is not None:
            self._expert_parallel.mark = self._mark

    # ----- per micro-batch: markers only, nothing that stalls the device -----
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = self._mark()
        self._last_bucket_ready: Marker | None = None
        self._after_backward: Marker | None = None

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._after_backward = self._mark() if self._last_bucket_ready is not None else None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        bucket_ready = self._last_bucket_ready if self._sync_measured else None
        self._micro_batches.append((self._batch_start, self._mark(), bucket_ready,
                                    self._after_backward if bucket_ready is not None else None))
        # Lightning hands back the loss divided by the accumulation steps
        self._losses.append(outputs["loss"].detach() * self._plan.accumulation)
        if self._expert_load is not None:
            self._expert_load.after_micro_batch(trainer, self._plan.ends_optimizer_step(batch_idx))
        if self._plan.ends_optimizer_step(batch_idx):
            self._steps += 1
            if self._steps == self.every_n_steps:
                self._close_window(trainer)

    # ----- per window: one collective, then verdicts -----
    def _close_window(self, trainer: L.Trainer) -> None:
        for start, end, bucket_ready, after_backward in self._micro_batches:
            sync = bucket_ready.seconds_until(after_backward) if bucket_ready and after_backward else 0.0
            self._compute += start.seconds_until(end) - sync
            self._sync_wait += sync
        for start, end in self._local_syncs:
            sync = start.seconds_until(end)
            self._compute -= sync
            self._sync_wait += sync
        all_to_all = 0.0
        if self._expert_parallel is not None:
            all_to_all = sum(start.seconds_until(end) for start, end in self._expert_parallel.exchanges)
            self._compute -= all_to_all
        pipeline_compute = pipeline_wait = 0.0
        if self._pipeline is not None:  # its waits on the other stages happened inside the step: idle, not compute
            pipeline_compute = self._pipeline.compute_seconds - self._pipeline_at_start[0]
            pipeline_wait = self._pipeline.schedule_seconds - self._pipeline_at_start[1] - pipeline_compute
            self._compute -= pipeline_wait
        losses = torch.stack(self._losses).double()
        window_seconds = {
            DATA_WAIT: self._loader_wait() - self._data_wait_at_start, COMPUTE: self._compute,
            SYNC_WAIT: self._sync_wait, STEP: self.clock() - self._window_start - self._paused,
            PIPELINE_COMPUTE: pipeline_compute, PIPELINE_WAIT: pipeline_wait, ALL_TO_ALL: all_to_all,
        }
        measured = {
            **{field: seconds / self._steps for field, seconds in window_seconds.items()},
            LOSS: losses.mean().item(), LOSS_STD: losses.std().item() if len(losses) > 1 else 0.0,
            HOST_RSS: host_rss_bytes() / GIB,
            CUDA_PEAK_ALLOCATED: torch.cuda.max_memory_allocated() / GIB if self._cuda else 0.0,
            CUDA_PEAK_RESERVED: torch.cuda.max_memory_reserved() / GIB if self._cuda else 0.0,
        }
        row = torch.tensor([measured[field] for field in FIELDS], dtype=torch.float64)  # every field, on any device
        table = self._gather(trainer, row)  # (world_size, len(FIELDS))
        window: dict[str, Any] = {field.name: table[:, i].tolist() for i, field in enumerate(FIELDS)}
        window["losses_per_rank"] = len(losses)
        self._report(trainer, window)
        self._reset_window()

    def _gather(self, trainer: L.Trainer, row: torch.Tensor) -> torch.Tensor:
        if not (dist.is_available() and dist.is_initialized()):
            return row.unsqueeze(0)
        row = row.to(trainer.strategy.root_device)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        return torch.stack(rows).cpu()

    def _report(self, trainer: L.Trainer, window: dict[str, Any]) -> None:
        step_seconds = statistics.median(window["step_s"])
        tokens_per_second = self._plan.tokens_per_step / step_seconds
        tflops = self.flops_per_token * tokens_per_second / 1e12
        metrics = {
            "throughput/tokens_per_second": tokens_per_second,
            "throughput/samples_per_second": self._plan.global_batch_size / step_seconds,
            "throughput/tflops": tflops,
            "throughput/tflops_per_device": tflops / trainer.world_size,
        }
        metrics["throughput/mfu"] = tflops / (self.peak * trainer.world_size)
        for field in self._fields:
            values = window[field.name]
            metrics.update({field.tag("min"): min(values), field.tag("median"): statistics.median(values),
                            field.tag("max"): max(values)})
            metrics.update({field.tag(f"rank{rank}"): value for rank, value in enumerate(values)})
        if self._pipeline is not None:
            metrics.update(self._bubble(window))
        metrics.update(self.data_wait.judge(window, getattr(trainer.train_dataloader, "num_workers", 0)))
        metrics.update(self.stragglers.judge(window, self.hosts, self._sync_measured))
        metrics.update(loss_departures(window, self.loss_alert_sigmas))
        self.summary.append(metrics)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def _bubble(self, window: dict[str, Any]) -> dict[str, float]:
        """Each rank's measured pipeline bubble: the share of the pipeline's time (the longest time a rank spent in
        the schedule: the last stage's schedule returns while the first still runs its last backwards) in which
        the rank did not compute."""
        computes = window[PIPELINE_COMPUTE.name]
        span = max(compute + wait for compute, wait in zip(computes, window[PIPELINE_WAIT.name]))
        bubbles = [1 - compute / span if span > 0 else 0.0 for compute in computes]
        metrics = {f"monitor/pipeline_bubble/rank{rank}": bubble for rank, bubble in enumerate(bubbles)}
        metrics["monitor/pipeline_bubble/median"] = statistics.median(bubbles)
        metrics["monitor/pipeline_bubble_theory"] = theoretical_bubble(self._plan)
        return metrics

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_final_val_loss(trainer)
        if not self.summary or not trainer.is_global_zero:
            return
        last = self.summary[-1]

        def mean(tag: str) -> float:
            return statistics.fmean(window[tag] for window in self.summary if tag in window)

        rows = [
            (f"{self._plan.unit}/s (all ranks)", f"{mean('throughput/tokens_per_second'):,.0f}"),
            ("TFLOP/s (all ranks)", f"{mean('throughput/tflops'):.3f}"),
            ("MFU", f"{mean('throughput/mfu'):.1%} of {self.peak:.3g} TFLOP/s per device ({self.peak_source})"),
            ("step time, median rank", f"{mean(STEP.tag('median')):.3f} s"),
        ]
        if self._pipeline is not None:
            rows.append(("pipeline bubble, median rank", f"{mean('monitor/pipeline_bubble/median'):.1%} of the "
                         f"schedule (theory {last['monitor/pipeline_bubble_theory']:.1%})"))
        worst_data_wait = max(window["monitor/data_wait_share/max"] for window in self.summary)
        rows.append(("data wait share, worst rank", f"{worst_data_wait:.1%}"))
        rows += [(field.summary, f"{max(w[field.tag('max')] for w in self.summary):.2f} GiB")
                 for field in self._fields if field.summary]
        rows += [
            ("straggler events", str(self.stragglers.events)),
            ("waiting for the slowest rank", f"{mean('monitor/straggler_cost_share'):.1%} of the step"
             if "monitor/straggler_cost_share" in last else "n/a (sync wait not timed)"),
        ]
        rows += self._expert_load.summary_rows() if self._expert_load else []
        width = max(len(name) for name, _ in rows)
        rank_zero_info("run summary (" + f"{len(self.summary)} windows of {self.every_n_steps} steps)\n"
                       + "\n".join(f"  {name:<{width}}  {value}" for name, value in rows))
