"""What ``checkpoint.async_save`` saves: how long each save holds the training loop, written synchronously or in the
background, and how fast training steps while a background write goes on, side by side in one run.

    python -m benchmarks.async_checkpoint                      # gpt2 (124 M parameters), 16 saves
    python -m benchmarks.async_checkpoint --saves 8 --every 6

One ``cohort fit`` of the GPT-2 shape (models/gpt/network.py "gpt2", its 50,257-token vocabulary: 124,439,808
parameters, a 1.4 GiB checkpoint with AdamW's moments) on random token ids, one process, float32, one sequence of
``--sequence-length`` tokens per step (a step takes seconds on a CPU). A checkpoint every ``--every`` steps; the
benchmark's callback sets ``checkpoint.async_save`` before each save, alternating synchronous and background, so
both kinds save the same model in the same run, interleaved in time: the saves are the repeats, and medians are
reported. The first save of each kind warms up (the first background save allocates the CPU buffers it copies into;
later ones reuse them) and is shown apart. Training ends half an interval after the last periodic save; the save at
the end, which waits for its own write, is not counted.

Blocking time is what the run logs as ``checkpoint/blocking_seconds``: for a synchronous save, the NaN check, the
write, the move into place, the removal of the oldest checkpoint and the ``last.ckpt`` link; for a background save,
the NaN check and the copy into CPU memory, plus, once the write is over, the same move, removal and link (and any
wait, should a later save come before the write is over). Step time is from the start of a training batch to its end
(a save at a step's end is not in it). For each background save, the steps entirely during its write are compared
with the steps of the interval before it, when no write was going on: the machine's load drifts, and neighbours
share it. Goal: background blocking at most 10 % of synchronous blocking.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.safety.checkpoint_writing import RunCheckpoint
from models.gpt.network import gpt_config

REPO_ROOT = Path(__file__).resolve().parent.parent
VOCAB_SIZE = gpt_config("gpt2").vocab_size


class AlternatingSaves(Callback):
    """Sets checkpoint.async_save before each save, alternating (the first save synchronous), and writes every
    step's time and whether a background write was going on around it to ``out`` as JSON."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.started = time.perf_counter()
        self.writing_at_start = writing(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning calls the checkpoint callback after this one: a save at this step's end is not in its time
        self.steps.append({"step": trainer.global_step, "seconds": time.perf_counter() - self.started,
                           "writing_at_start": self.writing_at_start, "writing_at_end": writing(trainer)})
        checkpoint = trainer.checkpoint_callback
        checkpoint.async_save = (trainer.global_step // checkpoint._every_n_train_steps) % 2 == 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path(self.out).write_text(json.dumps(self.steps))


def writing(trainer: L.Trainer) -> bool:
    """Whether a background checkpoint write is going on now."""
    checkpoint = trainer.checkpoint_callback
    pending = checkpoint._pending if isinstance(checkpoint, RunCheckpoint) else None
    return pending is not None and not pending.written_here()


def random_tokens(folder: Path, train_tokens: int) -> Path:
    """train.bin and val.bin of random GPT-2 token ids (uint16): the loss does not matter here, the shapes do."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    for split, count in (("train", train_tokens), ("val", 4096)):
        generator.integers(0, VOCAB_SIZE, count, dtype=np.uint16).tofile(folder / f"{split}.bin")
    return folder


def run_fit(workdir: Path, data: Path, every: int, saves: int, sequence_length: int) -> Path:
    """The benchmark's run in ``workdir``: ``saves`` periodic saves, then half an interval more, so that the save
    at the end of training, which waits for its own write, is not among them."""
    out = workdir / "steps.json"
    command = [sys.executable, "-m", "app", "fit", "--model.model_name", "gpt2", "--data.vocab_size", str(VOCAB_SIZE),
               "--data.data_dir", str(data), "--data.sequence_length", str(sequence_length),
               "--data.global_batch_size", "1", "--data.micro_batch_size", "1", "--data.num_workers", "0",
               "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true",
               "--trainer.max_steps", str(every * saves + every // 2), "--trainer.limit_val_batches", "0",
               "--trainer.log_every_n_steps", "1000", "--trainer.enable_progress_bar", "false",
               "--model.max_new_tokens", "0", "--checkpoint.every_n_train_steps", str(every),
               "--trainer.callbacks+=benchmarks.async_checkpoint.AlternatingSaves", f"--trainer.callbacks.out={out}"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"the run failed:\n{result.stderr[-3000:]}")
    return workdir


def in_background(step: int, every: int) -> bool:
    """Whether AlternatingSaves had the save of ``step`` written in the background."""
    return (step // every) % 2 == 0


def logged(run_dir: Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(run_dir / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def step_rates(steps: list[dict[str, Any]], every: int) -> list[tuple[float, float]]:
    """For each background save: (median seconds of the steps entirely during its write, median seconds of the
    steps of the interval before it, when no write was going on); the neighbours share the machine's load."""
    pairs = []
    for saved_at in range(2 * every, len(steps), 2 * every):
        before = [step["seconds"] for step in steps if saved_at - every < step["step"] <= saved_at
                  and not step["writing_at_start"]]
        during = [step["seconds"] for step in steps if saved_at < step["step"] <= saved_at + every
                  and step["writing_at_start"] and step["writing_at_end"]]
        if before and during:
            pairs.append((statistics.median(during), statistics.median(before)))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=16, help="periodic saves, half of each kind")
    parser.add_argument("--every", type=int, default=8, help="optimizer steps between saves")
    parser.add_argument("--sequence-length", type=int, default=64, help="tokens per step (one sequence)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        data = random_tokens(Path(workdir, "tokens"), (args.sequence_length + 1) * args.every * (args.saves + 1))
        run_dir = run_fit(Path(workdir), data, args.every, args.saves, args.sequence_length)
        steps = json.loads((run_dir / "steps.json").read_text())
        blocking = logged(run_dir, "checkpoint/blocking_seconds")
        write = logged(run_dir, "checkpoint/write_seconds")
        size = (run_dir / "lightning_logs/version_0/checkpoints/last.ckpt").stat().st_size
    print(f"gpt2, 1 process, {os.cpu_count()} cores, {args.sequence_length} tokens per step, a save every "
          f"{args.every} steps, {args.saves} saves; a checkpoint is {size / 2 ** 30:.2f} GiB")
    medians = {}
    for kind, background in (("sync", False), ("async", True)):
        saved_at = [step for step in sorted(blocking) if step % args.every == 0
                    and in_background(step, args.every) == background]
        first, rest = saved_at[0], saved_at[1:]  # the first of each kind warms up
        medians[kind] = statistics.median(blocking[step] for step in rest)
        print(f"{kind:5} blocking s: first {blocking[first]:.3f}, then "
              f"{', '.join(f'{blocking[step]:.3f}' for step in rest)}; median {medians[kind]:.3f}; write s: "
              f"{', '.join(f'{write[step]:.2f}' for step in rest)}")
    ratio = medians["async"] / medians["sync"]
    print(f"blocking, background / synchronous, medians after the first of each: {ratio:.3f} (goal <= 0.10)")
    pairs = step_rates(steps, args.every)
    print(f"steps/s during a background write / in the interval before it, per write: "
          f"{', '.join(f'{1 / during:.3f} / {1 / before:.3f}' for during, before in pairs)}; ratio median "
          f"{statistics.median(before / during for during, before in pairs):.2f} over {len(pairs)} writes")


if __name__ == "__main__":
    main()
