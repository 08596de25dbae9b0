"""The mixture-of-experts family: the LightningModule that trains models/moe/network.py's decoder, what every
next-token family shares (models/causal_language_model.py) plus the routers' load-balancing loss, with the sizes,
the tensor-parallel plan (attention and the shared expert; the routed experts stay whole on each tensor-parallel rank)
Llama's pipeline split, where each stage adds its own routers' balance loss, and the balance loss it logs. The
monitor logs the routing per step (expert load, dropped tokens): app/observability/routing.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from jsonargparse import Namespace

from core.errors import UserError, check_ranges
from core.run_plan import RunPlan
from core.seeding import DEFAULT_SEED
from core.tokens import IGNORE_INDEX
from models.causal_language_model import CausalLanguageModel
from models.llama.family import LLAMA_PIPELINE_SPLIT
from models.moe.huggingface import MOE_HUGGING_FACE
from models.moe.network import MoE, MoEConfig, moe_config, moe_parameter_counts, moe_training_flops_per_token
from models.optimizer import OptimizerSettings
from models.parallel.parallelize import TensorParallelPlan
from models.parallel.pipeline import PipelineSplit
from models.routed_experts import moe_layers

MOE_TENSOR_PARALLEL_PLAN: TensorParallelPlan = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.shared_expert.gate_proj": "colwise", "layers.*.mlp.shared_expert.up_proj": "colwise",
    "layers.*.mlp.shared_expert.down_proj": "rowwise",
}


class MoELanguageModel(CausalLanguageModel):
    label = "MoE"
    huggingface = MOE_HUGGING_FACE
    routes_to_experts = True

    def __init__(
        self,
        model_name: str = "small",
        vocab_size: int | None = None,
        capacity_factor: float | None = None,
        load_balance_coefficient: float | None = None,
        init_from: str | None = None,
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
            model_name: a size from models.moe.network.MOE_CONFIGS ("debug", "debug-qwen3", "small",
                "mixtral-8x7b", "qwen3-30b-a3b").
            vocab_size: overrides the size's vocabulary; the CLI links it to data.vocab_size.
            capacity_factor: token choices each expert takes per sequence, as a multiple of an even share (1.25:
                a quarter more); the rest are dropped and counted. None: the size's (none of them drops).
            load_balance_coefficient: weight of the routers' load-balancing loss in the training loss; None: the
                size's (0.01; Mixtral's 0.02, Qwen3's 0.001).
            init_from: a local Hugging Face folder of this size, Mixtral's or Qwen3-MoE's (models/moe/huggingface.py),
                whose weights the run starts from; None: initial weights from the seed.
            max_new_tokens: tokens generated per prompt by ``predict``.
            temperature: sampling temperature for generation.
            top_k: sample among the k most likely tokens only; None samples from all (the router's top-k is the
                size's ``top_k``).
            activation_checkpointing: recompute each block's activations in backward instead of keeping them.
            compile: torch.compile each Transformer block.
            optimizer: AdamW and its schedule (models/optimizer.py); a field given keeps the others' defaults.
            seed: the initial weights and generation's sampling follow from it; the CLI links it to seed_everything.
        """
        super().__init__(optimizer, max_new_tokens, temperature, top_k)
        check_ranges("model", {
            "capacity_factor": (capacity_factor is None or capacity_factor > 0, "> 0, or null to drop no choice"),
            "load_balance_coefficient": (load_balance_coefficient is None or load_balance_coefficient >= 0, ">= 0"),
        }, locals())
        self.save_hyperparameters()
        self.config = moe_config(model_name, vocab_size=vocab_size, capacity_factor=capacity_factor,
                                 load_balance_coefficient=load_balance_coefficient)

    @classmethod
    def named_config(cls, model_name: str, vocab_size: int | None) -> MoEConfig:
        return moe_config(model_name, vocab_size=vocab_size)

    @classmethod
    def check_config(cls, model: Namespace, data: Namespace, plan: RunPlan) -> None:
        """The language model's checks, and experts that split evenly over the expert-parallel ranks."""
        super().check_config(model, data, plan)
        n_expert = cls.named_config(model.model_name, data.vocab_size).n_expert
        if n_expert % plan.expert_parallel_size != 0:
            raise UserError(f"trainer.strategy.init_args.expert_parallel_size={plan.expert_parallel_size} does not "
                            f"divide the {n_expert} experts of model '{model.model_name}': choose a divisor")

    @staticmethod
    def sharded_head_counts(config: MoEConfig) -> tuple[int, ...]:
        return (config.n_head, config.n_kv_head)

    def plain_network(self) -> MoE:
        return MoE(self.config)

    def training_flops_per_token(self, sequence_length: int) -> float:
        return moe_training_flops_per_token(self.config, sequence_length)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        return MOE_TENSOR_PARALLEL_PLAN

    def pipeline_split(self) -> PipelineSplit:
        """Llama's: the network is Llama's with other blocks. The balance loss of a stage's routers reaches the
        training loss through that stage's own backward (models/parallel/pipeline.py), not through the last stage's
        loss, which never sees it."""
        return replace(LLAMA_PIPELINE_SPLIT, auxiliary_loss=self.balance_term)

    def balance_term(self, network: nn.Module) -> torch.Tensor | None:
        """``load_balance_coefficient`` x the balance loss of the network's last forward, summed over its MoE layers
        (Switch Transformer's sum); None for a network (a pipeline stage) without one."""
        layers = moe_layers(network)
        if not layers:
            return None
        return self.config.load_balance_coefficient * torch.stack([layer.balance_loss for layer in layers]).sum()

    def describe(self) -> str:
        c = self.config
        total, active = moe_parameter_counts(c)
        return (f"{self.label} '{self.hparams.model_name}', {c.n_layer} layers x {c.n_head} heads, width {c.n_embd}, "
                f"{c.n_expert} experts ({c.top_k} per token), context {c.block_size}, vocabulary {c.vocab_size}: "
                f"{self.parameters_and_size()}, {active:,} active per token")

    def batch_metrics(self, network: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                      ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The next-token loss plus ``load_balance_coefficient`` x the balance loss summed over the layers (Switch
        Transformer's sum) in training; the next-token loss alone in evaluation, where nothing learns from the
        balance. Metrics: the cross-entropy apart and the balance loss (mean over layers)."""
        inputs, targets = batch
        logits = self.float_in_evaluation(network(inputs))
        cross_entropy = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        if not self.training:
            return cross_entropy, {}
        balance = torch.stack([layer.balance_loss for layer in moe_layers(network)])
        return cross_entropy + self.balance_term(network), {"cross_entropy": cross_entropy,
                                                            "balance_loss": balance.mean()}

    def batch_loss(self, network: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.batch_metrics(network, batch)[0]
