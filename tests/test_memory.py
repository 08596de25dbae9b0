"""app/tools/memory.py: exact state bytes per layout, activations measured on the meta device (against a real CPU
forward for the autocast emulation), and the fits / does-not-fit answer. All fast: nothing real is allocated
beyond the debug-sized models."""

from __future__ import annotations


import pytest
import torch

from app.tools.memory import estimate_memory, parse_memory_size, visible_device_memory
from app.tools.memory_profile import module_step_loss, next_token_loss, profile_network, storage_key
from core.errors import UserError
from core.sizes import GIB
from models.bert.family import BertMaskedLanguageModel
from models.gpt.network import GPT, GPTConfig, gpt_config
from models.module import CohortModule
from models.parallel.parallelize import repeated_blocks
from models.resnet.family import ImageClassifier

GPT2 = gpt_config("gpt2")
GPT2_PARAMETERS = 124_439_808
SMALL = gpt_config("small")  # 4 blocks of width 128, context 128, byte vocabulary


def gpt2_estimate(**layout: object):
    return estimate_memory(lambda: GPT(GPT2), next_token_loss(64, GPT2.vocab_size), 1, device_type="cpu",
                           advise=False, **layout)


def small_estimate(micro_batch_size: int = 4, **layout: object):
    return estimate_memory(lambda: GPT(SMALL), next_token_loss(SMALL.block_size, SMALL.vocab_size), micro_batch_size,
                           device_type="cpu", advise=False, **layout)


def resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_gpt2_state_is_exact_and_costs_nothing_to_estimate() -> None:
    before = resident_bytes()
    estimate = gpt2_estimate(strategy="ddp", data_parallel_size=8)
    # the cost, in memory rather than in seconds (a busy machine's clock says nothing): no real model was built
    assert resident_bytes() - before < 100 * 2**20  # the real model would take 475 MiB of parameters alone
    assert estimate.parameters == GPT2_PARAMETERS * 4
    assert estimate.gradients == GPT2_PARAMETERS * 4
    assert estimate.optimizer_state == GPT2_PARAMETERS * 8  # AdamW's two float32 moments
    assert dict(estimate.other_parts) == {"DDP buckets": GPT2_PARAMETERS * 4}
    assert estimate.overhead == 0  # no GPU allowances for device_type "cpu"


def test_fsdp_divides_the_state_by_the_data_parallel_size() -> None:
    ddp = gpt2_estimate(strategy="ddp", data_parallel_size=8)
    fsdp = gpt2_estimate(strategy="fsdp", data_parallel_size=8)
    assert fsdp.parameters == GPT2_PARAMETERS * 4 // 8
    assert fsdp.gradients == fsdp.parameters and fsdp.optimizer_state == 2 * fsdp.parameters
    assert fsdp.activations == ddp.activations
    assert "DDP buckets" not in dict(fsdp.other_parts) and "FSDP gathered" in dict(fsdp.other_parts)


def test_fsdp_accumulating_whole_gradients_holds_them_unsharded() -> None:
    """Reduced once per optimizer step, each rank's gradients stay whole until the step's last micro-batch: the
    whole model's worth (float32 under bf16-mixed, FSDP2's reduce dtype), on top of the sharded gradients the step
    keeps; reduce_gradients_every_micro_batch is the advice that saves exactly that."""
    with torch.device("meta"):
        whole_bytes = sum(parameter.numel() for parameter in GPT(SMALL).parameters()) * 4
    sharded = small_estimate(strategy="fsdp", data_parallel_size=4, precision="bf16-mixed")
    held = small_estimate(strategy="fsdp", data_parallel_size=4, precision="bf16-mixed", unsharded_gradients=True)
    assert dict(held.other_parts)["unsharded gradients under accumulation"] == whole_bytes
    assert held.total - sharded.total == whole_bytes
    advised = estimate_memory(lambda: GPT(SMALL), next_token_loss(SMALL.block_size, SMALL.vocab_size), 4,
                              strategy="fsdp", data_parallel_size=4, device_type="cpu", unsharded_gradients=True)
    assert dict(advised.advice)["HybridShardedStrategy's reduce_gradients_every_micro_batch"] == advised.total - whole_bytes
    ddp = small_estimate(strategy="ddp", data_parallel_size=4, unsharded_gradients=True)
    assert "unsharded gradients under accumulation" not in dict(ddp.other_parts)


