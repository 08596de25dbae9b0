"""The mixture-of-experts family under the layouts it trains in without expert parallelism: replicated (DDP), sharded
per block (FSDP2, also with its activations recomputed in backward and 2 micro-batches per step on each rank) and
split by its tensor-parallel plan (attention; the routed experts whole on each rank), each as one process trains,
dropping the same choices beyond each expert's capacity per sequence; and a sharded run killed mid-step resumes
bitwise.

Routing is discrete: a token whose k-th and (k+1)-th router probabilities swapped between two runs would go to
another expert, and the runs' outputs would differ by a whole expert's output, not by rounding. So beside the losses,
gradient norms and weights (tests/helpers.py's assert_comparable_runs_agree), every run records every router's
probabilities for every sample it routed (RouterProbabilityRecord), and the test shows that no choice can have flipped: the
reference run's smallest margin between a token's k-th and (k+1)-th probability is more than twice the largest
difference between the two runs' probabilities of any routing. (If no probability moved by more than d, the gap
between a chosen and an unchosen expert moved by at most 2d, so the chosen ones stay above.) With the same routing
the runs compute the same function, and differ only in the order of sums, which is what
assert_comparable_runs_agree's tolerances are derived for. The margin test excludes ties too: at an exact tie topk's
order, not the probabilities, picks. Measured (2 CPU cores, 2026-12-06): the reference run's smallest margin is
3.1e-6 over its 12,288 routings (6,311 of their 24,576 choices beyond the capacity, dropped); the largest differences
are 0 (DDP: bitwise) and 6.0e-8 (FSDP2, also checkpointed, and tensor parallel; 1.5e-7 without a capacity). The
margin is the seed's luck, not a property of the family: a router of the debug size at initialisation spreads its 4
probabilities over about 0.02, so among 12,288 routings the closest pair is about 0.02 / 12,288 = 1.6e-6 apart (of
seeds 1 to 16, without a capacity and with the sanity check's routings counted too, one gave an exact tie and 8 a
margin under 1e-6), hence it is measured, not assumed.
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

from models.routed_experts import MoEFeedForward, expert_capacity, moe_layers
from models.moe.network import moe_config
from tests.helpers import (
    CONFIG_DIR, DDP_2, MODEL_PARALLEL, TENSOR_PARALLEL, assert_comparable_runs_agree,
    assert_sharded_resume_after_sigkill_is_bitwise_exact, fit, fit_in_process,
)

pytestmark = pytest.mark.slow

MOE = ["-c", str(CONFIG_DIR / "moe-small/pretrain.yaml"), "--model.max_new_tokens", "0"]
# each expert takes at most ceil(1.0 x 64 tokens x 2 choices / 4 experts) = 32 choices of a sequence: a router at
# initialisation, near even, sends more than that to some expert in some sequences, whose choices beyond are dropped
DEBUG_WITH_CAPACITY = moe_config("debug", capacity_factor=1.0)


class RouterProbabilityRecord(Callback):
    """Writes, per rank, into ``out_dir``/routing_rank{R}.pt every router's probabilities (T, E) for every sample it
    routed, keyed by phase, optimizer step, layer and the sample's tokens: runs whose ranks route other shares of the
    batch are then compared routing by routing."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.probabilities: dict[str, torch.Tensor] = {}
        self.samples: list[str] = []  # the current micro-batch's samples, by their tokens
        self.phase_and_step = ""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for index, layer in enumerate(moe_layers(pl_module)):
            layer.register_forward_pre_hook(partial(self.record, index))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.read("train", trainer.global_step, batch)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:  # its batches count per rank: another layout checks other samples
            self.read("val", trainer.global_step, batch)

    def read(self, phase: str, step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.phase_and_step = f"{phase} {step}"
        self.samples = [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest() for row in batch[0]]

    def record(self, layer_index: int, layer: MoEFeedForward, inputs: tuple[torch.Tensor]) -> None:
        """The probabilities as the layer computes them from its input (again in a recomputed forward: the same)."""
        if not self.samples:  # before the first batch read: the sanity check, left out
            return
        with torch.no_grad():
            probabilities = F.linear(inputs[0].float(), layer.router.weight.float()).softmax(dim=-1)
        for sample, row in zip(self.samples, probabilities, strict=True):
            self.probabilities[f"{self.phase_and_step} layer {layer_index} {sample}"] = row.cpu()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(self.probabilities, self.out_dir / f"routing_rank{trainer.global_rank}.pt")


def record_routing(run_dir: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.test_moe_layouts.RouterProbabilityRecord", f"--trainer.callbacks.out_dir={run_dir}"]


def routing(run_dir: Path) -> dict[str, torch.Tensor]:
    """What RouterProbabilityRecord wrote on every rank, in one dict; ranks that routed the same sample (tensor parallelism's,
    which replicate the experts) must have routed it alike."""
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(run_dir.glob("routing_rank*.pt")):
        for key, probabilities in torch.load(path).items():
            assert key not in merged or torch.equal(merged[key], probabilities), f"the ranks routed {key} apart"
            merged[key] = probabilities
    return merged


def smallest_margin(probabilities: dict[str, torch.Tensor], top_k: int) -> float:
    """The smallest gap between a token's k-th and (k+1)-th router probability over every routing."""
    return min(float((top[..., top_k - 1] - top[..., top_k]).min())
               for top in (row.topk(top_k + 1, dim=-1).values for row in probabilities.values()))


def dropped_choices(probabilities: dict[str, torch.Tensor]) -> int:
    """The choices beyond an expert's capacity in each sequence's routing by one layer, counted from its top k."""
    config = DEBUG_WITH_CAPACITY
    dropped = 0
    for row in probabilities.values():  # (T, E)
        routed = torch.bincount(row.topk(config.top_k, dim=-1).indices.flatten(), minlength=config.n_expert)
        capacity = expert_capacity(config.capacity_factor, row.shape[0], config.top_k, config.n_expert)
        dropped += int((routed - capacity).clamp(min=0).sum())
    return dropped


def assert_routed_alike(one: Path, other: Path) -> None:
    """Every routing of ``one`` is in ``other`` and chose the same experts, by a margin that rounding cannot cross
    (the module's docstring)."""
    reference, compared = routing(one), routing(other)
    assert compared.keys() == reference.keys() and reference
    difference = max(float((compared[key] - reference[key]).abs().max()) for key in reference)
    margin = smallest_margin(reference, DEBUG_WITH_CAPACITY.top_k)
    assert margin > 2 * difference, (margin, difference)


@pytest.fixture(scope="module")
def moe_run(comparable_run_args: list[str]) -> list[str]:
    """COMPARABLE_RUN's 4 clipped steps of the debug MoE with a capacity, validated after each on the same 16
    windows."""
    return [*MOE, *comparable_run_args, "--model.capacity_factor", str(DEBUG_WITH_CAPACITY.capacity_factor)]


@pytest.fixture(scope="module")
def moe_one_process(tmp_path_factory: pytest.TempPathFactory, moe_run: list[str]) -> Path:
    run_dir = tmp_path_factory.mktemp("moe-one-process")
    return fit_in_process(run_dir, moe_run, *record_routing(run_dir))


@pytest.mark.parametrize("layout", [
    DDP_2, MODEL_PARALLEL, TENSOR_PARALLEL,
    [*MODEL_PARALLEL, "--model.activation_checkpointing", "true", "--data.micro_batch_size", "2"],
], ids=["ddp", "fsdp2", "tensor-parallel", "fsdp2-checkpointed-accumulating"])
def test_the_mixture_of_experts_trains_under_every_layout_as_one_process_does(
        tmp_path: Path, moe_run: list[str], moe_one_process: Path, layout: list[str]) -> None:
    """The same routing of every token at every step (RouterProbabilityRecord), hence the same dropped choices, validation loss
    and clipped gradient norm at every step and the same weights (within the Adam bound) as one process: the capacity
    and the balance loss are per sequence, so the ranks' shares of the batch change neither. The balance loss is
    computed inside the blocks that FSDP2 shards and activation checkpointing recomputes, and reaches the gradients
    alike."""
    assert dropped_choices(routing(moe_one_process)) > 0  # the capacity bites
    other = fit(tmp_path, moe_run, *layout, *record_routing(tmp_path))
    assert_routed_alike(moe_one_process, other)
    assert_comparable_runs_agree(moe_one_process, other)


def test_a_sharded_mixture_of_experts_resumes_bitwise_after_sigkill(tmp_path: Path, moe_run: list[str]) -> None:
    """FSDP2 on 2 processes, 2 micro-batches per step on each: killed mid-step 4, resumed from step 3's sharded
    checkpoint, it ends with bitwise the uninterrupted run's weights."""
    run = [*moe_run, *MODEL_PARALLEL, "--trainer.max_steps", "6", "--checkpoint.every_n_train_steps", "3",
           "--data.micro_batch_size", "2"]
    assert_sharded_resume_after_sigkill_is_bitwise_exact(tmp_path, run)
