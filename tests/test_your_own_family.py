"""A family of one's own, written here as a user writes it (outside models/, named by model.class_path): its network
and its loss. Under every CPU preset it either trains as one process does or is refused with one
line before anything starts; a family that builds its network in its own configure_model, which Cohort cannot
shard, is refused under the sharded strategies, and caught at run time should it get past the config checks."""

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
from models.parallel.pipeline import PipelineSplit
from tests.helpers import (
    CONFIG_DIR, DDP_2, MODEL_PARALLEL, QUIET, assert_comparable_runs_agree, fit, fit_in_process, one_line_error,
    run_cohort,
)

TENSOR_PARALLEL = [*MODEL_PARALLEL, "--trainer.strategy.init_args.data_parallel_size", "1",
                   "--trainer.strategy.init_args.tensor_parallel_size", "2"]
PIPELINE = ["-c", str(CONFIG_DIR / "trainer/pipeline_cpu.yaml")]
# a server and one worker that may not run ahead: the server applies one process's updates in its order
ASYNCHRONOUS = ["-c", str(CONFIG_DIR / "trainer/async_ps_cpu.yaml"), "--trainer.devices", "2",
                "--trainer.strategy.init_args.max_staleness", "0", "--trainer.strategy.init_args.staleness_policy", "drop"]


class NextByteMLP(CohortModule):
    """Predicts each byte from the one before: an embedding, a hidden layer and a head."""

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64,
                 optimizer: OptimizerSettings = OptimizerSettings()) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()

    def plain_network(self) -> nn.Module:
        vocab_size, hidden_size = self.hparams.vocab_size, self.hparams.hidden_size
        return nn.Sequential(nn.Embedding(vocab_size, 32), nn.Linear(32, hidden_size), nn.GELU(),
                             nn.Linear(hidden_size, vocab_size))

    def batch_loss(self, network: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        return F.cross_entropy(network(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


class OwnBuildMLP(NextByteMLP):
    """The same network, built the way the README once said: in the family's own configure_model."""

    def configure_model(self) -> None:
        if self.model is None:
            self.model = self.plain_network().to(self.build_device())


class UnshardedMLP(NextByteMLP):
    """Passes the config checks, then builds its network whole, as no sharded strategy may."""

    def build(self, keep_stage: object = None) -> nn.Module:
        return self.plain_network().to(self.build_device())


class CausalLayer(nn.TransformerEncoderLayer):
    """torch's post-norm encoder layer, attending to earlier positions only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        return super().forward(x, src_mask=mask, is_causal=True)


class TinyEncoder(nn.Module):
    """A small causal Transformer from torch's own layers (not Cohort's GPT)."""

    def __init__(self, vocab_size: int, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(CausalLayer(width, nhead=2, dim_feedforward=4 * width, dropout=0.0,
                                                batch_first=True) for _ in range(layers))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class TinyEncoderLanguageModel(NextByteMLP):
    """A family with both optional plans: tensor parallelism splits each layer's feed-forward Megatron-style
    (attention, whose projection torch keeps as one raw parameter, stays replicated), and pipeline stages are cut
    between its layers."""

    def plain_network(self) -> nn.Module:
        return TinyEncoder(self.hparams.vocab_size)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        return {"layers.*.linear1": "colwise", "layers.*.linear2": "rowwise"}

    def pipeline_split(self) -> PipelineSplit:
        return PipelineSplit(first=("embedding",), last=("head",), embed=lambda network, x: network.embedding(x),
                             head=lambda network, x: network.head(x))


def family(name: str, comparable_run_args: list[str]) -> list[str]:
    """comparable_run_args for this file's family ``name`` (GPT's model_name dropped: the family has none)."""
    args = list(comparable_run_args)
    at = args.index("--model.model_name")
    del args[at:at + 2]
    return ["--model", f"tests.test_your_own_family.{name}", *args]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> dict[str, Path]:
    return {name: fit_in_process(tmp_path_factory.mktemp(name), family(name, comparable_run_args))
            for name in ("NextByteMLP", "TinyEncoderLanguageModel")}


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("NextByteMLP", DDP_2), ("NextByteMLP", MODEL_PARALLEL),
                                          ("NextByteMLP", ASYNCHRONOUS), ("TinyEncoderLanguageModel", DDP_2),
                                          ("TinyEncoderLanguageModel", MODEL_PARALLEL),
                                          ("TinyEncoderLanguageModel", TENSOR_PARALLEL),
                                          ("TinyEncoderLanguageModel", PIPELINE),
                                          ("TinyEncoderLanguageModel", ASYNCHRONOUS)],
                         ids=["mlp-ddp", "mlp-fsdp2", "mlp-asynchronous", "encoder-ddp", "encoder-fsdp2",
                              "encoder-tensor-parallel", "encoder-pipeline", "encoder-asynchronous"])
def test_your_own_family_trains_as_one_process_does(tmp_path: Path, comparable_run_args: list[str],
                                                    one_process: dict[str, Path], name: str, layout: list[str]) -> None:
    """The same validation loss and clipped gradient norm at every step, and the same final weights, as one
    process: Cohort replicated (DDP), sharded (FSDP2), split (tensor parallel), cut into stages (the pipeline) or
    served (the asynchronous parameter server) a network it has never seen."""
    assert_comparable_runs_agree(one_process[name], fit(tmp_path, family(name, comparable_run_args), *layout))


@pytest.mark.parametrize("name, layout, refusal", [
    ("NextByteMLP", TENSOR_PARALLEL, "NextByteMLP has no tensor-parallel plan"),
    ("NextByteMLP", PIPELINE, "NextByteMLP has no pipeline split"),
    ("OwnBuildMLP", MODEL_PARALLEL, "OwnBuildMLP builds its network in its own configure_model"),
], ids=["mlp-tensor-parallel", "mlp-pipeline", "own-build-fsdp2"])
def test_what_your_family_cannot_do_is_refused_before_it_starts(name: str, layout: list[str], refusal: str,
                                                                 comparable_run_args: list[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for command in (["fit"], ["fit", "--print_config"], ["validate"]):
        assert refusal in one_line_error([*command, *family(name, comparable_run_args), *QUIET, *layout], monkeypatch)


@pytest.mark.slow
def test_a_network_left_unsharded_is_caught_at_run_time(tmp_path: Path, comparable_run_args: list[str]) -> None:
    """A family whose own code gets past the config checks (here: it overrides ``build``) but leaves its network
    whole on every rank: the ranks stop before the first step instead of training a replica each."""
    result = run_cohort(["fit", *family("UnshardedMLP", comparable_run_args), *MODEL_PARALLEL, *QUIET], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "UnshardedMLP's network was not sharded over the 2 processes" in result.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_replicas_that_diverge_under_tensor_parallelism_stop_the_run(tmp_path: Path,
                                                                     comparable_run_args: list[str]) -> None:
    """Tensor-parallel ranks each hold a whole copy of the layers the plan leaves out (embedding, attention, head):
    one rank's copy nudged, the replica check names that rank and the parameter."""
    args = [*family("TinyEncoderLanguageModel", comparable_run_args), *TENSOR_PARALLEL,
            "--replica_check.every_n_steps", "2", "--trainer.callbacks+=tests.helpers.PerturbWeights",
            "--trainer.callbacks.rank=1", "--trainer.callbacks.step=1"]
    result = run_cohort(["fit", *args, *QUIET], cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "cohort: error: replica check at step 2: rank(s) [1] hold different weights than rank 0 for 1 parameter "
        "slice(s), first model.embedding.weight")