def test_tensor_parallel_and_pipeline_split_the_blocks_only() -> None:
    whole = profile_network(lambda: GPT(GPT2), next_token_loss(64, GPT2.vocab_size), 1, "32-true")
    blocks = sum(whole.block_parameters)
    assert len(whole.block_parameters) == 12 and whole.other_parameters + blocks == GPT2_PARAMETERS
    assert gpt2_estimate(tensor_parallel_size=2).parameters == int((whole.other_parameters + blocks / 2) * 4)
    assert gpt2_estimate(pipeline_stages=4).parameters == int((whole.other_parameters + blocks / 4) * 4)


def test_bf16_true_halves_the_state() -> None:
    assert gpt2_estimate(precision="bf16-true").parameters == GPT2_PARAMETERS * 2


def test_activations_grow_linearly_with_the_micro_batch() -> None:
    loss = next_token_loss(SMALL.block_size, SMALL.vocab_size)
    two, four = (profile_network(lambda: GPT(SMALL), loss, batch, "32-true") for batch in (2, 4))
    # measured twice, not scaled: the saved tensors are exactly proportional to the batch
    assert sum(four.block_saved_bytes) == 2 * sum(two.block_saved_bytes)
    assert small_estimate(8).activations == pytest.approx(2 * small_estimate(4).activations, rel=0.01)


def test_activation_checkpointing_keeps_far_less() -> None:
    full, checkpointed = small_estimate(8), small_estimate(8, activation_checkpointing=True)
    assert checkpointed.activations < 0.5 * full.activations
    assert checkpointed.parameters == full.parameters


def test_bf16_roughly_halves_the_activations() -> None:
    loss = next_token_loss(1024, GPT2.vocab_size)
    full = profile_network(lambda: GPT(GPT2), loss, 1, "32-true")
    mixed = profile_network(lambda: GPT(GPT2), loss, 1, "bf16-mixed")
    ratio = sum(mixed.block_saved_bytes) / sum(full.block_saved_bytes)
    assert 0.5 <= ratio <= 0.6  # half precision, but autocast keeps the residual stream and norms in float32 on CUDA
    with torch.device("meta"):
        model = GPT(GPT2)
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name != "wpe.weight")
    assert mixed.weight_copy_bytes == matrices * 2  # the matrices' bf16 copies, kept for backward


