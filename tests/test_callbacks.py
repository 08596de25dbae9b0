"""Per-rank seeding and atomic checkpoint writes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from app.callbacks import AtomicCheckpointIO, PerRankSeed


def draw_after_seeding(rank: int, step: int, batch_idx: int) -> torch.Tensor:
    trainer = SimpleNamespace(global_rank=rank, global_step=step)
    PerRankSeed().on_train_batch_start(trainer, None, None, batch_idx)
    return torch.rand(4)


def test_randomness_differs_across_ranks_and_steps_and_repeats_exactly() -> None:
    assert torch.equal(draw_after_seeding(1, 5, 2), draw_after_seeding(1, 5, 2))
    draws = [draw_after_seeding(rank, step, batch) for rank, step, batch in [(0, 5, 2), (1, 5, 2), (0, 6, 2), (0, 5, 3)]]
    assert all(not torch.equal(a, b) for i, a in enumerate(draws) for b in draws[i + 1 :])


def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    with pytest.raises(Exception):
        io.save_checkpoint({"step": 2, "unpicklable": lambda: None}, path)
    assert torch.load(path, weights_only=False) == {"step": 1}
    io.save_checkpoint({"step": 3}, path)
    assert torch.load(path, weights_only=False) == {"step": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
