"""The GPT family: the LightningModule that trains a GPT (models/gpt/network.py) on next-token prediction, with
GPT's named sizes, its tensor-parallel plan and its pipeline split; what it shares with Llama is
models/causal_language_model.py's."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from core.errors import check_ranges
from core.seeding import DEFAULT_SEED
from models.causal_language_model import CausalLanguageModel
from models.gpt.huggingface import GPT_HUGGING_FACE
from models.gpt.network import GPT, GPTConfig, gpt_config, training_flops_per_token
from models.optimizer import OptimizerSettings
from models.parallel.parallelize import TensorParallelPlan, build_network
from models.parallel.pipeline import PipelineSplit, StageSpan, keep_stage

# Megatron-style: the first projection of attention and of the MLP split by output columns (whole heads, thanks to
# GPT's head-interleaved qkv layout), the second by input rows, so each block needs one all-reduce forward and one
# backward per sub-layer. Embeddings, norms and the tied head stay replicated
GPT_TENSOR_PARALLEL_PLAN: TensorParallelPlan = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
                                               "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
# the first stage turns token ids into hidden states, the last the final hidden states into logits; the last stage
# also keeps the token embedding, which its output head shares
GPT_PIPELINE_SPLIT = PipelineSplit(first=("wte", "wpe", "drop"), last=("ln_f", "lm_head"), embed=GPT.embed,
                                   head=GPT.head)


class GPTLanguageModel(CausalLanguageModel):
    label = "GPT"
    huggingface = GPT_HUGGING_FACE

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
            model_name: a size from models.gpt.network.GPT_CONFIGS ("debug", "small", "gpt2", ...).
            vocab_size: overrides the size's vocabulary; the CLI links it to data.vocab_size.
            init_from: a local Hugging Face folder (config.json, model.safetensors or its shards) of this size whose
                weights the run starts from (models/gpt/huggingface.py); None: initial weights from the seed.
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