def real_saved_bytes(config: GPTConfig, batch: int, autocast: bool) -> int:
    """Bytes autograd saves in a real CPU forward, counted once per storage, parameters left out."""
    torch.manual_seed(0)
    model = GPT(config)
    parameters = {storage_key(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if storage_key(tensor) not in parameters:
            saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    tokens = torch.zeros(batch, config.block_size, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_meta_profile_saves_what_a_real_cpu_forward_saves(precision: str) -> None:
    """The emulated autocast (CPU op lists) and the fused attention stand-in against torch's own on the CPU."""
    config = gpt_config("debug")
    profile = profile_network(lambda: GPT(config), next_token_loss(config.block_size, config.vocab_size), 2,
                              precision, device_type="cpu")
    estimated = sum(profile.block_saved_bytes) + profile.other_saved_bytes + profile.weight_copy_bytes
    assert estimated == real_saved_bytes(config, 2, autocast=precision == "bf16-mixed")


FAMILIES = {
    # dropout 0.1, as BERT trains: the CPU has no fused attention kernel with dropout and takes the math path
    "bert": lambda: BertMaskedLanguageModel("bert-tiny", vocab_size=256),
    # BatchNorm saves its input and per-channel mean and inverse std; convolutions their input and kernel
    "resnet": lambda: ImageClassifier("resnet-tiny", num_classes=10, in_channels=3, image_shape=(16, 16)),
}


def real_module_saved_bytes(module: CohortModule, batch: int, sequence_length: int, autocast: bool) -> int:
    """Bytes autograd saves in a real CPU forward of a family's training loss, once per storage, parameters left
    out. Inputs and labels are made distinct storages, as real data is (a meta example batch may share one)."""
    torch.manual_seed(0)
    network = module.plain_network()
    parameters = {storage_key(p) for p in network.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if storage_key(tensor) not in parameters:
            saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    inputs, labels = module.example_batch(batch, sequence_length, torch.device("cpu"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            module.batch_loss(network, (inputs, labels.clone()))
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_meta_profile_saves_what_a_real_cpu_step_of_each_family_saves(family: str, precision: str) -> None:
    """Through the family's own example batch and loss, as cohort doctor estimates: BERT's attention with dropout
    (the CPU's math path, (B, nh, T, T) probabilities and masks) and the ResNet's BatchNorms and convolutions."""
    module = FAMILIES[family]()
    profile = profile_network(module.plain_network, module_step_loss(module, 32), 2, precision, device_type="cpu")
    estimated = sum(profile.block_saved_bytes) + profile.other_saved_bytes + profile.weight_copy_bytes
    assert estimated == real_module_saved_bytes(module, 2, 32, autocast=precision == "bf16-mixed")


def test_repeated_blocks_are_found() -> None:
    with torch.device("meta"):
        model = GPT(GPT2)
    assert repeated_blocks(model) == list(model.blocks.values())
    assert repeated_blocks(torch.nn.Linear(2, 2)) == []
    stages = [torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1), torch.nn.Conv2d(3, 3, 1)) for _ in range(2)]
    resnet_like = torch.nn.Sequential(torch.nn.Linear(2, 2), *stages)  # stages of blocks, as a ResNet's
    assert repeated_blocks(resnet_like) == [conv for stage in stages for conv in stage]


def test_does_not_fit_names_the_need_and_what_helps() -> None:
    estimate = estimate_memory(lambda: GPT(GPT2), next_token_loss(1024, GPT2.vocab_size), 32, "32-true")
    text = estimate.describe(16 * GIB)
    assert not estimate.fits(16 * GIB) and estimate.total > 16 * GIB
    assert text.startswith(f"needs {estimate.total / GIB:.1f} GiB per device") and "does not fit" in text
    assert "activation checkpointing" in text and "micro batch 16" in text and "bf16-mixed" in text
    assert "CUDA context 1.0" in text


def test_fits_when_sharded_small_enough() -> None:
    estimate = estimate_memory(lambda: GPT(GPT2), next_token_loss(1024, GPT2.vocab_size), 4, "bf16-mixed",
                               strategy="fsdp", data_parallel_size=8)
    assert estimate.fits(16 * GIB) and "fits" in estimate.describe(16 * GIB)
    assert "does not fit" not in estimate.describe(16 * GIB)


def test_bad_layouts_and_precisions_say_what_was_wrong() -> None:
    with pytest.raises(UserError, match="trainer.precision='fp8'"):
        small_estimate(precision="fp8")
    with pytest.raises(UserError, match="use 'ddp' or 'fsdp'"):
        small_estimate(data_parallel_size=2)


def test_memory_sizes_parse() -> None:
    assert parse_memory_size("16GiB") == parse_memory_size("16 G") == 16 * GIB
    assert parse_memory_size("80GB") == 80 * 10**9
    assert parse_memory_size("512MiB") == 512 * 2**20 and parse_memory_size("1024") == 1024
    with pytest.raises(UserError, match="not a size"):
        parse_memory_size("lots")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is visible")
def test_without_a_gpu_the_size_must_be_given() -> None:
    with pytest.raises(UserError, match="give the device memory"):
        visible_device_memory()
