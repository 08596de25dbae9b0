"""The mixture-of-experts family (models/moe/network.py, models/moe/family.py): its named sizes are the published
ones, the router and experts compute what the architecture says token by token, capacity drops the choices it
should, the balance loss is Switch Transformer's, torch's FLOP count is the family's formula, and the doctor sizes
Mixtral on 8 GPUs. It trains under every layout as one process does in tests/test_moe_layouts.py."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from app.tools.doctor import main as doctor
from models.moe.family import MoELanguageModel
from models.moe.network import MOE_CONFIGS, MoE, MoEConfig, moe_config, moe_parameter_counts
from models.routed_experts import MoEFeedForward, moe_layers
from tests.helpers import CONFIG_DIR, process_state_kept

TINY = MoEConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, n_expert=4, top_k=2, expert_size=8, block_size=16,
                 vocab_size=32)


def random_layer(config: MoEConfig, seed: int = 0) -> MoEFeedForward:
    torch.manual_seed(seed)
    layer = MoEFeedForward(config.n_embd, config.n_expert, config.top_k, config.expert_size,
                           config.shared_expert_size, config.normalize_top_k, config.capacity_factor)
    for parameter in layer.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return layer


def test_the_named_sizes_have_the_published_parameter_counts() -> None:
    """Mixtral 8x7B (46.7B, 12.9B active) and Qwen3-30B-A3B (30.5B, 3.3B active), counted on the meta device and by
    the formula the doctor and the model line use."""
    expected = {"mixtral-8x7b": (46_702_792_704, 12_879_925_248), "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704)}
    for name, (total, active) in expected.items():
        with torch.device("meta"):
            counted = sum(parameter.numel() for parameter in MoE(MOE_CONFIGS[name]).parameters())
        assert counted == total
        assert moe_parameter_counts(MOE_CONFIGS[name]) == (total, active)


def naive_output(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over the router's logits, the top k renormalised, each chosen expert's SwiGLU output
    weighted by its probability; the shared expert's added."""
    experts, out = layer.experts, torch.zeros_like(x)
    probabilities = (x @ layer.router.weight.T).softmax(dim=-1)
    weights, chosen = probabilities.topk(layer.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    for b, t in [(b, t) for b in range(x.shape[0]) for t in range(x.shape[1])]:
        for weight, e in zip(weights[b, t], chosen[b, t]):
            v = x[b, t]
            hidden = F.silu(experts.gate_proj[e] @ v) * (experts.up_proj[e] @ v)
            out[b, t] += weight * (experts.down_proj[e] @ hidden)
        if layer.shared_expert is not None:
            out[b, t] += layer.shared_expert(x[b, t])
    return out


@pytest.mark.parametrize("shared", [0, 8], ids=["routed-only", "with-shared-expert"])
def test_each_token_gets_its_top_k_experts_weighted_by_their_renormalised_probabilities(shared: int) -> None:
    layer = random_layer(replace(TINY, shared_expert_size=shared))
    x = torch.randn(3, 7, TINY.n_embd, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(layer(x), naive_output(layer, x), atol=1e-5)
    assert layer.tokens_per_expert.sum() == 3 * 7 * TINY.top_k and layer.dropped_tokens == 0


def test_capacity_keeps_each_experts_first_choices_of_each_sequence() -> None:
    """With a capacity of 2 choices per expert per sequence (0.5 x 8 tokens x 2 choices / 4 experts), the choices
    the layer keeps are, counted by hand, each expert's first two in each sequence; a dropped choice adds nothing."""
    config = replace(TINY, capacity_factor=0.5)
    layer = random_layer(config)
    x = torch.randn(2, 8, TINY.n_embd, generator=torch.Generator().manual_seed(2))
    probabilities = (x @ layer.router.weight.T).softmax(dim=-1)
    weights, chosen = probabilities.topk(2, dim=-1)
    dropped, kept_weights = 0, torch.zeros_like(weights)
    for b in range(2):
        taken = [0] * 4
        for t in range(8):
            for j in range(2):
                e = int(chosen[b, t, j])
                if taken[e] < 2:
                    taken[e] += 1
                    kept_weights[b, t, j] = weights[b, t, j] / weights[b, t].sum()
                else:
                    dropped += 1
    expected = torch.zeros_like(x)
    for b, t, j in [(b, t, j) for b in range(2) for t in range(8) for j in range(2)]:
        e, v = int(chosen[b, t, j]), x[b, t]
        expert = layer.experts
        expected[b, t] += kept_weights[b, t, j] * (expert.down_proj[e] @ (F.silu(expert.gate_proj[e] @ v)
                                                                           * (expert.up_proj[e] @ v)))
    assert torch.allclose(layer(x), expected, atol=1e-5)
    assert dropped > 0 and layer.dropped_tokens == dropped
    assert torch.equal(layer.tokens_per_expert, torch.bincount(chosen.flatten(), minlength=4))


def test_the_balance_loss_is_one_for_an_even_router_and_grows_as_it_favours_experts() -> None:
    """E x sum_e (share of choices) x (mean probability): a zero router (all probabilities 1/E; topk then picks
    whichever, but the probabilities are even) gives exactly 1; a router that sends every token to the same experts
    gives more."""
    layer = random_layer(TINY)
    x = torch.randn(2, 8, TINY.n_embd, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(x)
    assert torch.allclose(layer.balance_loss, torch.tensor(1.0))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0] = 5.0  # logits of expert 0 large wherever the inputs' sum is positive
        layer.router.weight[1] = 4.0
    layer(x.abs())
    assert layer.balance_loss > 1.5


def test_the_training_loss_adds_the_weighted_balance_loss_of_every_layer() -> None:
    family = MoELanguageModel("debug", load_balance_coefficient=0.5)
    network = family.plain_network()
    for name, parameter in network.named_parameters():
        torch.nn.init.normal_(parameter, std=network.initial_std(name) or 0.02)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    loss, metrics = family.batch_metrics(network, (tokens, tokens))
    balance = torch.stack([layer.balance_loss for layer in moe_layers(network)])
    assert len(balance) == 2
    assert torch.allclose(loss, metrics["cross_entropy"] + 0.5 * balance.sum())
    family.eval()
    assert torch.equal(family.batch_metrics(network, (tokens, tokens))[0], metrics["cross_entropy"])


def test_torchs_flop_count_is_the_formula() -> None:
    """On the meta device the experts share the token choices evenly (there are no values to route by), so torch's
    count of the active experts' matmuls is the formula's 6 x active weights + attention."""
    family = MoELanguageModel("debug")
    assert family.flops_per_sample(64) == family.training_flops_per_token(64) * 64


def test_the_model_line_gives_total_and_active_parameters() -> None:
    line = MoELanguageModel("small").describe()
    assert "8 experts (2 per token)" in line and "2,430,080 parameters" in line and "808,064 active" in line


def test_a_capacity_factor_that_is_not_positive_is_refused() -> None:
    """By the network's config; the family says it in one line first (tests/test_families.py)."""
    with pytest.raises(ValueError, match="capacity_factor=0 must be positive"):
        moe_config("debug", capacity_factor=0)


def test_the_doctor_answers_whether_mixtral_fits_8_gpus_of_80_gb_under_fsdp2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixtral 8x7B on 8 GPUs of 80 GB, FSDP2 (model_parallel_gpu_bf16), activation checkpointing, 4,096 tokens per
    sample: it does not fit. By hand: bf16-mixed keeps float32 weights, so weights, gradients and AdamW's two moments
    are 16 bytes per parameter, 46,702,792,704 x 16 / 8 = 87.0 GiB per GPU before any activation. On 16 GPUs, which
    the doctor advises, those are 43.5 GiB, plus 10.1 of activations (measured on the meta device, where the experts
    share the tokens evenly: without a capacity every choice is computed, whatever expert takes it), 11.3 of gathered
    FSDP units (the 262,148,096 parameters outside the blocks and the running and the prefetched block of
    1,451,270,144 in bfloat16, one block's float32 gradients: 0.5 + 5.4 + 5.4), the CUDA context's 1.0 and a tenth of
    all but it for fragmentation: 72.3 GiB, which fits. The model line counts all and active parameters. This machine
    has no GPU and the recipe's embedded data is byte-level, so the doctor fails those checks; the memory line is the
    point."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit), process_state_kept():
        doctor(["-c", str(CONFIG_DIR / "moe-small/pretrain.yaml"), "-c",
                str(CONFIG_DIR / "trainer/model_parallel_gpu_bf16.yaml"), "--model.model_name", "mixtral-8x7b",
                "--model.activation_checkpointing", "true", "--data.vocab_size", "32000", "--data.sequence_length",
                "4096", "--data.global_batch_size", "8", "--data.micro_batch_size", "1", "--device_memory", "80GiB"])
    output = capsys.readouterr().out
    assert "46,702,792,704 parameters (174.0 GiB in float32), 12,879,925,248 active per token" in output
    line = next(line for line in output.splitlines() if " memory " in line)
    needed = float(re.search(r"needs ([0-9.]+) GiB", line).group(1))
    assert line.startswith("FAIL") and needed > 46_702_792_704 * 16 / 8 / 2**30, line
    on_16 = float(re.search(r"FSDP over 16 data-parallel ranks \(([0-9.]+) GiB, fits\)", line).group(1))
    assert 46_702_792_704 * 16 / 16 / 2**30 < on_16 < 80, line
