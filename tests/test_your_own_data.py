"""Data of one's own, written here as a user writes it (outside datamodules/, named by data.class_path): a plain
LightningDataModule of feature vectors, class labels and each sample's index, with a DataLoader that shuffles. Under
every CPU preset each data-parallel rank reads its own samples (recorded per rank, by index), together exactly the
samples one process reads in each step, and the run trains as one process does; what a loader cannot share out is
refused with one line before anything starts."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from app.cli.samples import PrintGeneratedText
from app.safety.launch_environment import replica_group
from core.precision import precision_named
from core.run_plan import RunPlan
from datamodules.own_datamodule import share_out_training_samples
from models.module import CohortModule
from models.optimizer import OptimizerSettings
from models.parallel.pipeline import PipelineSplit
from tests.helpers import (
    CONFIG_DIR, DDP_2, QUIET, assert_comparable_runs_agree, fit_in_process, one_line_error, run_in_process, scalars,
)
from tests.processes import run_cohort
from tests.test_fault_tolerance import group_run

NUM_FEATURES, NUM_CLASSES = 8, 4
TRAIN_SAMPLES, GLOBAL_BATCH, STEPS = 64, 16, 4  # the run reads every sample once


def labelled_features(num_samples: int, seed: int) -> TensorDataset:
    """Feature vectors, their class (the signs of the first two features) and their index."""
    features = torch.randn(num_samples, NUM_FEATURES, generator=torch.Generator().manual_seed(seed))
    labels = (features[:, 0] > 0).long() + 2 * (features[:, 1] > 0).long()
    return TensorDataset(features, labels, torch.arange(num_samples))


class IndexedFeatures(L.LightningDataModule):
    """A plain datamodule, as Lightning's documentation writes one."""

    global_batch_size: int | None = GLOBAL_BATCH  # per optimizer step; None: one micro batch per data-parallel rank

    def __init__(self, num_samples: int = TRAIN_SAMPLES, batch_size: int = 8, num_workers: int = 0) -> None:
        super().__init__()
        # kept under another name: what Cohort needs to know of the loader, it reads off the loader
        self.num_samples, self.batch_size, self.loader_workers = num_samples, batch_size, num_workers

    def setup(self, stage: str) -> None:
        self.train_set = labelled_features(self.num_samples, seed=0)
        self.val_set = labelled_features(32, seed=1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                          num_workers=self.loader_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class NoArguments(IndexedFeatures):
    """Its loader's batch size and workers are its own: no num_workers argument (nor any other) for a config to set."""

    def __init__(self) -> None:
        super().__init__()


class NoGlobalBatch(IndexedFeatures):
    global_batch_size = None


class WrongGlobalBatch(IndexedFeatures):
    global_batch_size = 20  # not whole micro batches of 8 on each of 2 ranks


class WrongMicroBatch(IndexedFeatures):
    micro_batch_size = 4  # but its loader yields 8


class EveryOtherSample(Sampler[int]):
    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples // 2

    def __iter__(self):  # noqa: ANN204
        return iter(range(0, self.num_samples, 2))


class OwnSampler(IndexedFeatures):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=EveryOtherSample(self.num_samples))


class SharesItself(IndexedFeatures):
    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(self.train_set, num_replicas=2, rank=0)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)


class SharesOverTheProcessGroup(IndexedFeatures):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=DistributedSampler(self.train_set))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.linear(x))


