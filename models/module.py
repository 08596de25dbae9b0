"""What every model family shares: the LightningModule base that Cohort's machinery (the CLI, the pre-flight checks,
the doctor, the monitor, checkpoints) talks to, and the optimizer, learning-rate schedule and clipping all families
train with.

A family (``models/language_model.py`` for GPT, ``models/masked_language_model.py`` for BERT,
``models/image_classifier.py`` for the ResNet, or one of your own) subclasses ``CohortModule`` and says, in three
methods, how to build its plain network, what one micro-batch looks like and what its loss is; optionally its
tensor-parallel plan and its pipeline stages. Cohort builds the network (``configure_model``: on the meta device,
parallelised as the strategy says, initialised from the seed), and its default steps train and validate any
family. The config picks the family by ``model.class_path`` (LightningCLI's subclass mode); nothing else in Cohort
names a family.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import lightning as L
import torch
import torch.nn as nn
from jsonargparse import Namespace
from lightning.pytorch.plugins import Precision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.flop_counter import FlopCounterMode
from torchmetrics import MeanMetric

from core.errors import UserError
from core.run_plan import RunPlan, run_plan_of
from core.seeding import DEFAULT_SEED
from models.parallelize import TensorParallelPlan, build_network, clip_grad_norm_, repeated_blocks

# FSDP2's compute dtype for each mixed precision; the sharded float32 master weights stay float32
FSDP_PARAM_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
# what a datamodule finds out from its data (an image folder's classes) and the model takes: the CLI links each
# attribute of the datamodule to the model argument of the same name where both exist
DERIVED_FROM_DATA = ("num_classes", "in_channels", "image_shape")
# the hyperparameters that decide the shapes of a family's weights; a checkpoint must agree with the config on them
SHAPE_HYPERPARAMETERS = ("model_name", "vocab_size", "num_classes", "in_channels")


class CohortModule(L.LightningModule):
    """The base of every model family. Subclasses call ``save_hyperparameters()`` with at least the optimizer fields
    read here (learning_rate, min_learning_rate_ratio, weight_decay, betas, warmup_steps, lr_decay_steps,
    global_batch_size, reference_batch_size) and give ``plain_network``, ``example_batch`` and ``batch_loss``;
    Cohort builds ``self.model`` from them. A family that writes its own ``configure_model`` is refused under the
    strategies that must shard or split its network (``app/preflight.py``)."""

    commands: ClassVar[tuple[str, ...]] = ("fit", "validate")  # the Lightning subcommands the family has steps for

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None  # the family's network, built by configure_model (sharded as the strategy says)
        self.pipeline: Any = None  # this rank's pipeline stages and their schedule (models/pipeline.py), if any
        self.run_plan: RunPlan | None = None  # handed over by the CLI before training
        self.val_loss = MeanMetric()  # the default validation_step's, weighted by samples

    # ----- what a family provides -----
    def plain_network(self) -> nn.Module:
        """The whole network with no parallelism, on the current default device: ``cohort doctor`` builds it on the
        meta device to count parameters and FLOPs and on the run's device to time a step."""
        raise NotImplementedError

    def example_batch(self, micro_batch_size: int, sequence_length: int, device: torch.device) -> Any:
        """A micro-batch of the shape training sees (content does not matter), for counting FLOPs and memory;
        ``sequence_length`` is the data's (the run plan's), which families without sequences ignore."""
        raise NotImplementedError

    def batch_loss(self, network: nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of one micro-batch through ``network`` (a plain network, as ``plain_network`` builds)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line on the model for the start of a run: family, size and parameter count."""
        return f"{type(self).__name__}: {self.num_parameters():,} parameters"

    # ----- what a family may provide -----
    def tensor_parallel_plan(self) -> TensorParallelPlan | None:
        """Which Linear layers tensor parallelism splits, by module-name pattern (``models/parallelize.py``); None:
        the family cannot run with tensor_parallel_size > 1 (the pre-flight checks refuse it)."""
        return None

    def blocks(self, network: nn.Module) -> list[nn.Module]:
        """The network's repeated blocks: each is one FSDP2 unit, checkpointed and compiled on its own."""
        return repeated_blocks(network)

    def build_pipeline(self, plan: RunPlan) -> tuple[nn.Module, Any]:
        """This rank's pipeline stages, as one module holding them under the unsplit network's names, and the
        Pipeline that runs them; a family without a pipeline split leaves this out (the pre-flight checks refuse
        pipeline_parallel_size > 1 for it)."""
        raise UserError(f"{type(self).__name__} has no pipeline split: train it without pipeline stages")

    @classmethod
    def check_config(cls, model: Namespace, data: Namespace, plan: RunPlan) -> None:
        """UserErrors for what this family cannot do with the config's sizes (``app/preflight.py`` calls this before
        anything is built, and ``--print_config`` too)."""

    # ----- shared by every family -----
    def configure_model(self) -> None:
        """Build the family's network on the meta device, then parallelise, materialise and initialise it on this
        rank's device (``build``); under PipelineParallelStrategy only this rank's stages (``build_pipeline``).
        With no Trainer (``load_from_checkpoint`` in a plain Python process) it is built whole on the CPU."""
        if self.model is not None:  # Lightning calls this once per fit/validate/...; build once
            return
        plan = run_plan_of(self) if self._trainer is not None else None
        if plan is not None and plan.pipeline_parallel_size > 1:
            self.model, self.pipeline = self.build_pipeline(plan)
        else:
            self.model = self.build()

    def build(self, keep_stage: Callable[[nn.Module], None] | None = None) -> nn.Module:
        """The family's network as this rank holds it: over the strategy's device mesh (FSDP2 on the data-parallel
        ranks, the family's tensor-parallel plan on the tensor-parallel ones), with activation checkpointing and
        compile where the family's hyperparameters ask, initialised from the run's seed. ``keep_stage`` keeps one
        pipeline stage."""
        trainer = self._trainer
        precision = str(trainer.precision) if trainer is not None else "32-true"
        return build_network(
            self.plain_network, self.build_device(), self.seed, self.device_mesh,
            tensor_parallel_plan=self.tensor_parallel_plan(), blocks=self.blocks,
            activation_checkpointing=self.hparams.get("activation_checkpointing", False),
            compile=self.hparams.get("compile", False),
            param_dtype=fsdp_compute_dtype(precision, self.plain_network), keep_stage=keep_stage,
        )

    @property
    def seed(self) -> int:
        """The seed of the initial weights: the run's (seed_everything), else the family's own, else Cohort's."""
        if self.run_plan is not None:
            return self.run_plan.seed
        return int(self.hparams.get("seed", DEFAULT_SEED))

    def build_device(self) -> torch.device:
        """Where configure_model builds the network: this rank's device; the CPU with no Trainer (load_from_checkpoint
        in a plain Python process) and under FSDP (1), which moves each unit to its GPU as it shards it."""
        trainer = self._trainer
        if trainer is None or isinstance(trainer.strategy, FSDPStrategy):
            return torch.device("cpu")
        return trainer.strategy.root_device

    def flops_per_sample(self, sequence_length: int) -> float:
        """Training (forward + backward) FLOPs of one sample, counted by torch on the meta device: no memory, no
        compute, and true for any family."""
        with torch.device("meta"):
            network = self.plain_network()
            batch = self.example_batch(1, sequence_length, torch.device("meta"))
            with FlopCounterMode(display=False) as counter:
                self.batch_loss(network, batch).backward()
        return counter.get_total_flops()

    def num_parameters(self) -> int:
        """Parameters of the whole network, each shared one counted once, counted on the meta device."""
        with torch.device("meta"):
            return sum(parameter.numel() for parameter in self.plain_network().parameters())

    def forward(self, *inputs: Any) -> Any:
        return self.model(*inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The family's loss of one micro-batch; logged (with the learning rate) once per optimizer step, at its last
        micro-batch: a step's logged value is that one's anyway, and each self.log costs about a millisecond."""
        loss = self.batch_loss(self.model, batch)
        if run_plan_of(self).ends_optimizer_step(batch_idx):
            self.log("train/loss", loss, prog_bar=True)
            self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """The family's loss of one validation batch, weighted by its samples."""
        samples = len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
        self.val_loss.update(self.batch_loss(self.model, batch).float(), weight=samples)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # a collective: the mean over every rank's samples
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)  # already equal on every rank: no extra sync

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the family, so that resuming a checkpoint with another family's config stops with one line."""
        checkpoint["cohort_model_class"] = class_path_of(type(self))

    @property
    def effective_learning_rate(self) -> float:
        """The peak learning rate after the linear scaling rule, if one is configured."""
        lr = self.hparams.learning_rate
        if self.hparams.reference_batch_size is not None:
            if self.hparams.global_batch_size is None:
                raise UserError("model.reference_batch_size needs model.global_batch_size (linked from data)")
            lr *= self.hparams.global_batch_size / self.hparams.reference_batch_size
        return lr

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip under every strategy and precision, and log the gradient norm before clipping. Lightning's own
        clipping refuses a fused optimizer under mixed precision (it cannot know whether the gradients are still
        scaled) and norm clipping under FSDP (the norm must be summed over the shards)."""
        if not gradient_clip_val:
            return
        unscale_gradients(self.trainer.precision_plugin, optimizer)
        parameters = [param for group in optimizer.param_groups for param in group["params"]]
        if gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(parameters, gradient_clip_val)
            return
        pipeline = self.pipeline
        norm = clip_grad_norm_(self.trainer.model, parameters, gradient_clip_val,
                               pipeline_group=pipeline and pipeline.group,
                               counted=pipeline and pipeline.counted_parameters(parameters))
        self.log("train/grad_norm", norm)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (decay on weight matrices only) with linear warmup and cosine decay, stepped per optimizer step."""
        lr = self.effective_learning_rate
        if self.hparams.reference_batch_size is not None:
            rank_zero_info(
                f"learning rate {lr:.3g} = {self.hparams.learning_rate:.3g} x global batch "
                f"{self.hparams.global_batch_size} / reference batch {self.hparams.reference_batch_size}"
            )
        optimizer = torch.optim.AdamW(
            weight_decay_groups(self.model, self.hparams.weight_decay),
            lr=lr,
            betas=self.hparams.betas,
            # one kernel for all parameters where torch has it; under fp16's grad scaler too, since
            # configure_gradient_clipping unscales the gradients a fused optimizer would otherwise unscale itself
            fused=self.device.type in ("cuda", "cpu"),
        )
        decay_steps = self.hparams.lr_decay_steps or self.trainer.estimated_stepping_batches
        schedule = warmup_cosine_schedule(self.hparams.warmup_steps, int(decay_steps), self.hparams.min_learning_rate_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def optimizer_ranges(hparams: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    """The range checks of the optimizer fields every family has, for core.errors.check_ranges."""
    return {
        "learning_rate": (hparams["learning_rate"] > 0, "> 0"),
        "min_learning_rate_ratio": (0 <= hparams["min_learning_rate_ratio"] <= 1, "in [0, 1]"),
        "weight_decay": (hparams["weight_decay"] >= 0, ">= 0"),
        "betas": (len(hparams["betas"]) == 2 and all(0 <= beta < 1 for beta in hparams["betas"]), "two numbers in [0, 1)"),
        "warmup_steps": (hparams["warmup_steps"] >= 0, ">= 0"),
        "lr_decay_steps": (hparams["lr_decay_steps"] is None or hparams["lr_decay_steps"] > 0,
                           "> 0, or null for the whole run"),
        "reference_batch_size": (hparams["reference_batch_size"] is None or hparams["reference_batch_size"] > 0,
                                 "> 0, or null"),
    }


def fsdp_compute_dtype(precision: str, make_network: Callable[[], nn.Module]) -> torch.dtype | None:
    """FSDP2's compute dtype under mixed precision; None for a network with batch norms, whose float32 running
    statistics cannot meet half-precision weights (autocast then runs its convolutions in half precision, as under
    DDP)."""
    dtype = FSDP_PARAM_DTYPES.get(precision)
    if dtype is None:
        return None
    with torch.device("meta"):
        batch_norms = any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in make_network().modules())
    return None if batch_norms else dtype


def class_path_of(cls: type) -> str:
    """The dotted path a config names a class by, e.g. models.language_model.GPTLanguageModel."""
    return f"{cls.__module__}.{cls.__qualname__}"


def unscale_gradients(precision_plugin: Precision, optimizer: torch.optim.Optimizer) -> None:
    """Under fp16's grad scaler, divide the gradients by the loss scale before they are clipped, as torch's AMP
    recipe does. Lightning does this itself except for optimizers that unscale inside their step (fused AdamW);
    the scaler records that it is done, so the fused step then only skips a step with inf or NaN gradients."""
    scaler = getattr(precision_plugin, "scaler", None)  # MixedPrecision and FSDPPrecision under 16-mixed
    if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        scaler.unscale_(optimizer)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay only the weight matrices and convolution kernels: never biases, norms or embeddings (a tied head
    included), as the GPT-2 and BERT recipes do."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in embeddings]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine_schedule(warmup_steps: int, decay_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier for step s: linear warmup to 1, cosine down to ``min_ratio`` at ``decay_steps``, then flat."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if step >= decay_steps:
            return min_ratio
        progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
        return min_ratio + 0.5 * (1.0 - min_ratio) * (1.0 + math.cos(math.pi * progress))

    return multiplier
