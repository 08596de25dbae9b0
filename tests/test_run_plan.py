"""Batch arithmetic, precision checks, learning-rate schedule and scaling."""

from __future__ import annotations

import math

import pytest
import torch

from app.run_plan import gradient_accumulation, resolve_precision
from core.errors import UserError
from models.gpt import GPT, GPT_CONFIGS
from models.language_model import GPTLanguageModel, warmup_cosine_schedule, weight_decay_groups


@pytest.mark.parametrize(("world_size", "micro", "expected"), [(1, 4, 8), (2, 4, 4), (8, 4, 1), (4, 2, 4)])
def test_accumulation_keeps_the_global_batch(world_size: int, micro: int, expected: int) -> None:
    assert gradient_accumulation(32, micro, world_size) == expected
    assert expected * micro * world_size == 32


def test_non_dividing_batch_names_every_number() -> None:
    with pytest.raises(UserError) as error:
        gradient_accumulation(global_batch_size=30, micro_batch_size=4, world_size=4, num_nodes=2)
    message = str(error.value)
    assert "global_batch_size=30" in message and "micro_batch_size=4" in message
    assert "4 processes (2 devices x 2 nodes) = 16" in message and "\n" not in message


def test_precision_aliases_and_cpu_rules() -> None:
    assert resolve_precision(None, "cpu") == "32-true"
    assert resolve_precision("bf16", "cpu") == "bf16-mixed"
    assert resolve_precision("16-mixed", "cpu") == "bf16-mixed"  # Lightning does this too, we say so plainly
    with pytest.raises(UserError, match="16-true"):
        resolve_precision("16-true", "cpu")
    with pytest.raises(UserError, match="not supported"):
        resolve_precision("fp8", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_gpu_precision_without_a_gpu_is_refused() -> None:
    with pytest.raises(UserError, match="no CUDA GPU is visible"):
        resolve_precision("bf16-mixed", "gpu")


def test_warmup_then_cosine_to_the_floor() -> None:
    schedule = warmup_cosine_schedule(warmup_steps=10, decay_steps=110, min_ratio=0.1)
    assert schedule(0) == pytest.approx(0.1) and schedule(9) == pytest.approx(1.0)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert schedule(110) == pytest.approx(0.1) and schedule(1000) == pytest.approx(0.1)


def test_linear_lr_scaling_rule() -> None:
    model = GPTLanguageModel("debug", learning_rate=1e-3, global_batch_size=64, reference_batch_size=16)
    assert model.effective_learning_rate == pytest.approx(4e-3)
    assert GPTLanguageModel("debug", learning_rate=1e-3, global_batch_size=64).effective_learning_rate == 1e-3


def test_no_weight_decay_on_biases_norms_and_embeddings() -> None:
    model = GPT(GPT_CONFIGS["debug"])
    decay, no_decay = weight_decay_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("weight") and "ln" not in names[id(p)] for p in decay["params"])
    assert {"wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.attn.qkv.bias"} <= {names[id(p)] for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_unknown_model_name_lists_the_known_ones() -> None:
    with pytest.raises(UserError, match="unknown model.model_name 'gpt5'.*gpt2-medium"):
        GPTLanguageModel("gpt5")
