"""What gradient compression (app/strategies/gradient_compression.py) and local updates
(app/strategies/local_updates.py) save and cost: plain DDP, PowerSGD, bf16, local SGD and DiLoCo side by side.

    python -m benchmarks.gradient_compression                       # 2 CPU processes, quickstart's small GPT
    python -m benchmarks.gradient_compression --steps 96 --methods none powersgd local_sgd diloco

Each method trains the quickstart recipe (configs/quickstart.yaml with configs/trainer/ddp_cpu.yaml: the small GPT,
global batch 32 x 128 tokens on 2 processes over gloo) for the same steps, so on the same tokens in the same order,
and is validated once at the end on the same windows. Bytes per optimizer step are the hooks' own counts
(comm/bytes_per_step: what each rank hands to all-reduce, the syncs' parameters or pseudo-gradients included);
"steady" is the mean over the last ``--sync-every`` steps (a whole round of local SGD or DiLoCo, after PowerSGD's
plain all-reduce steps, powersgd_start_step, 10 by default), "mean" is over every step. Local SGD and DiLoCo sync
every ``--sync-every`` steps (8 by default); give a multiple of it as ``--steps``, so that they end and are validated
on synced weights. Step time is the monitor's
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


LOCAL_UPDATES = ("local_sgd", "diloco")


def train(method: str, rank: int, sync_every: int, steps: int, run_dir: Path, corpus: Path) -> dict[str, float]:
    """One ``cohort fit`` with ``method`` (a compression, or local updates); what it logged."""
    if method in LOCAL_UPDATES:
        method_args = ["--local_updates.method", method, "--local_updates.sync_every", str(sync_every)]
    else:
        method_args = ["--gradient_compression.method", method, "--gradient_compression.powersgd_rank", str(rank)]
    args = [*QUICKSTART_ON_TWO, "--data.data_dir", str(corpus), "--trainer.max_steps", str(steps), "--val_every_n_steps", str(steps),
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false", "--model.max_new_tokens", "1",
            "--checkpoint.every_n_train_steps", str(steps), *method_args]
    run_dir.mkdir()
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "app", "fit", *args], cwd=run_dir, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - start
    if result.returncode != 0:
        sys.exit(f"{method} failed:\n{result.stderr[-3000:]}")
    sent = scalars(run_dir, "comm/bytes_per_step")
    return {"steady_bytes": statistics.fmean(sent[-sync_every:]), "mean_bytes": statistics.fmean(sent),
            "gradient_bytes": scalars(run_dir, "comm/uncompressed_bytes_per_step")[-1],
            "val_loss": scalars(run_dir, "val/loss")[-1], "train_loss": scalars(run_dir, "train/loss")[-1],
            "step_s": statistics.median(scalars(run_dir, "monitor/step_s/median")), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=144, help="optimizer steps of each run (4,096 tokens each)")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=8, help="local SGD's and DiLoCo's H")
    parser.add_argument("--methods", nargs="+", default=["none", "powersgd", "bf16", "local_sgd", "diloco"])
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        corpus = Path(folder) / "corpus"
        prepare_corpus(stdlib_source_files(), corpus)  # the quickstart's embedded corpus, built once, outside the timing
        results = {method: train(method, options.powersgd_rank, options.sync_every, options.steps, Path(folder) / method,
                                 corpus)
                   for method in options.methods}
    plain = results.get("none")
    print(f"{options.steps} steps x 4,096 tokens each; bytes = what each rank hands to all-reduce per optimizer step")
    print("| method | bytes/step, steady | bytes/step, mean | vs DDP (steady) | vs DDP (mean) | val/loss | "
          "train/loss, last step | step time (median rank) | wall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for method, result in results.items():
        name = {"powersgd": f"powersgd rank {options.powersgd_rank}", "local_sgd": f"local_sgd H={options.sync_every}",
                "diloco": f"diloco H={options.sync_every}"}.get(method, method)
        ratios = [f"{result[kind] / plain[kind]:.4f}x" if plain else "—" for kind in ("steady_bytes", "mean_bytes")]
        print(f"| {name} | {result['steady_bytes']:,.0f} | {result['mean_bytes']:,.0f} | {ratios[0]} | {ratios[1]} | "
              f"{result['val_loss']:.4f} | {result['train_loss']:.4f} | {result['step_s'] * 1000:.0f} ms | "
              f"{result['wall_s']:.0f} s |")


if __name__ == "__main__":
    main()
