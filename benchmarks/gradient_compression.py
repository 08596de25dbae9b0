"""What gradient compression (app/gradient_compression.py) saves and costs: plain DDP, PowerSGD and bf16 side by side.

    python -m benchmarks.gradient_compression                       # 2 CPU processes, quickstart's small GPT
    python -m benchmarks.gradient_compression --steps 60 --methods none powersgd

Each method trains the quickstart recipe (configs/quickstart.yaml with configs/trainer/ddp_cpu.yaml: the small GPT,
global batch 32 x 128 tokens on 2 processes over gloo) for the same steps, so on the same tokens in the same order,
and is validated once at the end on the same windows. Bytes per optimizer step are the hooks' own counts
(comm/bytes_per_step: what each rank hands to all-reduce); "steady" is the last step's, after PowerSGD's plain
all-reduce steps (powersgd_start_step, 10 by default), "mean" is over every step. Step time is the monitor's
median rank, and on one machine's loopback it says little about a real network: the point is the bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules.prepare import prepare_corpus, stdlib_source_files

REPO_ROOT = Path(__file__).resolve().parent.parent
QUICKSTART_ON_TWO = ["-c", str(REPO_ROOT / "configs/quickstart.yaml"), "-c", str(REPO_ROOT / "configs/trainer/ddp_cpu.yaml")]


def scalars(run_dir: Path, tag: str) -> list[float]:
    events = EventAccumulator(str(run_dir / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def train(method: str, rank: int, steps: int, run_dir: Path, corpus: Path) -> dict[str, float]:
    """One ``cohort fit`` with ``method``; what it logged."""
    args = [*QUICKSTART_ON_TWO, "--data.data_dir", str(corpus), "--trainer.max_steps", str(steps), "--val_every_n_steps", str(steps),
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false", "--model.max_new_tokens", "1",
            "--checkpoint.every_n_train_steps", str(steps), "--gradient_compression.method", method,
            "--gradient_compression.powersgd_rank", str(rank)]
    run_dir.mkdir()
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "app", "fit", *args], cwd=run_dir, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{method} failed:\n{result.stderr[-3000:]}")
    sent = scalars(run_dir, "comm/bytes_per_step")
    return {"steady_bytes": sent[-1], "mean_bytes": statistics.fmean(sent),
            "gradient_bytes": scalars(run_dir, "comm/uncompressed_bytes_per_step")[-1],
            "val_loss": scalars(run_dir, "val/loss")[-1], "train_loss": scalars(run_dir, "train/loss")[-1],
            "step_s": statistics.median(scalars(run_dir, "monitor/step_s/median")), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps of each run (4,096 tokens each)")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=["none", "powersgd", "bf16"])
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        corpus = Path(folder) / "corpus"
        prepare_corpus(stdlib_source_files(), corpus)  # the quickstart's embedded corpus, built once, outside the timing
        results = {method: train(method, options.powersgd_rank, options.steps, Path(folder) / method, corpus)
                   for method in options.methods}
    plain = results.get("none")
    print(f"{options.steps} steps x 4,096 tokens each; bytes = what each rank hands to all-reduce per optimizer step")
    print("| method | bytes/step, steady | bytes/step, mean | vs DDP (steady) | val/loss | train/loss, last step | "
          "step time (median rank) | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, result in results.items():
        name = f"powersgd rank {options.powersgd_rank}" if method == "powersgd" else method
        ratio = f"{result['steady_bytes'] / plain['steady_bytes']:.4f}x" if plain else "—"
        print(f"| {name} | {result['steady_bytes']:,.0f} | {result['mean_bytes']:,.0f} | {ratio} | "
              f"{result['val_loss']:.4f} | {result['train_loss']:.4f} | {result['step_s'] * 1000:.0f} ms | "
              f"{result['wall_s']:.0f} s |")


if __name__ == "__main__":
    main()
