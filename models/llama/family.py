"""The Llama family: the LightningModule that trains a Llama (models/llama/network.py): what every next-token family
shares (models/causal_language_model.py), with Llama's sizes, its tensor-parallel plan and its pipeline split."""

from __future__ import annotations

from core.seeding import DEFAULT_SEED
from models.causal_language_model import CausalLanguageModel
from models.llama.huggingface import LLAMA_HUGGING_FACE
from models.llama.network import Llama, LlamaConfig, llama_config, llama_training_flops_per_token
from models.optimizer import OptimizerSettings
from models.parallel.parallelize import TensorParallelPlan
from models.parallel.pipeline import PipelineSplit

# Megatron-style, as the GPT's: the query, key and value projections and the MLP's gate and up projections split by
# output columns (whole heads: key/value heads too, so each rank keeps its query heads' groups), the output and down
# projections by input rows; embeddings, norms and the head stay replicated
LLAMA_TENSOR_PARALLEL_PLAN: TensorParallelPlan = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}
# the first stage embeds the token ids, the last normalises and projects to logits (and keeps the embedding too
# where the head is tied to it)
LLAMA_PIPELINE_SPLIT = PipelineSplit(first=("embed_tokens",), last=("norm", "lm_head"), embed=Llama.embed,
                                     head=Llama.head)


class LlamaLanguageModel(CausalLanguageModel):
    label = "Llama"
    huggingface = LLAMA_HUGGING_FACE

    def __init__(
        self,
        model_name: str = "small",
        vocab_size: int | None = None,
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
            model_name: a size from models.llama.network.LLAMA_CONFIGS ("debug", "small", "1b", "8b").
            vocab_size: overrides the size's vocabulary; the CLI links it to data.vocab_size.
            init_from: a local Hugging Face folder (config.json, model.safetensors or its shards) of this size whose
                weights the run starts from (models/llama/huggingface.py); None: initial weights from the seed.
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
        self.config = self.named_config(model_name, vocab_size)

    @classmethod
    def named_config(cls, model_name: str, vocab_size: int | None) -> LlamaConfig:
        return llama_config(model_name, vocab_size=vocab_size)

    @staticmethod
    def sharded_head_counts(config: LlamaConfig) -> tuple[int, ...]:
        return (config.n_head, config.n_kv_head)

    def plain_network(self) -> Llama:
        return Llama(self.config)

    def training_flops_per_token(self, sequence_length: int) -> float:
        return llama_training_flops_per_token(self.config, sequence_length)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        return LLAMA_TENSOR_PARALLEL_PLAN

    def pipeline_split(self) -> PipelineSplit:
        return LLAMA_PIPELINE_SPLIT
