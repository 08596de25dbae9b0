"""What every family that predicts the next token shares (GPT, models/gpt/; Llama, models/llama/): the loss, the
test loss and perplexity (validation's are models/module.py's), generation, the checks of a named size against the
run and of a Hugging Face folder to start from."""

from __future__ import annotations

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


class CausalLanguageModel(CohortModule):
    """A family that predicts each next token. Its ``config`` (``named_config``'s) has n_layer, n_head,
    block_size and vocab_size; its network maps token ids (B, T) to logits and has ``generate``."""

    commands = ("fit", "validate", "test", "predict")  # test: the loss on val.bin; predict continues prompts
    label = "language model"
    logs_perplexity = True
    huggingface: ClassVar[HuggingFaceAdapter]  # both families read (model.init_from) and write Hugging Face folders

    def __init__(self, optimizer: OptimizerSettings, max_new_tokens: int, temperature: float,
                 top_k: int | None) -> None:
        super().__init__(optimizer)
        check_ranges("model", {
            "max_new_tokens": (max_new_tokens >= 0, ">= 0"),
            "temperature": (temperature > 0, "> 0"),
            "top_k": (top_k is None or top_k >= 1, ">= 1, or null to sample from all tokens"),
        }, {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k})
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
        logits = self.float_in_evaluation(network(inputs))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    @classmethod
    def check_config(cls, model: Namespace, data: Namespace, plan: RunPlan) -> None:
        """The pipeline split, the tensor-parallel heads (query and key/value) and the context against the named
        size."""
        config = cls.named_config(model.model_name, data.vocab_size)
        name = f"model '{model.model_name}'"
        cls.check_layers_and_heads(plan, config.n_layer, cls.sharded_head_counts(config), name)
        if data.sequence_length > config.block_size:
            raise UserError(f"data.sequence_length={data.sequence_length} exceeds the block_size {config.block_size} "
                            f"of {name}: shorten the sequences or pick a larger model")
        if model.init_from is not None:
            cls.huggingface.check_pretrained(HuggingFaceFolder(model.init_from), config, model.model_name)

    def describe(self) -> str:
        """One line on the model: its size, shape and parameter count (counted on the meta device, so before and
        without building it)."""
        c = self.config
        return (f"{self.label} '{self.hparams.model_name}', {c.n_layer} layers x {c.n_head} heads, width {c.n_embd}, "
                f"context {c.block_size}, vocabulary {c.vocab_size}: {self.parameters_and_size()}")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """As validation's (token-weighted, so padding and uneven shards do not change the mean), on the test data."""
        self.accumulate(batch, self.test_loss, {})  # a language model has no metrics besides its loss

    def on_test_epoch_end(self) -> None:
        self.log_evaluation("test", self.test_loss, {})

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