class FeatureNetwork(nn.Module):
    def __init__(self, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Linear(NUM_FEATURES, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embedding(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class FeatureClassifier(CohortModule):
    """Classifies the feature vectors; its batches are (features, labels, indices), of which it learns from two."""

    def __init__(self, optimizer: OptimizerSettings = OptimizerSettings()) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()

    def plain_network(self) -> nn.Module:
        return FeatureNetwork()

    def example_batch(self, micro_batch_size: int, sequence_length: int, device: torch.device) -> Any:
        return (torch.zeros(micro_batch_size, NUM_FEATURES, device=device),
                torch.zeros(micro_batch_size, dtype=torch.long, device=device))

    def prepare_batch(self, batch: Any, batch_idx: int) -> Any:
        features, labels = batch[:2]
        return features, labels

    def batch_loss(self, network: nn.Module, batch: Any) -> torch.Tensor:
        features, labels = batch
        return F.cross_entropy(network(features), labels)

    def pipeline_split(self) -> PipelineSplit:
        return PipelineSplit(first=("embedding",), last=("head",), embed=lambda network, x: network.embedding(x),
                             head=lambda network, x: network.head(x))


class RecordSampleIndices(Callback):
    """Writes the sample indices of every training micro-batch this process read, in order, into ``out_dir``."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if isinstance(batch, (list, tuple)):  # not a parameter server's pushes
            self.batches.append(batch[2].tolist())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        group = replica_group()
        name = f"rank{trainer.global_rank}" if group is None else f"group{group}"
        (self.out_dir / f"indices_{name}.json").write_text(json.dumps(self.batches))


def own_data_run(out_dir: Path) -> list[str]:
    return ["--model", "tests.test_your_own_data.FeatureClassifier",
            "--data", "tests.test_your_own_data.IndexedFeatures",
            "--trainer.accelerator", "cpu", "--trainer.max_steps", str(STEPS), "--val_every_n_steps", "1",
            "--trainer.gradient_clip_val", "0.1", "--trainer.log_every_n_steps", "1",
            "--model.optimizer.warmup_steps", "2", "--trainer.callbacks+=tests.test_your_own_data.RecordSampleIndices",
            f"--trainer.callbacks.out_dir={out_dir}"]


def indices_per_step(out_dir: Path, name: str, samples_per_step: int) -> list[list[int]]:
    """What one process (rank, or replica group) read, step by step: its first STEPS x ``samples_per_step`` samples.
    Only a parameter server's worker reads more: the batch it was handed when the server said stop."""
    read = [index for batch in json.loads((out_dir / f"indices_{name}.json").read_text()) for index in batch]
    assert len(read) == STEPS * samples_per_step or (name == "rank1" and len(read) == (STEPS + 1) * samples_per_step)
    return [read[step * samples_per_step:(step + 1) * samples_per_step] for step in range(STEPS)]


def preset(name: str, *extra: str) -> list[str]:
    return ["-c", str(CONFIG_DIR / "trainer" / f"{name}.yaml"), *extra]


# each preset, with the processes that read (rank or replica group) and those among them that read the same samples
PRESETS = {
    "cpu": (preset("cpu"), ["rank0"]),
    "ddp_cpu": (preset("ddp_cpu"), ["rank0", "rank1"]),
    "model_parallel_cpu": (preset("model_parallel_cpu"), ["rank0", "rank1"]),
    "pipeline_cpu": (preset("pipeline_cpu"), ["rank0"]),  # rank 1 is the same data-parallel rank: checked equal
    # one worker that may not run ahead: the server applies one process's updates in its order
    "async_ps_cpu": (preset("async_ps_cpu", "--trainer.devices", "2", "--trainer.strategy.init_args.max_staleness",
                            "0"), ["rank1"]),
    "diloco_cpu": (preset("diloco_cpu"), ["rank0", "rank1"]),
    "ddp_powersgd_cpu": (preset("ddp_powersgd_cpu"), ["rank0", "rank1"]),
    "fault_tolerant_cpu": (preset("fault_tolerant_cpu"), ["group0", "group1"]),
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("one_process")
    return fit_in_process(run_dir, [*own_data_run(run_dir), *preset("cpu")])


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_each_rank_reads_its_own_samples_and_trains_as_one_process_does(name: str, tmp_path: Path,
                                                                         one_process: Path) -> None:
    """Per step, the data-parallel ranks' samples are disjoint and together the ones one process reads (the run reads
    each sample once); the batch plan and the progress count samples; the losses and gradient norms of every step
    and the final weights are one process's (DiLoCo, which steps each rank on its own between syncs, excepted)."""
    args, readers = PRESETS[name]
    result = run_cohort(["fit", *own_data_run(tmp_path), *args, "--trainer.enable_model_summary", "false"],
                        cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = indices_per_step(one_process, "rank0", GLOBAL_BATCH)
    read = [indices_per_step(tmp_path, reader, GLOBAL_BATCH // len(readers)) for reader in readers]
    for step in range(STEPS):
        together = [index for ranks in read for index in ranks[step]]
        assert len(set(together)) == len(together) and set(together) == set(expected[step])  # disjoint, complete
    assert sorted(index for step in expected for index in step) == list(range(TRAIN_SAMPLES))
    if name == "pipeline_cpu":
        assert indices_per_step(tmp_path, "rank1", GLOBAL_BATCH) == read[0]
    output = result.stdout + result.stderr
    assert "16 samples per" in output and "tokens" not in output, output[-3000:]
    if name == "fault_tolerant_cpu":
        for group in range(2):
            assert_comparable_runs_agree(one_process, group_run(tmp_path, group))
    elif name == "diloco_cpu":
        assert len(scalars(tmp_path, "train/loss")) == STEPS
    else:
        assert_comparable_runs_agree(one_process, tmp_path)


@pytest.mark.parametrize("data, layout, refusal", [
    ("WrongMicroBatch", [], "WrongMicroBatch.micro_batch_size=4 but its train_dataloader yields batches of 8"),
    ("WrongGlobalBatch", DDP_2, "WrongGlobalBatch.global_batch_size=20 is not a multiple of its train_dataloader's "
                                "batch_size 8 x 2 data-parallel ranks = 16"),
    ("OwnSampler", DDP_2, "OwnSampler's train_dataloader reads with EveryOtherSample, which Cohort cannot share out "
                          "over 2 processes"),
    ("SharesItself", preset("async_ps_cpu"), "SharesItself's train_dataloader reads with DistributedSampler, but the "
                                             "parameter server hands out global batches by number"),
    ("SharesItself", preset("pipeline_cpu"), "SharesItself's train_dataloader shares its samples out with a "
                                             "DistributedSampler, over the 2 processes, but only 1 of them"),
    ("SharesOverTheProcessGroup", DDP_2, "SharesOverTheProcessGroup's training loader could not be made before start "
                                         "(ValueError: Default process group has not been initialized"),
    ("IndexedFeatures", ["--trainer.use_distributed_sampler", "true"], "trainer.use_distributed_sampler must stay "
                                                                       "false"),
], ids=["micro-batch-disagrees", "global-batch-disagrees", "own-sampler-ddp", "distributed-sampler-async",
        "distributed-sampler-pipeline", "loader-needs-a-process-group", "lightning-sampler"])
def test_what_your_data_cannot_do_is_refused_before_it_starts(data: str, layout: list[str], refusal: str,
                                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = [*own_data_run(tmp_path), "--data", f"tests.test_your_own_data.{data}", *QUIET, *layout]
    for command in (["fit"], ["fit", "--print_config"]):
        assert refusal in one_line_error([*command, *args], monkeypatch)


@pytest.mark.parametrize("order", ["data, then preset", "preset, then data", "config file, then preset"])
def test_a_datamodule_without_a_num_workers_argument_takes_the_fault_tolerant_preset(
        order: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The preset sets nothing in the data (its groups read without workers: the strategy's loader has none), so a
    datamodule with no num_workers argument passes its checks, named before the preset or after it."""
    monkeypatch.chdir(tmp_path)
    data = ["--data", "tests.test_your_own_data.NoArguments"]
    config = tmp_path / "own.yaml"
    config.write_text("data:\n  class_path: tests.test_your_own_data.NoArguments\n")
    fault_tolerant = preset("fault_tolerant_cpu")
    given = {"data, then preset": [*data, *fault_tolerant], "preset, then data": [*fault_tolerant, *data],
             "config file, then preset": ["-c", str(config), *fault_tolerant]}[order]
    with pytest.raises(SystemExit) as exit_info:
        run_in_process(["fit", "--model", "tests.test_your_own_data.FeatureClassifier", *given, "--print_config"],
                       monkeypatch)
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: tests.test_your_own_data.NoArguments" in printed and "FaultTolerantStrategy" in printed


def test_the_batch_plan_is_read_from_the_loader(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A datamodule that states no global batch: one micro batch (its loader's batch_size) per data-parallel rank,
    counted in samples."""
    run = [*own_data_run(tmp_path), "--data", "tests.test_your_own_data.NoGlobalBatch", "--data.batch_size", "4",
           "--trainer.max_steps", "1", "--trainer.enable_model_summary", "false"]
    fit_in_process(tmp_path, run)
    assert ("batch plan: global batch 4 = micro batch 4 x 1 data-parallel ranks x 1 accumulation steps; 4 samples per "
            "optimizer step") in caplog.text
    assert "samples/s (all ranks)" in caplog.text  # the run summary


class OwnDefaults(IndexedFeatures):
    """Arguments named as LanguageModelingDataModule's (global_batch_size 32, micro_batch_size 8, sequence_length
    128), with defaults of its own."""

    def __init__(self, global_batch_size: int = 16, micro_batch_size: int = 4, sequence_length: int = 1) -> None:
        super().__init__(batch_size=micro_batch_size)
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.sequence_length = sequence_length


class OwnDefaultsClassifier(FeatureClassifier):
    """Arguments named as GPTLanguageModel's (dropout 0.0, learning rate 6e-4), with defaults of its own."""

    def __init__(self, dropout: float = 0.25,
                 optimizer: OptimizerSettings = OptimizerSettings(learning_rate=0.01)) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()


OWN_DEFAULTS_PLAN = ("batch plan: global batch 16 = micro batch 4 x 1 data-parallel ranks x 4 accumulation steps; "
                     "16 samples per optimizer step")


@pytest.mark.parametrize("given", ["--model/--data", "class_path", "config file"])
def test_the_classes_chosen_train_with_their_own_defaults(given: str, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A family and a datamodule named instead of the defaults (GPT, LanguageModelingDataModule) take their own
    defaults for the arguments the defaults also have, however they are named; the values a config gives stay."""
    family, data = "tests.test_your_own_data.OwnDefaultsClassifier", "tests.test_your_own_data.OwnDefaults"
    config = tmp_path / "own.yaml"
    config.write_text(f"model:\n  class_path: {family}\ndata:\n  class_path: {data}\n")
    named = {"--model/--data": ["--model", family, "--data", data],
             "class_path": ["--model.class_path", family, "--data.class_path", data],
             "config file": ["-c", str(config)]}[given]
    run = [*named, "--trainer.accelerator", "cpu", "--trainer.max_steps", "1"]
    fit_in_process(tmp_path, run)
    assert OWN_DEFAULTS_PLAN in caplog.text
    hparams = yaml.safe_load((tmp_path / "lightning_logs/version_0/hparams.yaml").read_text())
    assert hparams["dropout"] == 0.25 and hparams["optimizer"]["learning_rate"] == 0.01, hparams
    caplog.clear()
    fit_in_process(tmp_path / "given", [*run, "--data.global_batch_size", "32", "--model.dropout", "0.0"])
    assert "global batch 32 = micro batch 4 x 1 data-parallel ranks x 8 accumulation steps" in caplog.text


class InOrder(IndexedFeatures):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size)


@pytest.mark.parametrize("data, in_order", [(IndexedFeatures, False), (InOrder, True)], ids=["shuffled", "in-order"])
def test_each_data_parallel_rank_gets_its_share_of_every_global_batch(data: type[IndexedFeatures],
                                                                      in_order: bool) -> None:
    """Two data-parallel ranks' loaders: micro-batches of the loader's batch size, together each global batch once,
    in the loader's order kind (a loader without shuffle reads the samples in order)."""
    plan = RunPlan(devices_per_node=2, num_nodes=1, data_parallel_size=2, tensor_parallel_size=1,
                   global_batch_size=GLOBAL_BATCH, micro_batch_size=8, sequence_length=1,
                   precision=precision_named("32-true"), seed=1337)
    per_rank = []
    for rank in range(2):
        datamodule = data()
        datamodule.setup("fit")
        share_out_training_samples(datamodule, plan, rank, current_step=lambda: 0)
        per_rank.append([batch[2].tolist() for batch in datamodule.train_dataloader()])
    assert [len(batches) for batches in per_rank] == [STEPS, STEPS]
    steps = [sorted(per_rank[0][step] + per_rank[1][step]) for step in range(STEPS)]
    assert sorted(index for step in steps for index in step) == list(range(TRAIN_SAMPLES))
    assert (steps == [list(range(step * 16, (step + 1) * 16)) for step in range(STEPS)]) == in_order


def test_the_quickstart_sample_is_skipped_for_data_without_a_vocabulary() -> None:
    """configs/quickstart.yaml's PrintGeneratedText stays on when the README's example names a datamodule of one's
    own after it: it has nothing to print for such data, and must not end the run in an AttributeError."""
    PrintGeneratedText().on_train_end(SimpleNamespace(datamodule=IndexedFeatures()), FeatureClassifier())


class WholeBatchClassifier(FeatureClassifier):
    """A family of the three methods alone: its loss reads the data's batch as it comes, (features, labels, indices)."""

    def prepare_batch(self, batch: Any, batch_idx: int) -> Any:
        return batch

    def example_batch(self, micro_batch_size: int, sequence_length: int, device: torch.device) -> Any:
        return (*super().example_batch(micro_batch_size, sequence_length, device),
                torch.zeros(micro_batch_size, dtype=torch.long, device=device))

    def batch_loss(self, network: nn.Module, batch: Any) -> torch.Tensor:
        features, labels, _ = batch
        return F.cross_entropy(network(features), labels)


def test_a_family_whose_batch_is_not_inputs_and_targets_validates(tmp_path: Path) -> None:
    """Validation weighs each batch by its samples, where it is not (inputs, targets) to count the targets of."""
    run = [*own_data_run(tmp_path), "--model", "tests.test_your_own_data.WholeBatchClassifier",
           "--trainer.max_steps", "1", "--trainer.enable_model_summary", "false"]
    fit_in_process(tmp_path, run)
    assert scalars(tmp_path, "val/loss")
