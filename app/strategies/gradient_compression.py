"""Gradient compression for DDP, chosen in the config (``gradient_compression.method``) and registered by Cohort as
DDP's one communication hook, on any device. What each rank hands to all-reduce per optimizer step:

    none      the gradient buckets as they are (float32: 4 bytes a gradient), as DDP without a hook
    bf16/fp16 the buckets cast to 16 bits: half the bytes, each averaged gradient rounded once
    powersgd  per weight matrix (n x m) two rank-r factors P (n x r) and Q (m x r): (n + m) r numbers instead of
              n m; vectors (biases, norms) as they are. Error feedback adds what compression lost to the next
              step's gradient; warm start begins each step's power iteration from the last step's Q
              (Vogels et al., 2019). The first ``powersgd_start_step`` steps all-reduce plainly.

The hooks are torch's (torch.distributed.algorithms.ddp_comm_hooks); Cohort wraps the chosen one to count what it
hands to all-reduce (logged as comm/bytes_per_step: the tensors' sizes, not the wire's bytes, which a ring
all-reduce multiplies by 2(n-1)/n) and to tell listeners when each bucket is ready: the monitor times sync wait
from the last one, whatever the method. Under local SGD and DiLoCo (app/strategies/local_updates.py) the hook
all-reduces nothing: it returns each rank's own gradient, as torch's post-local SGD hook does, and counts the
averaging's bytes in the step that averages.

Lightning's DDPStrategy registers its ``ddp_comm_hook`` argument only when the root device is CUDA
(``DDPStrategy._register_ddp_hooks`` in lightning/pytorch/strategies/ddp.py), so on CPUs (gloo) it silently does
nothing; Cohort registers the hook itself once DDP has wrapped the model.

PowerSGD's state lives only in torch's PowerSGDState object, and is lost with the process (pytorch/pytorch#75666).
Cohort saves it in the checkpoint and restores it on resume: each rank's error-feedback residual (rank 0 gathers
them), the warm-start Q factors, the step counter and the random generator that draws fresh Q factors. It is
stored per parameter name, as tensors and numbers (the checkpoint stays loadable with weights_only=True), because
DDP groups gradients into other buckets in a new process's first step than after it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook

from app.safety.optimizer_state_keys import parameter_names
from app.strategies.kind import ConfiguredStrategy, StrategyKind
from core.errors import UserError, check_ranges
from core.run_plan import RunPlan, run_plan_of

COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")
SIXTEEN_BIT = {"bf16": (torch.bfloat16, default_hooks.bf16_compress_hook),
               "fp16": (torch.float16, default_hooks.fp16_compress_hook)}
BucketListener = Callable[[dist.GradBucket], None]
Layout = list[tuple[str, tuple[int, ...]]]  # a bucket's parameters, in its order: (name, shape)


@dataclass(frozen=True)
class CompressionSettings:
    """The config's ``gradient_compression`` group: GradientCompression's arguments (its docstring, which --help
    shows, says each), refused in one line where they are unknown or out of range."""

    method: str = "none"
    powersgd_rank: int = 4
    powersgd_start_step: int = 10
    powersgd_warm_start: bool = True

    def __post_init__(self) -> None:
        field = "gradient_compression"
        if self.method not in COMPRESSIONS:
            raise UserError(f"{field}.method={self.method!r} is not a compression: use one of "
                            f"{', '.join(COMPRESSIONS)}")
        if self.method == "powersgd":
            start = "at least 2 (DDP regroups its gradient buckets after step 1)"
            check_ranges(field, {"powersgd_rank": (self.powersgd_rank >= 1, "at least 1"),
                                 "powersgd_start_step": (self.powersgd_start_step >= 2, start)}, vars(self))


def check_config(settings: CompressionSettings, plan: RunPlan, strategy: ConfiguredStrategy) -> None:
    """A UserError for a compression outside DDP; a note (not an error: the same config runs on one process to debug,
    and trains there exactly) where there is nothing to compress."""
    method, field = settings.method, "gradient_compression"
    if method == "none":
        return
    if strategy.kind is not StrategyKind.DDP:
        raise UserError(f"{field}.method={method} compresses DDP's gradient all-reduce, but trainer.strategy is "
                        f"{strategy.name}, which reduces gradients its own way: use a DDP preset "
                        f"(configs/trainer/ddp_cpu.yaml, ddp_gpu_bf16.yaml) or set {field}.method none")
    if plan.world_size == 1:
        rank_zero_info(f"{field}: method {method} does nothing on one process (there is no all-reduce); the run "
                       "trains with exact gradients")


class GradientCompression(Callback):
    def __init__(self, method: str = CompressionSettings.method, powersgd_rank: int = CompressionSettings.powersgd_rank,
                 powersgd_start_step: int = CompressionSettings.powersgd_start_step,
                 powersgd_warm_start: bool = CompressionSettings.powersgd_warm_start) -> None:
        """
        Args:
            method: none, bf16, fp16 or powersgd (the pre-flight checks refuse others, and any but none outside DDP).
            powersgd_rank: rank r of PowerSGD's factors; higher sends more and approximates better.
            powersgd_start_step: optimizer steps all-reduced plainly before PowerSGD starts (torch's
                start_powerSGD_iter): the first steps are the most sensitive to a biased gradient, and DDP regroups
                its buckets after the first. At least 2.
            powersgd_warm_start: begin each step's power iteration from the last step's Q (torch's default); false
                draws a fresh random Q every step.
        """
        self.method = method
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_step = powersgd_start_step
        self.powersgd_warm_start = powersgd_warm_start
        self.bucket_listeners: list[BucketListener] = []  # called with each bucket as it goes to all-reduce
        self.registered = False  # set at fit start: Cohort's hook is DDP's
        # set by app/strategies/local_updates.py (local SGD, DiLoCo): each rank steps on its own gradient, nothing is
        # all-reduced
        self.local_gradients: PostLocalSGDState | None = None
        self.powersgd: PowerSGDState | None = None
        self.total_bytes = self.total_uncompressed_bytes = self.steps = 0
        self._step_bytes = self._step_uncompressed_bytes = 0
        self._layouts: dict[int, Layout] = {}  # PowerSGD: each bucket's parameters at its last compressed step
        self._waiting: dict[str, Any] = {}  # PowerSGD state per parameter name, not yet in its bucket
        self._loaded: dict[str, Any] = {}  # what the checkpoint held, until fit start

    # ----- registration -----
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(trainer.strategy, DDPStrategy) or trainer.world_size == 1:
            return  # the pre-flight checks refused compression here, or said it does nothing on one process
        self._plan = run_plan_of(pl_module)
        self._names = parameter_names(trainer.lightning_module)
        state = None  # the default process group
        if self.method == "powersgd":
            self.powersgd = state = PowerSGDState(
                process_group=None, matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_step, warm_start=self.powersgd_warm_start,
                random_seed=self._plan.seed)
            self._restore(trainer.global_rank, trainer.world_size)
        try:
            trainer.strategy.model.register_comm_hook(state=state, hook=self._hook)
        except RuntimeError:  # only one hook per model, and another came first (trainer.strategy's ddp_comm_hook)
            if self.method != "none":
                raise UserError(f"gradient_compression.method={self.method}: another DDP comm hook is already "
                                "registered (trainer.strategy.init_args.ddp_comm_hook?): choose one of the two") from None
            rank_zero_info("gradient compression: another DDP comm hook is registered, so bytes are not counted")
            return
        self.registered = True

    # no annotations: DDP compares them as real types, and this module's are strings (PEP 563)
    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """DDP's comm hook: the chosen method's, counted, after telling the listeners that ``bucket`` is ready; under
        local updates the local gradient as it is (no listener is told: nothing waits for other ranks)."""
        buffer = bucket.buffer()
        self._step_uncompressed_bytes += buffer.numel() * buffer.element_size()
        if self.local_gradients is not None:  # torch's post-local SGD hook past its start: returns the bucket as is
            return post_localSGD_hook(self.local_gradients, bucket)
        for listener in self.bucket_listeners:
            listener(bucket)
        if self.method in SIXTEEN_BIT:
            # through this wrapper, not registered itself: DDP refuses a hook named bf16_compress_hook without CUDA
            # and NCCL 2.10, though gloo all-reduces bfloat16 too
            dtype, hook = SIXTEEN_BIT[self.method]
            self._step_bytes += buffer.numel() * dtype.itemsize
            return hook(state, bucket)
        if self.powersgd is None:
            self._step_bytes += buffer.numel() * buffer.element_size()
            return default_hooks.allreduce_hook(state, bucket)
        if state.iter < state.start_powerSGD_iter:  # torch's hook all-reduces the bucket as it is
            self._step_bytes += buffer.numel() * buffer.element_size()
            return powerSGD_hook(state, bucket)
        self._place_state(bucket)
        before = state.total_numel_after_compression  # torch adds what it all-reduces: (n + m) r per compressed
        future = powerSGD_hook(state, bucket)  # matrix (its P and Q), n m per tensor sent as it is
        self._step_bytes += (state.total_numel_after_compression - before) * buffer.element_size()
        if buffer.device.type == "cuda":
            return future
        # gloo completes work on its own threads, where torch's hook starts its P and Q all-reduces; the next
        # bucket's all-reduce, started meanwhile by backward, could then go first on one rank and second on the
        # other (seen: "Received data size doesn't match expected size"). On CPUs each bucket finishes first.
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(future.wait())
        return done

    # ----- bytes per optimizer step -----
    def count_sent(self, nbytes: int) -> None:
        """Bytes handed to all-reduce in this optimizer step outside the hook (local updates' averaging)."""
        self._step_bytes += nbytes

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self.registered or not self._plan.ends_optimizer_step(batch_idx):
            return
        self.steps += 1
        self.total_bytes += self._step_bytes
        self.total_uncompressed_bytes += self._step_uncompressed_bytes
        if trainer.is_global_zero and trainer.global_step % trainer.log_every_n_steps == 0:
            metrics = {"comm/bytes_per_step": self._step_bytes,
                       "comm/uncompressed_bytes_per_step": self._step_uncompressed_bytes}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        self._step_bytes = self._step_uncompressed_bytes = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.registered and self.steps:
            rank_zero_info(f"gradient compression {self.method}: {self.total_bytes / self.steps:,.0f} bytes all-reduced "
                           f"per optimizer step and rank, {self.total_bytes / self.total_uncompressed_bytes:.3f} of "
                           "the gradient's")

    # ----- PowerSGD state: per parameter name, whatever the buckets -----
    def _place_state(self, bucket: dist.GradBucket) -> None:
        """Before torch's hook runs on ``bucket``: state of parameters that waits (restored from a checkpoint, or
        from buckets DDP has since regrouped) goes into this bucket's slots of the PowerSGDState."""
        index, state = bucket.index(), self.powersgd
        layout = [(self._names[id(param)], tuple(param.shape)) for param in bucket.parameters()]
        if self._layouts.get(index, layout) != layout:  # DDP regrouped its buckets after this process's first step
            self._waiting = self._per_parameter()
            for by_bucket in (state.error_dict, state.p_memory_dict, state.q_memory_dict, self._layouts):
                by_bucket.clear()
        self._layouts[index] = layout
        residuals, factors = self._waiting.get("residuals", {}), self._waiting.get("q", {})
        buffer = bucket.buffer()
        if index not in state.error_dict and layout and all(name in residuals for name, _ in layout):
            state.error_dict[index] = torch.cat([residuals.pop(name).reshape(-1) for name, _ in layout]).to(buffer)
        slots, p_length = factor_slots(layout, state)
        if (self._waiting.get("warm") and index not in state.q_memory_dict and all(name in factors for name in slots)):
            q = [factors.pop(name) for name in slots]  # in the order of their offsets
            state.q_memory_dict[index] = torch.cat(q).to(buffer) if q else buffer.new_empty(0)
            state.p_memory_dict[index] = buffer.new_empty(p_length)  # overwritten before it is read

    def _per_parameter(self) -> dict[str, Any]:
        """This rank's residuals and Q factors by parameter name: those in the PowerSGDState's buckets, and those
        still waiting for theirs."""
        state = self.powersgd
        residuals = dict(self._waiting.get("residuals", {}))
        factors = dict(self._waiting.get("q", {}))
        for index, layout in self._layouts.items():
            if index in state.error_dict:
                offsets = np.cumsum([0] + [math.prod(shape) for _, shape in layout])
                residuals.update({name: state.error_dict[index][offsets[i]:offsets[i + 1]].view(shape).clone()
                                  for i, (name, shape) in enumerate(layout)})
            if index in state.q_memory_dict:
                factors.update({name: state.q_memory_dict[index][start:end].clone()
                                for name, (start, end) in factor_slots(layout, state)[0].items()})
        warm = bool(self._waiting.get("warm")) or bool(state.q_memory_dict)
        return {"residuals": residuals, "q": factors, "warm": warm and state.warm_start}

    def state_dict(self) -> dict[str, Any]:
        """PowerSGD's state as tensors and numbers, with every rank's residuals; a collective (gather to rank 0),
        which every rank reaches: Lightning builds the checkpoint on every rank before rank 0 writes it."""
        if self.powersgd is None:
            return {}
        state = self.powersgd
        own = self._per_parameter()
        generator = state.rng.get_state()  # ("MT19937", 624 uint32 keys, position, has_gauss, cached_gaussian)
        return {"method": "powersgd", "rank": state.matrix_approximation_rank, "step": state.iter,
                "rng_keys": torch.from_numpy(generator[1].astype(np.int64)), "rng_position": int(generator[2]),
                "rng_has_gauss": int(generator[3]), "rng_cached_gaussian": float(generator[4]),
                "q": {name: q.cpu() for name, q in own["q"].items()}, "warm": own["warm"],
                "residuals": gather_per_rank(own["residuals"])}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict  # applied at fit start, once this rank's PowerSGDState exists

    def _restore(self, rank: int, world_size: int) -> None:
        saved, state = self._loaded, self.powersgd
        if not saved:
            return
        if saved.get("method") != "powersgd":
            rank_zero_info("gradient compression: the checkpoint holds no PowerSGD state; it starts afresh")
            return
        state.iter = saved["step"]
        state.rng.set_state(("MT19937", saved["rng_keys"].numpy().astype(np.uint32), saved["rng_position"],
                             saved["rng_has_gauss"], saved["rng_cached_gaussian"]))
        factors = saved["q"] if saved["rank"] == state.matrix_approximation_rank else {}
        if saved["q"] and not factors:
            rank_zero_info(f"gradient compression: the checkpoint's PowerSGD factors have rank {saved['rank']}, not "
                           f"{state.matrix_approximation_rank}: they start afresh")
        residuals = saved["residuals"][rank] if len(saved["residuals"]) == world_size else {}
        if saved["residuals"] and not residuals:
            rank_zero_info(f"gradient compression: the checkpoint holds PowerSGD residuals of {len(saved['residuals'])} "
                           f"ranks, not {world_size}: they start at zero")
        self._waiting = {"residuals": dict(residuals), "q": dict(factors), "warm": saved["warm"] and bool(factors)}


def factor_slots(layout: Layout, state: PowerSGDState) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each compressed parameter's Q factor sits in its bucket's Q memory (start, end), in offset order, and
    the length of the bucket's P memory: laid out as torch's powerSGD_hook lays them, matrices (each tensor viewed
    as shape[0] x the rest) grouped by shape in order of first appearance, those too small to gain left out."""
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name, shape in layout:
        rows, columns = shape[0], math.prod(shape[1:])
        rank = min(rows, columns, state.matrix_approximation_rank)
        if _should_compress(rows, columns, rank, state.min_compression_rate)[0]:
            by_shape.setdefault((rows, columns), []).append(name)
    slots, offset, p_length = {}, 0, 0
    for (rows, columns), names in by_shape.items():
        rank = min(rows, columns, state.matrix_approximation_rank)
        for name in names:
            slots[name] = (offset, offset + columns * rank)
            offset += columns * rank
            p_length += rows * rank
    return slots, p_length


def gather_per_rank(tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every rank's ``tensors`` on rank 0, by rank (empty on the others), in one gather; every rank has the same
    names, shapes and dtype (PowerSGD's residuals; local updates' own weights and moments)."""
    names = sorted(tensors)
    if not names:
        return []
    flat = torch.cat([tensors[name].reshape(-1) for name in names])
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = [torch.empty_like(flat) for _ in range(world_size)] if rank == 0 else None
    dist.gather(flat, gathered, dst=0)
    if gathered is None:
        return []
    offsets = np.cumsum([0] + [tensors[name].numel() for name in names])
    return [{name: flat[offsets[i]:offsets[i + 1]].view(tensors[name].shape).cpu() for i, name in enumerate(names)}
            for flat in gathered]


def registered_compression(trainer: L.Trainer) -> GradientCompression | None:
    """The run's GradientCompression, if its hook is DDP's."""
    return next((callback for callback in trainer.callbacks
                 if isinstance(callback, GradientCompression) and callback.registered), None)
