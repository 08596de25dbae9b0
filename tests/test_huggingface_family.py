"""A Hugging Face model as a family of one's own: ``LlamaForCausalLM`` from a small config (no download), wrapped
in the three methods and a tensor-parallel plan, trains under DDP, FSDP2 and tensor parallelism as one process does.
Runs where ``transformers`` is installed (``pip install -e '.[hf]'``; .ci/run does, after the main suite)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from core.tokens import IGNORE_INDEX
from models.module import CohortModule
from models.optimizer import OptimizerSettings
from models.parallel.parallelize import TensorParallelPlan
from tests.helpers import DDP_2, MODEL_PARALLEL, assert_comparable_runs_agree, fit

transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")

pytestmark = pytest.mark.slow


class TinyLlama(CohortModule):
    """Llama's architecture (RMSNorm, rotary positions, SwiGLU, grouped-query attention) at a test's size."""

    def __init__(self, vocab_size: int = 256, optimizer: OptimizerSettings = OptimizerSettings()) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()

    def plain_network(self) -> nn.Module:
        config = transformers.LlamaConfig(vocab_size=self.hparams.vocab_size, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(config)

    def batch_loss(self, network: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = network(input_ids=inputs).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        # Megatron-style, as torchtitan splits Llama: whole query and key-value heads per rank
        return {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
                "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise"}


def llama(comparable_run_args: list[str]) -> list[str]:
    args = list(comparable_run_args)
    at = args.index("--model.model_name")
    del args[at:at + 2]
    return ["--model", "tests.test_huggingface_family.TinyLlama", *args]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> Path:
    return fit(tmp_path_factory.mktemp("llama"), llama(comparable_run_args))


@pytest.mark.parametrize("layout", [
    DDP_2, MODEL_PARALLEL,
    [*MODEL_PARALLEL, "--trainer.strategy.init_args.data_parallel_size", "1",
     "--trainer.strategy.init_args.tensor_parallel_size", "2"],
], ids=["ddp", "fsdp2", "tensor-parallel"])
def test_a_llama_trains_as_one_process_does(tmp_path: Path, comparable_run_args: list[str], one_process: Path,
                                            layout: list[str]) -> None:
    assert_comparable_runs_agree(one_process, fit(tmp_path, llama(comparable_run_args), *layout))
