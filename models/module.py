"""What every model family shares: the LightningModule base that Cohort's machinery (the CLI, the pre-flight checks,
the doctor, the monitor, checkpoints) talks to, and the optimizer, learning-rate schedule and clipping all families
train with.

A family (``models/<family>/family.py``: ``models/gpt/`` for GPT, ``models/bert/`` for BERT, ``models/resnet/`` for
the ResNet, ..., or one of your own) subclasses ``CohortModule`` and says how to build its plain network and what its
loss on one micro-batch is (and, unless its inputs are token ids, what a micro-batch looks like); optionally its
tensor-parallel plan, where its network may be cut into pipeline stages and how it reads and writes Hugging Face
folders, and its metrics besides the loss (``batch_metrics``). Cohort builds the network (``configure_model``: on
the meta device, parallelised as the strategy says, initialised from the seed), and its steps train and validate
any family (a validation's weighting, the pipeline's part and the logging are here). The config picks the family
by ``model.class_path`` (LightningCLI's subclass mode); models/registry.py lists the shipped families, for the
CLI's default and messages and for ``cohort export``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn
from jsonargparse import Namespace
from lightning.pytorch.plugins import Precision
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.flop_counter import FlopCounterMode
from torchmetrics import MeanMetric, Metric

from core.errors import UserError
from core.run_plan import RunPlan, run_plan_of
from core.seeding import DEFAULT_SEED
from core.sizes import format_bytes
from core.tokens import IGNORE_INDEX
from models.class_paths import class_path_of, current_class_path
from models.interchange import HuggingFaceAdapter, HuggingFaceFolder
from models.optimizer import OptimizerSettings
from models.parallel.expert_parallel import reduce_expert_gradients
from models.parallel.parallelize import (
    GradientNorms, TensorParallelPlan, build_network, check_tensor_parallel_size, choose_gradient_reduction,
    clip_grad_norm_, repeated_blocks,
)
from models.parallel.pipeline import (
    Pipeline, PipelineSplit, block_paths, check_split, check_stages_have_blocks, keep_stage, merge_stages,
    rank_stages, tied_parts,
)
from models.step_logging import StepLoggedModule

# what a datamodule finds out from its data (an image folder's classes) and the model takes: the CLI links each
# attribute of the datamodule to the model argument of the same name where both exist
DERIVED_FROM_DATA = ("num_classes", "in_channels", "image_shape")
# the hyperparameters that decide the shapes of a family's weights; a checkpoint must agree with the config on them
SHAPE_HYPERPARAMETERS = ("model_name", "vocab_size", "num_classes", "in_channels")


class CohortModule(StepLoggedModule):
    """The base of every model family. Subclasses give ``plain_network``, ``example_batch`` and ``batch_loss``, and
    pass their ``optimizer`` settings on (a family with hyperparameters of its own calls ``save_hyperparameters()``);
    Cohort builds ``self.model`` from them. A family that writes its own ``configure_model`` is refused under the
    strategies that must shard or split its network (``app/cli/preflight.py``)."""

    commands: ClassVar[tuple[str, ...]] = ("fit", "validate")  # the Lightning subcommands the family has steps for
    label: ClassVar[str] = "model"  # what messages call the family: "GPT", "BERT"
    # how the family's network reads (model.init_from) and writes (cohort export) Hugging Face folders; None: not
    huggingface: ClassVar[HuggingFaceAdapter | None] = None
    logs_perplexity: ClassVar[bool] = False  # a language model's: also exp(val/loss) as val/perplexity
    routes_to_experts: ClassVar[bool] = False  # whether its network has experts to spread (expert_parallel_size)

    def __init__(self, optimizer: OptimizerSettings = OptimizerSettings()) -> None:
        """
        Args:
            optimizer: AdamW and its learning-rate schedule (models/optimizer.py); each family has its defaults.
        """
        super().__init__()
        missing = [method for method in ("plain_network", "batch_loss")
                   if getattr(type(self), method) is getattr(CohortModule, method)]
        if missing:  # else the run would stop at its first use, in a bare NotImplementedError
            raise UserError(f"the model family {class_path_of(type(self))} defines no {' and no '.join(missing)}: a "
                            "family builds its network (plain_network) and gives its loss on a micro-batch "
                            "(batch_loss); models/module.py's CohortModule says what each returns, "
                            "tests/test_your_own_family.py has a whole family")
        # a checkpoint's hyperparameters hold the settings as a plain dict (checkpoints are data, never objects)
        self.optimizer_settings = optimizer if isinstance(optimizer, OptimizerSettings) else OptimizerSettings(**optimizer)
        self.model: nn.Module | None = None  # the family's network, built by configure_model (sharded as the strategy says)
        self.pipeline: Any = None  # this rank's pipeline stages and their schedule (models/parallel/pipeline.py), if any
        self.run_plan: RunPlan | None = None  # handed over by the CLI before training
        self.val_loss = MeanMetric()  # weighted by the targets (validation_weight)
        self.val_metrics: dict[str, Metric] = {}  # this validation's others (batch_metrics), by name
        self._gradient_norms: GradientNorms | None = None  # this optimizer step's, once taken (gradient_norms)

    # ----- what a family provides -----
    def plain_network(self) -> nn.Module:
        """The whole network with no parallelism, on the current default device: ``cohort doctor`` builds it on the
        meta device to count parameters and FLOPs and on the run's device to time a step."""
        raise NotImplementedError

    def example_batch(self, micro_batch_size: int, sequence_length: int, device: torch.device) -> Any:
        """A micro-batch of the shape training sees (content does not matter), for counting FLOPs and memory;
        ``sequence_length`` is the data's (the run plan's), which families without sequences ignore. This one is
        a language model's: (token ids, next-token targets), each (B, T); other inputs need their own."""
        tokens = torch.zeros(micro_batch_size, sequence_length, dtype=torch.long, device=device)
        return tokens, tokens

    def batch_loss(self, network: nn.Module, batch: Any) -> torch.Tensor:
        """The mean loss of one micro-batch (as ``prepare_batch`` gives it; ``example_batch`` is one) through
        ``network`` (a plain network, as ``plain_network`` builds)."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line on the model for the start of a run: family, size and parameter count."""
        return f"{type(self).__name__}: {self.num_parameters():,} parameters"

    def parameters_and_size(self) -> str:
        """``describe``'s end: the parameter count and what the weights take in float32."""
        parameters = self.num_parameters()
        return f"{parameters:,} parameters ({format_bytes(parameters * 4)} in float32)"

    # ----- what a family may provide -----
    def tensor_parallel_plan(self) -> TensorParallelPlan | None:
        """Which Linear layers tensor parallelism splits, by module-name pattern (``models/parallel/parallelize.py``); None:
        the family cannot run with tensor_parallel_size > 1 (the pre-flight checks refuse it)."""
        return None

    def blocks(self, network: nn.Module) -> list[nn.Module]:
        """The network's repeated blocks: each is one FSDP2 unit, checkpointed and compiled on its own."""
        return repeated_blocks(network)

    def pipeline_split(self) -> PipelineSplit | None:
        """Where the network may be cut into pipeline stages (``models/parallel/pipeline.py``); None: the family cannot run
        with pipeline_parallel_size > 1 (the pre-flight checks refuse it)."""
        return None

    def pretrained_weights(self) -> Callable[[str], torch.Tensor] | None:
        """Reads each parameter's full tensor by name from the weights the run starts from: the Hugging Face folder
        ``model.init_from`` names, through the family's adapter and its ``config``; None: initialise them from the
        seed."""
        init_from = self.hparams.get("init_from")
        if init_from is None or self.huggingface is None:
            return None
        return self.huggingface.weight_reader(HuggingFaceFolder(init_from), self.config)

    def batch_metrics(self, network: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor | Metric]]:
        """``batch_loss`` of the micro-batch and, by name, the family's other metrics of the same forward pass (the
        classifier's accuracy, BERT's masked accuracy). Training logs a step's last micro-batch's as
        ``train/<name>``; validation (``self.training`` False) logs ``val/<name>``: a tensor there is the mean over
        the batch's targets, weighted by them as the loss is; a torchmetrics Metric the family has fed the batch
        accumulates itself."""
        return self.batch_loss(network, batch), {}

    def float_in_evaluation(self, outputs: torch.Tensor) -> torch.Tensor:
        """The network's ``outputs`` as a shipped family's loss takes them: as they come in training, in float32 in
        validation and test, whatever the precision (under bf16-true a loss of bfloat16 logits would round)."""
        return outputs if self.training else outputs.float()

    def prepare_batch(self, batch: Any, batch_idx: int) -> Any:
        """The micro-batch ``batch_idx`` as ``batch_loss`` and a pipeline take it: (inputs, targets), what the first
        stage reads and what the loss compares with. The data's batch unchanged, unless the family corrupts its
        inputs per step (BERT's masks)."""
        return batch

    @classmethod
    def check_config(cls, model: Namespace, data: Namespace, plan: RunPlan) -> None:
        """UserErrors for what this family cannot do with the config's sizes (``app/cli/preflight.py`` calls this before
        anything is built, and ``--print_config`` too)."""

    @staticmethod
    def check_layers_and_heads(plan: RunPlan, layers: int, head_counts: tuple[int, ...], name: str) -> None:
        """UserErrors for a pipeline with a stage of no blocks among ``layers`` and for head counts the
        tensor-parallel ranks cannot share whole; ``name`` says which model."""
        check_stages_have_blocks(plan, layers, name)
        try:
            for heads in head_counts:
                check_tensor_parallel_size(heads, plan.tensor_parallel_size)
        except ValueError as error:
            raise UserError(f"{error} ({name})") from None

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

    def build_pipeline(self, plan: RunPlan) -> tuple[nn.Module, Pipeline]:
        """This rank's stages (two under all schedules but GPipe and 1F1B), each built as ``build`` builds the whole
        network but keeping its own blocks and ends, held together by one module under the unsplit network's names,
        and the Pipeline that runs them."""
        split = self.pipeline_split()
        with torch.device("meta"):
            whole = self.plain_network()
        paths = block_paths(whole, self.blocks(whole))
        check_split(whole, split, paths)
        spans = rank_stages(len(paths), self.device_mesh, plan.pipeline_stage_ranks, plan.pipeline_layers)
        tied = sorted(tied_parts(whole, split).values())
        stages = [self.build(keep_stage=partial(keep_stage, split=split, paths=paths, span=span)) for span in spans]
        pipeline = Pipeline(stages, spans, self.device_mesh, self.build_device(), plan.pipeline_schedule,
                            plan.pipeline_microbatches, split, tied, plan.pipeline_ends_on_one_rank)
        model = stages[0] if len(stages) == 1 else merge_stages(self.plain_network, split, paths, stages, spans)
        return model, pipeline

    def build(self, keep_stage: Callable[[nn.Module], None] | None = None) -> nn.Module:
        """The family's network as this rank holds it: over the strategy's device mesh (FSDP2 on the data-parallel
        ranks, the family's tensor-parallel plan on the tensor-parallel ones), with activation checkpointing and
        compile where the family's hyperparameters ask, initialised from the run's seed. ``keep_stage`` keeps one
        pipeline stage."""
        return build_network(
            self.plain_network, self.build_device(), self.seed, self.device_mesh,
            tensor_parallel_plan=self.tensor_parallel_plan(), blocks=self.blocks,
            activation_checkpointing=self.hparams.get("activation_checkpointing", False),
            compile=self.hparams.get("compile", False),
            autocast_dtype=self.run_plan.precision.autocast_dtype if self.run_plan is not None else None,
            keep_stage=keep_stage, pretrained=self.pretrained_weights(),
            data_parallel_replicas=self.run_plan.data_parallel_replicate_size if self.run_plan is not None else 1,
            expert_parallel_size=self.run_plan.expert_parallel_size if self.run_plan is not None else 1,
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
        """The family's loss (and metrics) of one micro-batch, or under a pipeline its forward and backward through
        all stages, now (Lightning's backward is then skipped). The step's last are logged (``log_step_metrics``)."""
        plan, metrics = run_plan_of(self), {}
        if self.pipeline is not None:  # the loss alone: the outputs stay on the last stage
            if plan.starts_optimizer_step(batch_idx):  # see optimizer_zero_grad
                self.optimizers().zero_grad()
            loss = self.pipeline.train_step(*self.prepare_batch(batch, batch_idx), plan.accumulation)
            if plan.ends_optimizer_step(batch_idx):
                self.pipeline.finish_gradients()
        else:
            choose_gradient_reduction(self.model, plan, batch_idx)
            loss, metrics = self.batch_metrics(self.model, self.prepare_batch(batch, batch_idx))
        if plan.ends_optimizer_step(batch_idx):
            self.step_metrics = {"train/loss": loss.detach(), **{f"train/{name}": value.detach()
                                                                 for name, value in metrics.items()}}
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward of the training step's loss; under a pipeline the schedule has run it already."""
        if self.pipeline is None:
            super().backward(loss, *args, **kwargs)

    def on_after_backward(self) -> None:
        """Experts split over ranks reduce their gradients after their optimizer step's last backward
        (models/parallel/expert_parallel.py)."""
        reduce_expert_gradients(self.model)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning zeroes the gradients between the step's first training_step and its backward, which would drop
        the gradients a pipeline's training_step has already made: then training_step zeroes them itself."""
        if self.pipeline is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """The family's loss and metrics (``batch_metrics``) of one validation batch, weighted by its targets that
        are not padding (IGNORE_INDEX: the windows and images that even out the ranks' shares count for nothing);
        a batch that is not (inputs, targets), which a family of one's own may read whole, by its samples. Under a
        pipeline the loss alone, which the last stage computes and every stage gets."""
        self.accumulate(self.prepare_batch(batch, batch_idx), self.val_loss, self.val_metrics)

    def accumulate(self, batch: Any, loss_metric: MeanMetric, metrics: dict[str, Metric]) -> None:
        """Add one evaluated batch's loss to ``loss_metric`` and its other metrics to ``metrics`` (by name)."""
        if self.pipeline is not None:
            loss_metric.update(*self.pipeline.eval_step(*batch))
            return
        loss, batch_metrics = self.batch_metrics(self.model, batch)
        weight = validation_weight(batch)
        loss_metric.update(torch.nan_to_num(loss.float()), weight=weight)  # an all-padding batch's NaN weighs 0
        for name, value in batch_metrics.items():
            if isinstance(value, Metric):
                metrics[name] = value
            else:
                if name not in metrics:  # gathered as the loss is (the parameter server's server: not at all);
                    # float32 whatever the default dtype (bf16-true sets bfloat16 around the step)
                    metrics[name] = MeanMetric(sync_on_compute=loss_metric.sync_on_compute).set_dtype(
                        torch.float32).to(self.device)
                metrics[name].update(torch.nan_to_num(value.float()), weight=weight)

    def on_validation_epoch_end(self) -> None:
        self.log_evaluation("val", self.val_loss, self.val_metrics)

    def log_evaluation(self, split: str, loss_metric: MeanMetric, metrics: dict[str, Metric]) -> None:
        """Log ``split``/loss (and perplexity, for a language model) and the other metrics, then start them over. Each
        compute is a collective (over every rank's targets): the values are equal on every rank, sync_dist says so."""
        loss = loss_metric.compute()
        loss_metric.reset()
        self.log(f"{split}/loss", loss, prog_bar=True, sync_dist=True)
        if self.logs_perplexity:
            self.log(f"{split}/perplexity", torch.exp(loss), sync_dist=True)
        for name, metric in metrics.items():
            self.log(f"{split}/{name}", metric.compute(), prog_bar=True, sync_dist=True)
            metric.reset()
        metrics.clear()

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, weights_only: bool | None = None,
                             **kwargs: Any) -> CohortModule:
        """Lightning's, also for a checkpoint written before its family's class moved: the class path its
        hyperparameters name (``_class_path``, which Lightning builds the family from) is read as today's
        (models/class_paths.py). The checkpoint is opened twice, the first time memory-mapped for that one name."""
        if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_file() and "_class_path" not in kwargs:
            saved = torch.load(checkpoint_path, map_location="cpu", mmap=True, weights_only=weights_only is not False)
            class_path = saved.get("hyper_parameters", {}).get("_class_path")
            if class_path is not None:
                kwargs["_class_path"] = current_class_path(class_path)
        return super().load_from_checkpoint(checkpoint_path, *args, weights_only=weights_only, **kwargs)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the family, so that resuming a checkpoint with another family's config stops with one line."""
        checkpoint["cohort_model_class"] = class_path_of(type(self))

    def save_hyperparameters(self, *args: Any, ignore: Any = None, frame: Any = None, logger: bool = True) -> None:
        """Lightning's, with the optimizer settings stored as a plain dict: checkpoints are read as data
        (weights_only), and TensorBoard's HPARAMS tab shows each field (optimizer/learning_rate, ...)."""
        super().save_hyperparameters(*args, ignore=ignore, frame=frame or inspect.currentframe().f_back, logger=logger)
        for hparams in (self._hparams, self._hparams_initial):
            if isinstance(hparams.get("optimizer"), OptimizerSettings):
                hparams["optimizer"] = asdict(hparams["optimizer"])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._gradient_norms = None  # the gradients will change

    def gradient_norms(self, optimizer: torch.optim.Optimizer) -> GradientNorms:
        """The norms of the optimizer's gradients (under a pipeline, those this stage counts), taken once per
        optimizer step: the bad-step guard (app/safety/bad_steps.py) and clipping read the same pass. Under fp16's
        grad scaler the guard does not ask, and clipping asks after unscaling."""
        if self._gradient_norms is None:
            parameters = [param for group in optimizer.param_groups for param in group["params"]]
            counted = self.pipeline.counted_parameters(parameters) if self.pipeline is not None else parameters
            self._gradient_norms = GradientNorms(param.grad for param in counted if param.grad is not None)
        return self._gradient_norms

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
        self.step_metrics["train/grad_norm"] = clip_grad_norm_(self.trainer.model, parameters, gradient_clip_val,
                                                               self.gradient_norms(optimizer),
                                                               pipeline_group=self.pipeline and self.pipeline.group)

    def configure_optimizers(self) -> dict[str, Any]:
        """The family's optimizer settings over its network (models/optimizer.py)."""
        return self.optimizer_settings.configure(self.model, self.device, run_plan_of(self).global_batch_size,
                                                 self.trainer.estimated_stepping_batches)


def unscale_gradients(precision_plugin: Precision, optimizer: torch.optim.Optimizer) -> None:
    """Under fp16's grad scaler, divide the gradients by the loss scale before they are clipped, as torch's AMP
    recipe does. Lightning does this itself except for optimizers that unscale inside their step (fused AdamW);
    the scaler records that it is done, so the fused step then only skips a step with inf or NaN gradients."""
    scaler = getattr(precision_plugin, "scaler", None)  # MixedPrecision and FSDPPrecision under 16-mixed
    if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        scaler.unscale_(optimizer)


def validation_weight(batch: Any) -> torch.Tensor | int:
    """How much a validation batch counts in ``val/loss``: the targets that are not padding of (inputs, targets),
    else the samples of its first tensor (of a tuple, list or dict batch)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], torch.Tensor):
        return (batch[1] != IGNORE_INDEX).sum()
    parts = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]
    first = next((part for part in parts if isinstance(part, torch.Tensor) and part.dim() > 0), None)
    return 1 if first is None else first.shape[0]
