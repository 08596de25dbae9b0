"""What every family that predicts the next token shares (GPT, models/gpt/; Llama, models/llama/): the loss, the
validation and test loss and perplexity, generation, the checks of a named size against the run, and weights from
a Hugging Face folder through the family's adapter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MeanMetric

from core.errors import UserError, check_ranges
from core.run_plan import RunPlan
from core.tokens import IGNORE_INDEX
from models.interchange import HuggingFaceAdapter, HuggingFaceFolder
from models.module import CohortModule
from models.optimizer import OptimizerSettings
from models.parallel.parallelize import check_tensor_parallel_size
from models.parallel.pipeline import check_stages_have_blocks


class CausalLanguageModel(CohortModule):
    """A family that predicts each next token. Its ``config`` (``named_config``'s) has n_layer, n_head,
    block_size and vocab_size; its network maps token ids (B, T) to logits and has ``generate``."""

    commands = ("fit", "validate", "test", "predict")  # test: the loss on val.bin; predict continues prompts
    label = "language model"
    huggingface: ClassVar[HuggingFaceAdapter]  # both families read (model.init_from) and write Hugging Face folders

    def __init__(self, optimizer: OptimizerSettings, max_new_tokens: int, temperature: float,
                 top_k: int | None) -> None:
        super().__init__(optimizer)
        check_ranges("model", {
            "max_new_tokens": (max_new_tokens >= 0, ">= 0"),
            "temperature": (temperature > 0, "> 0"),
            "top_k": (top_k is None or top_k >= 1, ">= 1, or null to sample from all tokens"),
        }, {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k})
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()

    @classmethod
    def named_config(cls, model_name: str, vocab_size: int | None) -> Any:
        """The family's config of the named size, with its vocabulary where given; a UserError for an unknown
        name."""
        raise NotImplementedError

    @staticmethod
    def sharded_head_counts(config: Any) -> tuple[int, ...]:
        """The head counts that tensor parallelism divides among its ranks."""
        return (config.n_head,)

    def training_flops_per_token(self, sequence_length: int) -> float:
        """The family's formula for training FLOPs per token (6N + 12·L·H·Q·T), which torch's count is checked
        against."""
        raise NotImplementedError

    def flops_per_sample(self, sequence_length: int) -> float:
        """torch's count, checked against the family's formula."""
        counted = super().flops_per_sample(sequence_length)
        formula = self.training_flops_per_token(sequence_length) * sequence_length
        if abs(counted - formula) > 0.05 * formula:
            rank_zero_warn(f"FLOP count {counted:.4g}/sample differs from 6N + 12LHQT = {formula:.4g}")
        return counted

    def batch_loss(self, network: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(network(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    @classmethod
    def check_config(cls, model: Namespace, data: Namespace, plan: RunPlan) -> None:
        """The pipeline split, the tensor-parallel heads (query and key/value) and the context against the named
        size."""
        config = cls.named_config(model.model_name, data.vocab_size)
        name = f"model '{model.model_name}'"
        check_stages_have_blocks(plan, config.n_layer, name)
        try:
            for heads in cls.sharded_head_counts(config):
                check_tensor_parallel_size(heads, plan.tensor_parallel_size)
        except ValueError as error:
            raise UserError(f"{error} ({name})") from None
        if data.sequence_length > config.block_size:
            raise UserError(f"data.sequence_length={data.sequence_length} exceeds the block_size {config.block_size} "
                            f"of {name}: shorten the sequences or pick a larger model")
        if model.init_from is not None:
            cls.huggingface.check_pretrained(HuggingFaceFolder(model.init_from), config, model.model_name)

    def pretrained_weights(self) -> Callable[[str], torch.Tensor] | None:
        if self.hparams.init_from is None:
            return None
        return self.huggingface.weight_reader(HuggingFaceFolder(self.hparams.init_from), self.config)

    def describe(self) -> str:
        """One line on the model: its size, shape and parameter count (counted on the meta device, so before and
        without building it)."""
        parameters = self.num_parameters()
        c = self.config
        return (f"{self.label} '{self.hparams.model_name}', {c.n_layer} layers x {c.n_head} heads, width {c.n_embd}, "
                f"context {c.block_size}, vocabulary {c.vocab_size}: {parameters:,} parameters "
                f"({parameters * 4 / 2**20:,.1f} MiB in float32)")

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


def decode_bytes(tokens: torch.Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")
