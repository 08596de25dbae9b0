"""What the per-rank monitor (app/observability/monitor.py) costs: step time with it and without it, side by side.

    python -m benchmarks.monitoring_overhead                    # 2 CPU processes (DDP, gloo), small model
    python -m benchmarks.monitoring_overhead --processes 1 --repeats 6

Two measurements, because a 1 % difference is within the noise of a shared machine:
1. A/B: ``cohort fit`` with the monitor and with ``--monitor.enabled false``, alternating which goes first in each
   repeat; median step time over the timed steps of all repeats, and their ratio.
2. Direct: in the "with" runs the monitor is a subclass that times its own hooks (including the window's
   all-gather), so its share of the step time is measured without comparing two noisy runs. The DDP comm hook's
   wrapper and the loader's wait counter run in both variants' code paths only when the monitor is on; their cost
   is in (1), not in (2).
Goal: at most 1 % of the step time.
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
from lightning.pytorch.callbacks import Callback

from app.observability.monitor import RankMonitor

REPO_ROOT = Path(__file__).resolve().parent.parent
HOOKS = ("on_train_batch_start", "on_after_backward", "on_train_batch_end", "on_validation_start",
         "on_validation_end")


class SelfTimedRankMonitor(RankMonitor):
    """The monitor, with the time spent in its own hooks added up (rank 0 writes it out)."""

    def __init__(self, out: str, every_n_steps: int | None = None) -> None:
        super().__init__(every_n_steps=every_n_steps)
        self.out = out
        self.hook_seconds = 0.0
        for name in HOOKS:
            setattr(self, name, self._timed(getattr(self, name)))

    def _timed(self, hook: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.hook_seconds += time.perf_counter() - start
        return timed

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps({"hook_seconds": self.hook_seconds, "steps": trainer.global_step}))


class StepClock(Callback):
    """Rank 0's wall-clock time at every optimizer step, written to a JSON file at the end."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.times: list[float] = []
        self._last_step = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.times.append(time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(self.times))


def run_fit(args: argparse.Namespace, workdir: Path, corpus: Path, monitored: bool) -> tuple[list[float], float]:
    """One ``cohort fit``; returns its step durations after warmup and, when monitored, the monitor's hook time."""
    workdir.mkdir(parents=True)
    clock, hooks = workdir / "steps.json", workdir / "hooks.json"
    command = [
        sys.executable, "-m", "app", "fit", "--trainer.accelerator", "cpu", "--trainer.devices", str(args.processes),
        "--trainer.strategy", "ddp" if args.processes > 1 else "auto", "--trainer.max_steps", str(args.steps),
        "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.log_every_n_steps", "10",
        "--checkpoint.every_n_train_steps", "1000000", "--model.model_name", args.model,
        "--data.data_dir", str(corpus), "--data.global_batch_size", str(args.global_batch_size),
        "--data.micro_batch_size", str(args.micro_batch_size), "--data.sequence_length", "128",
        "--trainer.callbacks+=benchmarks.monitoring_overhead.StepClock", f"--trainer.callbacks.out={clock}",
        "--monitor.enabled", "false",  # the stock monitor is replaced by the self-timed one below, or left out
    ]
    if monitored:
        command += ["--trainer.callbacks+=benchmarks.monitoring_overhead.SelfTimedRankMonitor",
                    f"--trainer.callbacks.out={hooks}", "--trainer.callbacks.every_n_steps=10"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"}
    subprocess.run(command, cwd=workdir, env=env, check=True, capture_output=True)
    times = json.loads(clock.read_text())
    durations = [later - earlier for earlier, later in zip(times, times[1:])][args.warmup_steps:]
    hook_seconds = json.loads(hooks.read_text())["hook_seconds"] if monitored else 0.0
    return durations, hook_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    args = parser.parse_args()

    from datamodules.prepare import prepare_corpus, stdlib_source_files

    with tempfile.TemporaryDirectory(prefix="monitoring_overhead_") as scratch:
        root = Path(scratch)
        prepare_corpus(stdlib_source_files()[:100], root / "corpus")
        steps: dict[bool, list[float]] = {True: [], False: []}
        hook_share = []
        for repeat in range(args.repeats):
            for monitored in ((True, False) if repeat % 2 == 0 else (False, True)):
                durations, hook_seconds = run_fit(args, root / f"r{repeat}-{monitored}", root / "corpus", monitored)
                steps[monitored] += durations
                if monitored:
                    hook_share.append(hook_seconds / (args.steps * statistics.median(durations)))
                print(f"repeat {repeat} {'with' if monitored else 'without'} monitor: "
                      f"median {statistics.median(durations):.4f} s/step", flush=True)
    with_monitor, without = statistics.median(steps[True]), statistics.median(steps[False])
    print(f"\n{args.processes} process(es), model {args.model}, global batch {args.global_batch_size}, micro "
          f"{args.micro_batch_size}, {args.steps} steps x {args.repeats} repeats ({args.warmup_steps} warmup dropped)")
    print(f"step time with monitor {with_monitor:.4f} s, without {without:.4f} s: ratio {with_monitor / without:.4f}")
    print(f"monitor hooks' own time: {statistics.median(hook_share):.3%} of the step time (median over repeats)")


if __name__ == "__main__":
    main()
