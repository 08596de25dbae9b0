"""What asynchronous training (app/strategies/parameter_server/) gains over synchronous DDP when one worker is slow.

    python -m benchmarks.async_training                 # 120 updates each, one worker 3x slower
    python -m benchmarks.async_training --learning-rate 1e-3 --runs "async, max_staleness 1, scale"

Both train the quickstart recipe (configs/quickstart.yaml: the small GPT, global batch 32 x 128 tokens) for the same
number of optimizer steps, so on the same number of tokens, with one thread per process:

    sync   configs/trainer/ddp_cpu.yaml: 2 DDP ranks, each half of every global batch; rank 1 slowed
    async  configs/trainer/async_ps_cpu.yaml: the server and 2 workers, each worker whole global batches; worker 2
           slowed; with the preset's staleness settings (max_staleness 1, drop: the slow worker's gradients, 3-4
           updates behind, are dropped) and with two that apply them (lr / staleness beyond 1, or as they are up to 4)

The slow rank is made ``--slow-factor`` times slower by tests.helpers.SlowRankByFactor: inside every micro-batch it
sleeps (factor - 1) times what its previous micro-batch took. Tokens/s is rank 0's (the server's) updates between the
first and the last logged step, from TensorBoard's wall times, so start-up and the final validation are left out.
Both runs are validated once at the end, on the same windows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules.prepare import prepare_corpus, stdlib_source_files

REPO_ROOT = Path(__file__).resolve().parent.parent
ASYNC = ["-c", str(REPO_ROOT / "configs/trainer/async_ps_cpu.yaml")]
LAYOUTS = {  # name: (trainer flags, the rank slowed)
    "sync (DDP)": (["-c", str(REPO_ROOT / "configs/trainer/ddp_cpu.yaml")], 1),
    "async, the preset: max_staleness 1, drop": (ASYNC, 2),
    "async, max_staleness 1, scale": ([*ASYNC, "--trainer.strategy.init_args.staleness_policy", "scale"], 2),
    "async, max_staleness 4, scale": ([*ASYNC, "--trainer.strategy.init_args.max_staleness", "4",
                                       "--trainer.strategy.init_args.staleness_policy", "scale"], 2),
}


def train(layout: str, steps: int, slow_factor: float, learning_rate: float, data_dir: Path,
          run_dir: Path) -> dict[str, float]:
    preset, slow_rank = LAYOUTS[layout]
    run_dir.mkdir(parents=True)
    command = [sys.executable, "-m", "app", "fit", "-c", str(REPO_ROOT / "configs/quickstart.yaml"), *preset,
               "--data.data_dir", str(data_dir), "--model.optimizer.learning_rate", str(learning_rate),
               "--trainer.max_steps", str(steps), "--val_every_n_steps", str(steps),
               "--trainer.log_every_n_steps", "10", "--trainer.enable_progress_bar", "false",
               "--trainer.callbacks+=tests.helpers.SlowRankByFactor", f"--trainer.callbacks.rank={slow_rank}",
               f"--trainer.callbacks.factor={slow_factor}"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{layout} run failed:\n{result.stderr[-3000:]}")
    events = EventAccumulator(str(run_dir / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    losses = events.Scalars("train/loss")
    first, last = losses[0], losses[-1]
    tokens = (last.step - first.step) * 32 * 128
    summary = next((line for line in result.stdout.splitlines() + result.stderr.splitlines()
                    if line.startswith("parameter server:")), "")
    return {"tokens_per_second": tokens / (last.wall_time - first.wall_time),
            "val_loss": events.Scalars("val/loss")[-1].value, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps (updates) of each run")
    parser.add_argument("--slow-factor", type=float, default=3.0, help="how many times slower the slow rank is")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak learning rate (the quickstart's)")
    parser.add_argument("--runs", nargs="+", choices=list(LAYOUTS)[1:], default=list(LAYOUTS)[1:],
                        help="the asynchronous runs to compare with the synchronous one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = Path(scratch) / "corpus"
        prepare_corpus(stdlib_source_files(), data_dir)
        results = {layout: train(layout, args.steps, args.slow_factor, args.learning_rate, data_dir,
                                 Path(scratch) / f"run{index}")
                   for index, layout in enumerate(["sync (DDP)", *args.runs])}
    sync = results["sync (DDP)"]
    print(f"| run | tokens/s | vs sync | val loss after {args.steps} steps ({args.steps * 32 * 128:,} tokens) | vs sync |")
    print("| --- | --- | --- | --- | --- |")
    for layout, result in results.items():
        print(f"| {layout} | {result['tokens_per_second']:,.0f} | "
              f"{result['tokens_per_second'] / sync['tokens_per_second']:.2f}x | {result['val_loss']:.3f} | "
              f"{100 * (result['val_loss'] / sync['val_loss'] - 1):+.1f} % |")
    for layout, result in results.items():
        if result["summary"]:
            print(f"{layout}: {result['summary']}")

if __name__ == "__main__":
    main()
