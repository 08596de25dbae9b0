"""Hybrid sharding (HSDP: app/strategies/hybrid_sharding.py, configs/trainer/hsdp_cpu.yaml) on 4 CPU processes
(gloo), 2 replicas x 2 shards: it trains as one process does, each rank holds half of every parameter, gradient
and optimizer state (what DDP holds / the shard size), and FSDP2's gradient collectives under accumulation are the
ones chosen: reduced once per optimizer step by default, or reduce-scattered after every micro-batch with the
replicas' all-reduce still once per step (reduce_gradients_every_micro_batch)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import HYBRID_SHARDED, assert_comparable_runs_agree, assert_weights_agree, batch_sizes, fit

pytestmark = pytest.mark.slow

SHARDS = 2  # the preset's data_parallel_size 4 / data_parallel_replicate_size 2
RECORD = ["--trainer.callbacks+=tests.helpers.ShardingRecord"]


def recorded(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / f"sharding_rank{rank}.json").read_text()) for rank in range(4)]


def hybrid_run(run_dir: Path, args: list[str], *extra: str) -> Path:
    return fit(run_dir, args, *HYBRID_SHARDED, *RECORD, f"--trainer.callbacks.out_dir={run_dir}", *extra)


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory: pytest.TempPathFactory, comparable_run_args: list[str]) -> Path:
    """COMPARABLE_RUN's global batch of 8 in micro-batches of 2, one on each of the 4 data-parallel ranks."""
    return hybrid_run(tmp_path_factory.mktemp("hsdp"), comparable_run_args, *batch_sizes(8, 2))


@pytest.fixture(scope="module")
def accumulating_runs(tmp_path_factory: pytest.TempPathFactory, debug_run_args: list[str]) -> dict[bool, Path]:
    """2 optimizer steps of 4 micro-batches per rank, under each setting of reduce_gradients_every_micro_batch."""
    return {every: hybrid_run(tmp_path_factory.mktemp(f"every_micro_batch_{every}"), debug_run_args,
                              "--trainer.max_steps", "2", *batch_sizes(16, 1), "--trainer.limit_val_batches", "0",
                              "--trainer.strategy.init_args.reduce_gradients_every_micro_batch", str(every).lower())
            for every in (False, True)}


def test_hsdp_trains_as_one_process_does(one_process_comparable_run: Path, hsdp_run: Path) -> None:
    assert_comparable_runs_agree(one_process_comparable_run, hsdp_run)


def test_each_rank_holds_one_shard_of_what_ddp_holds(hsdp_run: Path) -> None:
    """Parameters, gradients and Adam's moments: the local shards of each rank are exactly 1/SHARDS of the whole,
    which DDP holds on every rank (each of the debug model's first dimensions divides by 2: no padding)."""
    for record in recorded(hsdp_run):
        for part in ("parameters", "gradients", "optimizer_state"):
            local, whole = record[part]
            assert whole > 0 and local * SHARDS == whole, (part, local, whole)


def collectives_per_step(record: dict) -> Counter:
    """(operation, mesh dimension) -> calls per optimizer step, over the run's micro-batches."""
    steps = len({batch // record["accumulation"] for batch, *_ in record["collectives"]})
    counts = Counter((operation, dimension) for _, operation, dimension, _ in record["collectives"])
    return Counter({key: count / steps for key, count in counts.items()})


def test_gradients_are_reduced_once_per_optimizer_step_at_accumulation_1(hsdp_run: Path) -> None:
    """Every micro-batch is its step's last, so the setting changes nothing: per FSDP2 unit (the debug model's 2
    blocks and the root) one reduce-scatter over the shards and one all-reduce of the shards over the replicas,
    and its weights gathered over the shards in forward and again in backward."""
    for record in recorded(hsdp_run):
        assert record["accumulation"] == 1
        assert collectives_per_step(record) == {("reduce_scatter", "data_parallel_shard"): 3,
                                                ("all_reduce", "data_parallel_replicate"): 3,
                                                ("all_gather", "data_parallel_shard"): 2 * 3}


def batches_with(record: dict, operation: str) -> list[int]:
    return sorted({batch for batch, called, *_ in record["collectives"] if called == operation})


def test_gradient_collectives_under_accumulation_are_the_chosen_ones(accumulating_runs: dict[bool, Path]) -> None:
    """4 micro-batches per step, 2 steps. By default only each step's last micro-batch reduces (the others keep
    unsharded gradients); with reduce_gradients_every_micro_batch each reduce-scatters, and only the last all-reduces
    over the replicas. Either way the weights are gathered for every micro-batch, and the two runs train the same
    weights."""
    gathers = {("all_gather", "data_parallel_shard"): 4 * 2 * 3}
    for every_micro_batch, reduce_scatters, scattering in ((False, 3, [3, 7]), (True, 4 * 3, list(range(8)))):
        for record in recorded(accumulating_runs[every_micro_batch]):
            assert record["accumulation"] == 4
            assert collectives_per_step(record) == {("reduce_scatter", "data_parallel_shard"): reduce_scatters,
                                                    ("all_reduce", "data_parallel_replicate"): 3, **gathers}
            assert batches_with(record, "reduce_scatter") == scattering
            assert batches_with(record, "all_reduce") == [3, 7]
    assert_weights_agree(accumulating_runs[False], accumulating_runs[True])
