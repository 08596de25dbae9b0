"""The LightningModule that trains a GPT: loss, metrics, optimizer, LR schedule and text generation."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.plugins import Precision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric

from core.errors import UserError, check_ranges
from core.run_plan import RunPlan, run_plan_of
from core.seeding import DEFAULT_SEED
from core.tokens import IGNORE_INDEX
from models.gpt import GPT, gpt_config
from models.parallelize import build_gpt, clip_grad_norm_, merge_stages
from models.pipeline import Pipeline, rank_stages

# FSDP2's compute dtype for each mixed precision; the sharded float32 master weights stay float32
FSDP_PARAM_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class GPTLanguageModel(L.LightningModule):
    def __init__(
        self,
        model_name: str = "small",
        vocab_size: int | None = None,
        dropout: float = 0.0,
        learning_rate: float = 6e-4,
        min_learning_rate_ratio: float = 0.1,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        lr_decay_steps: int | None = None,
        global_batch_size: int | None = None,
        reference_batch_size: int | None = None,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 40,
        activation_checkpointing: bool = False,
        compile: bool = False,
        seed: int = DEFAULT_SEED,
    ) -> None:
        """
        Args:
            model_name: a size from models.gpt.GPT_CONFIGS ("debug", "small", "gpt2", ...).
            vocab_size: overrides the size's vocabulary; the CLI links it to data.vocab_size.
            dropout: dropout probability in embeddings, attention and MLP.
            learning_rate: peak learning rate (before batch-size scaling).
            min_learning_rate_ratio: the cosine decay ends at learning_rate times this.
            weight_decay: AdamW decay on matrices; biases, norms and embeddings are never decayed.
            betas: AdamW betas.
            warmup_steps: optimizer steps of linear warmup from 0.
            lr_decay_steps: optimizer steps until the decay ends; None means the whole run.
            global_batch_size: samples per optimizer step; the CLI links it to data.global_batch_size.
            reference_batch_size: if set, learning_rate is scaled by global_batch_size / reference_batch_size.
            max_new_tokens: tokens generated per prompt by ``predict``.
            temperature: sampling temperature for generation.
            top_k: sample among the k most likely tokens only; None samples from all.
            activation_checkpointing: recompute each block's activations in backward instead of keeping them.
            compile: torch.compile each Transformer block.
            seed: the initial weights and generation's sampling follow from it; the CLI links it to seed_everything.
        """
        super().__init__()
        self.save_hyperparameters()
        check_ranges("model", {
            "learning_rate": (learning_rate > 0, "> 0"),
            "min_learning_rate_ratio": (0 <= min_learning_rate_ratio <= 1, "in [0, 1]"),
            "dropout": (0 <= dropout < 1, "in [0, 1)"),
            "weight_decay": (weight_decay >= 0, ">= 0"),
            "betas": (len(betas) == 2 and all(0 <= beta < 1 for beta in betas), "two numbers in [0, 1)"),
            "warmup_steps": (warmup_steps >= 0, ">= 0"),
            "lr_decay_steps": (lr_decay_steps is None or lr_decay_steps > 0, "> 0, or null for the whole run"),
            "reference_batch_size": (reference_batch_size is None or reference_batch_size > 0, "> 0, or null"),
            "max_new_tokens": (max_new_tokens >= 0, ">= 0"),
            "temperature": (temperature > 0, "> 0"),
            "top_k": (top_k is None or top_k >= 1, ">= 1, or null to sample from all tokens"),
        }, locals())
        self.config = gpt_config(model_name, vocab_size=vocab_size, dropout=dropout)
        self.model: GPT | None = None  # built by configure_model, where the strategy's device mesh is known
        self.pipeline: Pipeline | None = None  # this rank's stage and its schedule, with pipeline stages
        self.run_plan: RunPlan | None = None  # handed over by the CLI before training
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

    @property
    def effective_learning_rate(self) -> float:
        """The peak learning rate after the linear scaling rule, if one is configured."""
        lr = self.hparams.learning_rate
        if self.hparams.reference_batch_size is not None:
            if self.hparams.global_batch_size is None:
                raise UserError("model.reference_batch_size needs model.global_batch_size (linked from data)")
            lr *= self.hparams.global_batch_size / self.hparams.reference_batch_size
        return lr

    def describe(self) -> str:
        """One line on the model: its size, shape and parameter count (counted on the meta device, so before and
        without building it)."""
        with torch.device("meta"):
            parameters = GPT(self.config).num_parameters()
        c = self.config
        return (f"GPT '{self.hparams.model_name}', {c.n_layer} layers x {c.n_head} heads, width {c.n_embd}, context "
                f"{c.block_size}, vocabulary {c.vocab_size}: {parameters:,} parameters ({parameters * 4 / 2**20:,.1f} "
                "MiB in float32)")

    def configure_model(self) -> None:
        """Build the GPT on the meta device and let ``build_gpt`` parallelise, materialise and initialise it on
        this rank's device: under ModelParallelStrategy over its (data_parallel, tensor_parallel) mesh, under
        PipelineParallelStrategy only this rank's stages (two under the interleaved schedule, held together by one
        GPT so that names are the unsplit model's). With no Trainer (``load_from_checkpoint`` in a plain Python
        process calls this before loading the weights) it is built whole on the CPU."""
        if self.model is not None:  # Lightning calls this once per fit/validate/...; build once
            return
        trainer = self._trainer
        device = torch.device("cpu") if trainer is None else trainer.strategy.root_device
        if isinstance(trainer and trainer.strategy, FSDPStrategy):
            device = torch.device("cpu")  # FSDP (1) moves each unit to its GPU as it shards it
        plan = run_plan_of(self) if trainer is not None else None
        spans = [None]  # the whole model, or this rank's pipeline stages
        if plan is not None and plan.pipeline_parallel_size > 1:
            spans = rank_stages(self.config.n_layer, self.device_mesh, plan.stages_per_rank, plan.pipeline_layers)
        stages = [build_gpt(
            self.config,
            device=device,
            seed=self.hparams.seed,
            device_mesh=self.device_mesh,
            activation_checkpointing=self.hparams.activation_checkpointing,
            compile=self.hparams.compile,
            param_dtype=FSDP_PARAM_DTYPES.get(str(trainer.precision)) if trainer is not None else None,
            stage=span,
        ) for span in spans]
        self.model = stages[0] if len(stages) == 1 else merge_stages(stages)
        if spans[0] is not None:
            self.pipeline = Pipeline(stages, spans, self.device_mesh, device, plan.pipeline_schedule,
                                     plan.pipeline_microbatches)

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

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        plan = run_plan_of(self)
        if self.pipeline is not None:  # forward and backward of all stages, now; Lightning's backward is skipped
            if batch_idx % plan.accumulation == 0:  # the step's first micro-batch (see optimizer_zero_grad)
                self.optimizers().zero_grad()
            loss = self.pipeline.train_step(inputs, targets, plan.accumulation)
            if plan.ends_optimizer_step(batch_idx):
                self.pipeline.finish_gradients()
        else:
            logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        # once per optimizer step: a step's logged value is its last micro-batch's anyway, and each self.log
        # costs about a millisecond of Lightning bookkeeping
        if plan.ends_optimizer_step(batch_idx):
            self.log("train/loss", loss, prog_bar=True)
            self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Lightning's backward of the training step's loss; under a pipeline the schedule has run it already."""
        if self.pipeline is None:
            super().backward(loss, *args, **kwargs)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning zeroes the gradients between the step's first training_step and its backward, which would drop
        the gradients a pipeline's training_step has already made: then training_step zeroes them itself."""
        if self.pipeline is None:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._update_mean_loss(self.val_loss, batch)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._update_mean_loss(self.test_loss, batch)

    def on_validation_epoch_end(self) -> None:
        self._log_loss_and_perplexity("val", self.val_loss)

    def on_test_epoch_end(self) -> None:
        self._log_loss_and_perplexity("test", self.test_loss)

    def _update_mean_loss(self, metric: MeanMetric, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Token-weighted, so padding (IGNORE_INDEX) and uneven shards do not change the mean."""
        inputs, targets = batch
        if self.pipeline is not None:
            metric.update(*self.pipeline.eval_step(inputs, targets))
            return
        logits = self.model(inputs)
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        tokens = (targets != IGNORE_INDEX).sum()
        metric.update(loss_sum / tokens.clamp(min=1), weight=tokens)

    def _log_loss_and_perplexity(self, split: str, metric: MeanMetric) -> None:
        loss = metric.compute()  # a collective: every rank gets the mean over all ranks' tokens
        metric.reset()
        # already the same on every rank; sync_dist only tells Lightning so (an all-reduce of one number)
        self.log(f"{split}/loss", loss, prog_bar=True, sync_dist=True)
        self.log(f"{split}/perplexity", torch.exp(loss), sync_dist=True)

    def predict_step(self, prompt: torch.Tensor, batch_idx: int) -> dict[str, str]:
        return {"prompt": decode_bytes(prompt[0]), "completion": self.generate_text(prompt)}

    def generate_text(self, prompt: torch.Tensor) -> str:
        """Continue a (1, T) byte-level prompt and return the new text. Sampling is seeded, so every rank draws
        the same tokens: under sharded strategies generation is a collective all ranks run together."""
        was_training = self.model.training
        self.model.eval()
        generator = torch.Generator(device=self.device).manual_seed(self.hparams.seed)
        tokens = self.model.generate(
            prompt.to(self.device), self.hparams.max_new_tokens, self.hparams.temperature, self.hparams.top_k, generator
        )
        self.model.train(was_training)
        return decode_bytes(tokens[0, prompt.size(1) :])

    def configure_optimizers(self) -> dict[str, Any]:
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


def unscale_gradients(precision_plugin: Precision, optimizer: torch.optim.Optimizer) -> None:
    """Under fp16's grad scaler, divide the gradients by the loss scale before they are clipped, as torch's AMP
    recipe does. Lightning does this itself except for optimizers that unscale inside their step (fused AdamW);
    the scaler records that it is done, so the fused step then only skips a step with inf or NaN gradients."""
    scaler = getattr(precision_plugin, "scaler", None)  # MixedPrecision and FSDPPrecision under 16-mixed
    if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
        scaler.unscale_(optimizer)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """GPT-2 recipes decay only the weight matrices: never biases, norms or embeddings (the tied head included)."""
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


def decode_bytes(tokens: torch.Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")
