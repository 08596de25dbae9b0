"""The LightningModules that train next-token language models: what every such family shares (the loss, the
validation and test loss and perplexity, generation) and the GPT family (models/llama_language_model.py holds the
Llama family)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from jsonargparse import Namespace
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics import MeanMetric

from core.errors import UserError, check_ranges
from core.run_plan import RunPlan
from core.seeding import DEFAULT_SEED
from core.tokens import IGNORE_INDEX
from models.gpt import GPT, GPTConfig, gpt_config, training_flops_per_token
from models.module import CohortModule
from models.optimizer import OptimizerSettings
from models.parallel.parallelize import TensorParallelPlan, build_network, check_tensor_parallel_size
from models.parallel.pipeline import PipelineSplit, StageSpan, check_stages_have_blocks, keep_stage
from models.pretrained import HuggingFaceFolder, check_pretrained, weight_reader

# Megatron-style: the first projection of attention and of the MLP split by output columns (whole heads, thanks to
# GPT's head-interleaved qkv layout), the second by input rows, so each block needs one all-reduce forward and one
# backward per sub-layer. Embeddings, norms and the tied head stay replicated
GPT_TENSOR_PARALLEL_PLAN: TensorParallelPlan = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
                                               "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
# the first stage turns token ids into hidden states, the last the final hidden states into logits; the last stage
# also keeps the token embedding, which its output head shares
GPT_PIPELINE_SPLIT = PipelineSplit(first=("wte", "wpe", "drop"), last=("ln_f", "lm_head"), embed=GPT.embed,
                                   head=GPT.head)


class CausalLanguageModel(CohortModule):
    """A family that predicts each next token. Its ``config`` (``named_config``'s) has n_layer, n_head,
    block_size and vocab_size; its network maps token ids (B, T) to logits and has ``generate``."""

    commands = ("fit", "validate", "test", "predict")  # test: the loss on val.bin; predict continues prompts
    label = "language model"  # what ``describe`` calls the family

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
            check_pretrained(HuggingFaceFolder(model.init_from), config, model.model_name)

    def pretrained_weights(self) -> Callable[[str], torch.Tensor] | None:
        if self.hparams.init_from is None:
            return None
        return weight_reader(HuggingFaceFolder(self.hparams.init_from), self.config)

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


class GPTLanguageModel(CausalLanguageModel):
    label = "GPT"

    def __init__(
        self,
        model_name: str = "small",
        vocab_size: int | None = None,
        init_from: str | None = None,
        dropout: float = 0.0,
        max_new_tokens: int = 200,
        temperature: float = 0.8,
        top_k: int | None = 40,
        activation_checkpointing: bool = False,
        compile: bool = False,
        optimizer: OptimizerSettings = OptimizerSettings(),
        seed: int = DEFAULT_SEED,
    ) -> None:
        """
        Args:
            model_name: a size from models.gpt.GPT_CONFIGS ("debug", "small", "gpt2", ...).
            vocab_size: overrides the size's vocabulary; the CLI links it to data.vocab_size.
            init_from: a local Hugging Face folder (config.json, model.safetensors or its shards) of this size whose
                weights the run starts from (models/pretrained.py); None: initial weights from the seed.
            dropout: dropout probability in embeddings, attention and MLP.
            max_new_tokens: tokens generated per prompt by ``predict``.
            temperature: sampling temperature for generation.
            top_k: sample among the k most likely tokens only; None samples from all.
            activation_checkpointing: recompute each block's activations in backward instead of keeping them.
            compile: torch.compile each Transformer block.
            optimizer: AdamW and its schedule (models/optimizer.py); a field given keeps the others' defaults.
            seed: the initial weights and generation's sampling follow from it; the CLI links it to seed_everything.
        """
        super().__init__(optimizer, max_new_tokens, temperature, top_k)
        self.save_hyperparameters()
        check_ranges("model", {"dropout": (0 <= dropout < 1, "in [0, 1)")}, locals())
        self.config = gpt_config(model_name, vocab_size=vocab_size, dropout=dropout)

    # ----- the family's part of CohortModule -----
    def plain_network(self) -> GPT:
        return GPT(self.config)

    def training_flops_per_token(self, sequence_length: int) -> float:
        return training_flops_per_token(self.config, sequence_length)

    @classmethod
    def named_config(cls, model_name: str, vocab_size: int | None) -> GPTConfig:
        return gpt_config(model_name, vocab_size=vocab_size)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        return GPT_TENSOR_PARALLEL_PLAN

    def pipeline_split(self) -> PipelineSplit:
        return GPT_PIPELINE_SPLIT


def decode_bytes(tokens: torch.Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def build_gpt(config: GPTConfig, device: torch.device, seed: int, device_mesh: DeviceMesh | None = None,
              stage: StageSpan | None = None, **options: Any) -> GPT:
    """A GPT (or one pipeline ``stage`` of it) built outside Lightning, as ``GPTLanguageModel`` builds it:
    ``options`` are ``models.parallel.parallelize.build_network``'s (device_mesh, activation_checkpointing, ...)."""
    def make_network() -> GPT:
        return GPT(config)

    cut = None
    if stage is not None:
        paths = [f"blocks.{index}" for index in range(config.n_layer)]
        cut = partial(keep_stage, split=GPT_PIPELINE_SPLIT, paths=paths, span=stage)
    return build_network(make_network, device, seed, device_mesh, tensor_parallel_plan=GPT_TENSOR_PARALLEL_PLAN,
                         keep_stage=cut, **options)
