"""The GPT module: GPT-2 sizes, shapes, weight tying, initialisation."""

from __future__ import annotations

import math

import pytest
import torch

from models.gpt.family import build_gpt
from models.gpt.network import GPT, GPT_CONFIGS, gpt_config


def test_gpt2_has_exactly_124_439_808_parameters() -> None:
    with torch.device("meta"):  # no memory, no init cost
        model = GPT(GPT_CONFIGS["gpt2"])
    assert model.num_parameters() == 124_439_808


@pytest.mark.parametrize("name", sorted(GPT_CONFIGS))
def test_every_named_size_builds(name: str) -> None:
    with torch.device("meta"):
        model = GPT(GPT_CONFIGS[name])
    assert model.num_parameters() > 0


def test_largest_size_is_multi_billion() -> None:
    with torch.device("meta"):
        assert max(GPT(config).num_parameters() for config in GPT_CONFIGS.values()) > 2e9


def test_forward_and_backward_shapes() -> None:
    config = GPT_CONFIGS["debug"]
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, config.vocab_size)
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_output_head_is_tied_to_the_token_embedding() -> None:
    model = GPT(GPT_CONFIGS["debug"])
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()


def test_residual_projections_get_the_scaled_init() -> None:
    config = gpt_config("small", n_embd=256)
    model = build_gpt(config, torch.device("cpu"), seed=0)
    expected = 0.02 / math.sqrt(2 * config.n_layer)
    for block in model.blocks.values():
        assert block.attn.proj.weight.std().item() == pytest.approx(expected, rel=0.05)
        assert block.mlp.proj.weight.std().item() == pytest.approx(expected, rel=0.05)
        assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert torch.all(block.ln_1.weight == 1) and torch.all(block.attn.qkv.bias == 0)


def test_the_seed_alone_decides_the_initial_weights() -> None:
    config = GPT_CONFIGS["debug"]
    first, again, other = (build_gpt(config, torch.device("cpu"), seed) for seed in (1, 1, 2))
    torch.manual_seed(123)  # the global generator plays no part
    wrapped = build_gpt(config, torch.device("cpu"), 1, activation_checkpointing=True)
    assert first.lm_head.weight is first.wte.weight  # still tied after materialising from the meta device
    for name, weight in first.state_dict().items():
        assert torch.equal(weight, again.state_dict()[name]) and torch.equal(weight, wrapped.state_dict()[name])
    assert not torch.equal(first.wte.weight, other.wte.weight)


def test_attention_is_causal() -> None:
    model = GPT(GPT_CONFIGS["debug"]).eval()
    idx = torch.randint(0, 256, (1, 10))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    torch.testing.assert_close(model(idx)[:, :-1], model(changed)[:, :-1])


def test_longer_than_block_size_is_refused() -> None:
    model = GPT(GPT_CONFIGS["debug"])
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        model(torch.zeros(1, GPT_CONFIGS["debug"].block_size + 1, dtype=torch.long))


def test_generate_extends_the_prompt() -> None:
    model = GPT(GPT_CONFIGS["debug"]).eval()
    out = model.generate(torch.zeros(1, 70, dtype=torch.long), max_new_tokens=5, top_k=10)
    assert out.shape == (1, 75)
