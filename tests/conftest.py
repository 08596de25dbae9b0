from __future__ import annotations

from pathlib import Path

import pytest

from datamodules.prepare import prepare_corpus, stdlib_source_files
from tests.helpers import COMPARABLE_RUN, DDP_2, batch_sizes, fit, fit_in_process, last_checkpoint


# The files whose tests take longest, in pytest-xdist's queue first (pyproject.toml: each worker takes whole files, in
# collection order): left in alphabetical order, the real-SLURM file came last and kept one worker busy for two
# minutes while the other had nothing left to do.
LONGEST_FIRST = ("test_slurm.py", "test_launch.py", "test_fault_tolerance.py", "test_families.py", "test_pipeline.py",
                 "test_parallelize.py", "test_pretrained.py", "test_precision.py", "test_parameter_server.py",
                 "test_moe_layouts.py", "test_expert_parallel.py", "test_moe_pipeline.py", "test_disk_full.py",
                 "test_hybrid_sharding.py", "test_load_from_checkpoint.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))


@pytest.fixture(scope="session")
def byte_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level corpus (about 1 MB of stdlib source) in train.bin / val.bin."""
    out = tmp_path_factory.mktemp("corpus")
    prepare_corpus(stdlib_source_files()[:60], out, val_fraction=0.1)
    return out


@pytest.fixture(scope="session")
def debug_run_args(byte_corpus: Path) -> list[str]:
    """CLI arguments for a tiny, fast, fully deterministic CPU run of the debug model."""
    return [
        "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true",
        "--trainer.log_every_n_steps", "1",
        "--trainer.limit_val_batches", "4",
        "--model.model_name", "debug",
        "--model.optimizer.warmup_steps", "2",
        "--data.data_dir", str(byte_corpus),
        "--data.sequence_length", "64",
    ]


@pytest.fixture(scope="session")
def comparable_run_args(debug_run_args: list[str]) -> list[str]:
    """debug_run_args with COMPARABLE_RUN: a short clipped run that every parallel layout should train alike."""
    return [*debug_run_args, *COMPARABLE_RUN]


@pytest.fixture(scope="session")
def one_process_comparable_run(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> Path:
    """The one-process run of comparable_run_args that the sharded and pipelined runs are compared with."""
    return fit_in_process(tmp_path_factory.mktemp("one_process"), comparable_run_args)


@pytest.fixture(scope="session")
def one_process_comparable_run_resumed(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str],
                                       one_process_comparable_run: Path) -> Path:
    """A new one-process run from one_process_comparable_run's last checkpoint (step 4) to step 6: what a run
    resumed from a checkpoint of step 4 in another layout is compared with."""
    return fit_in_process(tmp_path_factory.mktemp("one_process_resumed"), comparable_run_args, "--trainer.max_steps",
                          "6", "--ckpt_path", str(last_checkpoint(one_process_comparable_run)))


@pytest.fixture(scope="session")
def restart_run_args(debug_run_args: list[str]) -> list[str]:
    """8 steps on 2 processes (DDP) with dropout and a checkpoint every 3: the run that torchrun's restart and
    SLURM's requeue tests kill in step 5 and resume."""
    return [*debug_run_args, *DDP_2, "--trainer.max_steps", "8", "--checkpoint.every_n_train_steps", "3",
            "--model.dropout", "0.1", *batch_sizes(4, 2)]


@pytest.fixture(scope="session")
def restart_run_straight(tmp_path_factory: pytest.TempPathFactory, restart_run_args: list[str]) -> Path:
    """restart_run_args never interrupted: what a restarted or requeued run must end bitwise equal to."""
    return fit(tmp_path_factory.mktemp("restart_straight"), restart_run_args)
