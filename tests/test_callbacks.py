"""Per-rank seeding, checkpoints moved into place whole, and the NCCL flight recorder's settings."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.distributed_c10d

from app.observability.flight_recorder import NcclFlightRecorder
from app.safety.atomic_paths import replace_path
from app.safety.determinism import PerRankSeed, SameThreadsOnEveryRank, oversubscription_advice
from core.precision import PRECISIONS
from core.run_plan import RunPlan


def draw_after_seeding(rank: int, step: int, batch_idx: int) -> torch.Tensor:
    plan = RunPlan(devices_per_node=2, num_nodes=1, data_parallel_size=2, tensor_parallel_size=1, global_batch_size=4,
                   micro_batch_size=2, sequence_length=8, precision=PRECISIONS["32-true"], seed=1337)
    trainer = SimpleNamespace(global_rank=rank, global_step=step)
    PerRankSeed().on_train_batch_start(trainer, SimpleNamespace(run_plan=plan), None, batch_idx)
    return torch.rand(4)


def test_randomness_differs_across_ranks_and_steps_and_repeats_exactly() -> None:
    assert torch.equal(draw_after_seeding(1, 5, 2), draw_after_seeding(1, 5, 2))
    draws = [draw_after_seeding(rank, step, batch) for rank, step, batch in [(0, 5, 2), (1, 5, 2), (0, 6, 2), (0, 5, 3)]]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1 :])


def write_checkpoint(path: Path, sharded: bool, step: int) -> None:
    if sharded:
        path.mkdir()
        (path / "meta.pt").write_text(str(step))
    else:
        path.write_text(str(step))


def read_step(path: Path) -> int:
    return int((path / "meta.pt" if path.is_dir() else path).read_text())


@pytest.mark.parametrize("omp_threads_over_cpus", [None, 1])
def test_the_thread_count_is_set_only_where_it_differs(monkeypatch: pytest.MonkeyPatch,
                                                        omp_threads_over_cpus: int | None) -> None:
    """Setting torch's count, even to the one it has, turns MKL's dynamic threading off and slows CPU training
    (benchmarks/RESULTS.md): one process with every CPU already has the count it needs."""
    cpus = len(os.sched_getaffinity(0))
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: cpus)  # torch's default: every CPU
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # an idle machine, whatever this one's load
    if omp_threads_over_cpus is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", str(cpus + omp_threads_over_cpus))
    SameThreadsOnEveryRank().setup(SimpleNamespace(num_devices=1), None, "fit")
    assert calls == ([] if omp_threads_over_cpus is None else [cpus + omp_threads_over_cpus])


@pytest.mark.parametrize(("threads", "processes", "cpus", "load", "advice"), [
    (2, 1, 2, 0.3, None),  # an idle machine: every thread has a core
    (2, 1, 2, 5.0, "OMP_NUM_THREADS=1"),  # the 2-core machine busy with other work that ran 20-70x slower
    (8, 2, 16, 0.4, None),  # 2 processes sharing 16 cores
    (8, 2, 16, 12.0, "OMP_NUM_THREADS=2"),
    (1, 4, 2, 9.0, None),  # one thread each: nothing OMP_NUM_THREADS could change
])
def test_threads_beyond_the_free_cores_get_a_line_saying_what_to_set(
        threads: int, processes: int, cpus: int, load: float, advice: str | None) -> None:
    line = oversubscription_advice(threads, processes, cpus, load)
    assert (line is None) == (advice is None) and (advice is None or line.endswith(f"set {advice}")), line


def test_the_threads_line_is_printed_as_the_run_starts(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (len(os.sched_getaffinity(0)) + 3.0, 0.0, 0.0))  # every core busy
    with caplog.at_level(logging.INFO):
        SameThreadsOnEveryRank().setup(SimpleNamespace(num_devices=1), None, "fit")
    assert "threads: 1 process x 2 threads" in caplog.text and "set OMP_NUM_THREADS=1" in caplog.text


def test_a_new_checkpoint_replaces_the_old_one_whole_file_or_folder(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    for step, sharded in enumerate([False, False, True, True, False], start=1):  # strategies change across resumes
        partial = tmp_path / "last.ckpt.partial"
        write_checkpoint(partial, sharded, step)
        replace_path(partial, target)
        assert read_step(target) == step and target.is_dir() == sharded
        assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_last_is_relinked_to_the_newest_checkpoint_over_a_link_or_an_older_whole_last(tmp_path: Path) -> None:
    """last.ckpt links to the newest step checkpoint; it may replace a link, or a file or folder an older Cohort
    wrote as last.ckpt itself. The checkpoint a replaced link pointed to is left alone."""
    target = tmp_path / "last.ckpt"
    write_checkpoint(target, sharded=True, step=0)  # an old-style last.ckpt folder
    for step, sharded in enumerate([True, False, False], start=1):
        write_checkpoint(tmp_path / f"step={step}.ckpt", sharded, step)
        link = tmp_path / "last.ckpt.partial"
        link.symlink_to(f"step={step}.ckpt")
        replace_path(link, target)
        assert target.is_symlink() and read_step(target) == step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=1.ckpt", "step=2.ckpt", "step=3.ckpt"]


def test_the_flight_recorder_dumps_into_the_run_folder_unless_the_user_said_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    recorder = NcclFlightRecorder(tmp_path / "version_3")
    assert int(os.environ["TORCH_FR_BUFFER_SIZE"]) > 0 and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "version_3" / "flight_recorder" / "rank_")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert not recorder.folder.exists()  # made only once the process group exists
    recorder.setup(None, None, "fit")
    assert recorder.folder.is_dir()
    # the name this torch reads for the buffer (the older TORCH_NCCL_TRACE_BUFFER_SIZE is its fallback)
    assert "TORCH_FR_BUFFER_SIZE" in Path(torch.distributed.distributed_c10d.__file__).read_text()
